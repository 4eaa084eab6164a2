"""The agent protocols: an environment (``reset`` / ``step``) and what one step returns.

An environment is the Gym interface (Brockman et al. 2016, arXiv:1606.01540) over text:
``reset(sample) -> observation`` starts an episode for one data sample,
``step(action) -> (observation, reward, done, info)`` answers one turn of the policy.
The action is the decoded text of the policy's turn; an observation is text (tokenized
by the rollout) or a list of token ids (used as they are). Either method may be a
coroutine function (``async def``): the rollout awaits it on its own event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from rlcore.agent.decode import Turn

__all__ = ["Environment", "Observation", "StepResult", "TurnSampler"]

# Text, or token ids the rollout appends verbatim.
Observation = str | Sequence[int]


class StepResult(NamedTuple):
    """What ``Environment.step`` returns.

    Fields:
      observation: text or token ids appended after the policy's turn ("" for none).
      reward: this turn's reward; the rollout puts it on the turn's last policy token.
      done: the episode is over (no further turn).
      info: counters the rollout sums over a trajectory when present: ``tool_calls``,
        ``tool_errors`` (ints), ``tool_latency`` (seconds).

    >>> StepResult("<tool_response>42</tool_response>", 0.0, False, {"tool_calls": 1}).done
    False
    """

    observation: Observation
    reward: float
    done: bool
    info: Mapping[str, Any]


@runtime_checkable
class Environment(Protocol):
    """One episode's state: ``reset(sample) -> observation``, ``step(action) -> (observation, reward, done, info)``.

    One instance per trajectory (the rollout builds them with a factory), so an
    environment may keep state between turns. Either method may be ``async def``.

    >>> class Echo:
    ...     def reset(self, sample):
    ...         return ""
    ...     def step(self, action):
    ...         return StepResult("", float(action == "hi"), True, {})
    >>> isinstance(Echo(), Environment), Echo().step("hi").reward
    (True, 1.0)
    """

    def reset(self, sample: Mapping[str, Any]) -> Observation | Awaitable[Observation]: ...

    def step(
        self, action: str
    ) -> (
        tuple[Observation, float, bool, Mapping[str, Any]]
        | Awaitable[tuple[Observation, float, bool, Mapping[str, Any]]]
    ): ...


@runtime_checkable
class TurnSampler(Protocol):
    """An inference engine that samples one agent turn from token ids (e.g. :class:`rlcore.train.VLLMEngine`).

    :func:`rlcore.agent.multi_turn_rollout` takes one in place of a ``transformers`` model:
    each turn it hands the engine every unfinished trajectory's ids (prompt, policy and
    observation tokens as they were produced) and appends what comes back, so the
    engine continues from token ids and nothing is re-tokenised. ``sample_turn`` has the
    contract of :func:`rlcore.agent.sample_turn` (``on_stop(row, tokens)`` as each row
    stops, a :class:`rlcore.seeding.RowStream` keying each row, ``positions`` the response
    position of each row's first token); ``config`` gives the vocabulary and positions.
    """

    config: Any

    def sample_turn(
        self,
        contexts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        *,
        stop_token_ids: Sequence[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
        positions: Sequence[int] | None = None,
        on_stop: Callable[[int, list[int]], None] | None = None,
    ) -> Turn: ...
