"""Agent RL: multi-turn rollouts with tools and environments, as token-in / token-out pytree batches.

* :mod:`~rlcore.agent.protocols` -- :class:`Environment` (``reset`` / ``step``) and :class:`StepResult`;
* :mod:`~rlcore.agent.tools` -- :class:`Tool`, :func:`tool`, :func:`call_tool` (sync or async, with a timeout);
* :mod:`~rlcore.agent.parsers` -- :class:`HermesParser` for ``<tool_call>{json}</tool_call>``;
* :mod:`~rlcore.agent.tool_env` -- :class:`ToolEnv`, an environment made of tools;
* :mod:`~rlcore.agent.runner` -- :class:`StepRunner`, environment calls off the generation thread;
* :mod:`~rlcore.agent.threads` -- :func:`in_daemon_thread`, :func:`labelled`: user code that hangs or blocks;
* :mod:`~rlcore.agent.rollout` -- :func:`multi_turn_rollout`; :mod:`~rlcore.agent.stage` -- :func:`multi_turn_stage`;
* :mod:`~rlcore.agent.config` -- the ``rl.multi_turn`` section; :func:`rlcore.references.load_reference` for ``"file.py:Name"``;
* :mod:`~rlcore.agent.calc` -- the shipped task (multiplication with a calculator).

The trajectories carry ``mask`` = 1 on policy tokens only, so every recipe of
:mod:`rlcore.algos` trains on them unchanged (observation tokens are holes in the mask;
:func:`rlcore.algos.gae` carries values and advantages through them).
"""

from rlcore.agent.calc import Multiplication, calculator, evaluate_arithmetic
from rlcore.agent.config import MultiTurnConfig, build_env_factory, build_tools, parse_multi_turn, stop_token_ids
from rlcore.agent.decode import Turn, sample_turn
from rlcore.agent.logprobs import trajectory_logprobs
from rlcore.agent.metrics import trajectory_metrics
from rlcore.agent.observation import observation_encoder
from rlcore.agent.parsers import HermesParser, ParsedCalls, ToolCall, ToolCallParser
from rlcore.agent.protocols import Environment, Observation, StepResult, TurnSampler
from rlcore.agent.rollout import TRAJECTORY_KEYS, multi_turn_rollout
from rlcore.agent.runner import StepRunner
from rlcore.agent.stage import STAGE_OUTPUTS, multi_turn_stage, trajectory_rows
from rlcore.agent.threads import in_daemon_thread, labelled, running_label
from rlcore.agent.tokenizer import SpecialCharTokenizer
from rlcore.agent.tool_env import ToolEnv
from rlcore.agent.tools import Tool, ToolError, call_tool, tool

__all__ = [
    "STAGE_OUTPUTS",
    "TRAJECTORY_KEYS",
    "Environment",
    "HermesParser",
    "MultiTurnConfig",
    "Multiplication",
    "Observation",
    "ParsedCalls",
    "SpecialCharTokenizer",
    "StepResult",
    "StepRunner",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolEnv",
    "ToolError",
    "Turn",
    "TurnSampler",
    "build_env_factory",
    "build_tools",
    "calculator",
    "call_tool",
    "evaluate_arithmetic",
    "in_daemon_thread",
    "labelled",
    "multi_turn_rollout",
    "multi_turn_stage",
    "observation_encoder",
    "parse_multi_turn",
    "running_label",
    "sample_turn",
    "stop_token_ids",
    "tool",
    "trajectory_logprobs",
    "trajectory_metrics",
    "trajectory_rows",
]
