"""The ``rl.multi_turn`` config section and what it builds: tools, the environment factory, stop ids."""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlcore.agent.protocols import Environment
from rlcore.agent.tool_env import ToolEnv
from rlcore.agent.tools import Tool, tool
from rlcore.references import load_reference

__all__ = ["MultiTurnConfig", "build_env_factory", "build_tools", "parse_multi_turn", "stop_token_ids"]


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """``rl.multi_turn``: budgets, tools and environment of the multi-turn rollout.

    Fields:
      max_turns: policy turns per trajectory.
      max_new_tokens: tokens per policy turn.
      max_total_tokens: response tokens per trajectory (policy and observation tokens).
      tools: references (``"file.py:Name"`` or ``"package.module:Name"``) to
        :class:`rlcore.agent.Tool` objects or plain functions.
      env: reference to an environment factory (a class or function returning an
        :class:`rlcore.agent.Environment`; it gets ``tools=`` if it takes that
        argument, and ``env_options``); None: a :class:`rlcore.agent.ToolEnv` of ``tools``
        scored by the task's reward.
      env_options: keyword options of the factory (or of ``ToolEnv``).
      tool_timeout: seconds per tool call.
      step_timeout: seconds per environment call (reset or step).
      max_concurrency: environment calls in flight at once.
      stop_tokens: strings (single tokens of the tokenizer) that end a turn besides ``<eos>``.
      eval_every: the trainer's greedy evaluation: every ``eval_every`` steps (and at the
        last step) a temperature-0 rollout on a fixed set of the task's prompts is
        logged as ``greedy_accuracy``; 0: none.
      eval_size: prompts in that fixed set.
    """

    max_turns: int = 4
    max_new_tokens: int = 64
    max_total_tokens: int = 512
    tools: tuple[str, ...] = ()
    env: str | None = None
    env_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tool_timeout: float = 10.0
    step_timeout: float = 60.0
    max_concurrency: int = 64
    stop_tokens: tuple[str, ...] = ("</tool_call>",)
    eval_every: int = 0
    eval_size: int = 128


def parse_multi_turn(raw: Mapping[str, Any] | None, *, key: str = "rl.multi_turn") -> MultiTurnConfig:
    """Validate the ``rl.multi_turn`` mapping (as loaded from YAML) into a :class:`MultiTurnConfig`.

    Raises ``ValueError`` naming the key for an unknown key, a wrong type or a budget
    below 1.

    >>> parse_multi_turn({"max_turns": 2, "tools": ["rlcore.agent.calc:calculator"]}).max_turns
    2
    >>> parse_multi_turn({"max_turn": 2})
    Traceback (most recent call last):
    ...
    ValueError: config key 'rl.multi_turn.max_turn': unknown, expected one of max_turns, max_new_tokens, max_total_tokens, tools, env, env_options, tool_timeout, step_timeout, max_concurrency, stop_tokens, eval_every, eval_size
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"config key {key!r}: got {type(raw).__name__}, expected a mapping of keys")
    names = [f.name for f in dataclasses.fields(MultiTurnConfig)]
    values: dict[str, Any] = {}
    for name, value in raw.items():
        where = f"config key '{key}.{name}'"
        if name not in names:
            raise ValueError(f"{where}: unknown, expected one of {', '.join(names)}")
        if name in ("max_turns", "max_new_tokens", "max_total_tokens", "max_concurrency", "eval_size"):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: got {value!r}, expected an int >= 1")
        elif name == "eval_every":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{where}: got {value!r}, expected an int >= 0")
        elif name in ("tool_timeout", "step_timeout"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{where}: got {value!r}, expected a number > 0")
            value = float(value)
        elif name in ("tools", "stop_tokens"):
            if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{where}: got {value!r}, expected a list of strings")
            value = tuple(value)
        elif name == "env":
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{where}: got {value!r}, expected a reference 'file.py:Name' or null")
        elif name == "env_options":
            value = {} if value is None else value
            if not isinstance(value, Mapping):
                raise ValueError(f"{where}: got {value!r}, expected a mapping")
            value = dict(value)
        values[name] = value
    cfg = MultiTurnConfig(**values)
    if cfg.env is None:
        _check_tool_env_options(cfg.env_options, key)
    return cfg


def _check_tool_env_options(options: Mapping[str, Any], key: str) -> None:
    """``env_options`` of the default :class:`ToolEnv`: its keyword options, with values it accepts."""
    allowed = [p for p in inspect.signature(ToolEnv).parameters if p not in ("tools", "reward")]
    for name in options:
        if name not in allowed:
            raise ValueError(
                f"config key '{key}.env_options.{name}': unknown option of ToolEnv, expected one of {', '.join(allowed)}"
            )
    try:
        ToolEnv([], **options)
    except ValueError as err:
        raise ValueError(f"config key '{key}.env_options': {err}") from None


def build_tools(cfg: MultiTurnConfig, *, base_dir: str | os.PathLike | None = None) -> list[Tool]:
    """Load ``cfg.tools``; a plain function becomes a tool through :func:`rlcore.agent.tool`.

    >>> [t.name for t in build_tools(MultiTurnConfig(tools=("rlcore.agent.calc:calculator",)))]
    ['calculator']
    """
    tools: list[Tool] = []
    for i, ref in enumerate(cfg.tools):
        where = f"rl.multi_turn.tools[{i}]"
        obj = load_reference(ref, what=where, base_dir=base_dir)
        if isinstance(obj, Tool):
            tools.append(obj)
        elif callable(obj):
            try:
                tools.append(tool(obj))
            except (TypeError, ValueError) as err:  # a builtin without a signature, or a name it cannot take
                raise ValueError(f"{where}: {ref!r} cannot be made a tool ({type(err).__name__}: {err})") from None
        else:
            raise ValueError(f"{where}: {ref!r} is a {type(obj).__name__}, expected a Tool or a function")
        earlier = [t.name for t in tools[:-1]]
        if tools[-1].name in earlier:
            raise ValueError(
                f"{where}: {ref!r} is a tool named {tools[-1].name!r}, as is rl.multi_turn.tools[{earlier.index(tools[-1].name)}]; "
                "expected distinct tool names (the policy calls a tool by its name)"
            )
    return tools


def build_env_factory(
    cfg: MultiTurnConfig,
    *,
    reward: Callable[[Mapping[str, Any], str], float] | None = None,
    base_dir: str | os.PathLike | None = None,
) -> Callable[[], Environment]:
    """A function making one fresh environment per trajectory, from ``cfg.env`` / ``cfg.tools``.

    Args:
      cfg: the section.
      reward: ``(sample, final_text) -> float`` for the default :class:`ToolEnv`.
      base_dir: folder of relative ``file.py`` references (the config file's).

    >>> make_env = build_env_factory(MultiTurnConfig(tools=("rlcore.agent.calc:calculator",)))
    >>> sorted(make_env().tools)
    ['calculator']
    """
    tools = build_tools(cfg, base_dir=base_dir)
    options = dict(cfg.env_options)
    if cfg.env is None:
        options.setdefault("timeout", cfg.tool_timeout)
        return lambda: ToolEnv(tools, reward=reward, **options)
    factory = load_reference(cfg.env, what="rl.multi_turn.env", base_dir=base_dir)
    if not callable(factory):
        raise ValueError(f"rl.multi_turn.env: {cfg.env!r} is a {type(factory).__name__}, expected a class or function")
    try:
        takes_tools = "tools" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_tools = False
    _check_factory_options(factory, options, cfg.env)
    if takes_tools:
        options["tools"] = tools
    return lambda: factory(**options)


def _check_factory_options(factory: Callable[..., Any], options: Mapping[str, Any], ref: str) -> None:
    """Every ``env_options`` key is a keyword parameter of the factory (unless it takes ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "tools"]
    for name in options:
        if name not in names:
            raise ValueError(
                f"config key 'rl.multi_turn.env_options.{name}': not a parameter of {ref!r}, "
                f"expected one of {', '.join(names) or '(none)'}"
            )


def stop_token_ids(cfg: MultiTurnConfig, tokenizer: Any) -> list[int]:
    """The ids of ``cfg.stop_tokens``; each must be one token of ``tokenizer``, else ValueError naming it.

    >>> from rlcore.agent.calc import Multiplication
    >>> tok = Multiplication().tokenizer
    >>> stop_token_ids(MultiTurnConfig(), tok) == [tok.token_id("</tool_call>")]
    True
    """
    ids = []
    for i, text in enumerate(cfg.stop_tokens):
        where = f"config key 'rl.multi_turn.stop_tokens[{i}]'"
        if callable(getattr(tokenizer, "convert_tokens_to_ids", None)) and hasattr(tokenizer, "get_vocab"):
            if text not in tokenizer.get_vocab():
                raise ValueError(f"{where}: got {text!r}, which is not a token of the tokenizer, expected one token")
            ids.append(int(tokenizer.convert_tokens_to_ids(text)))
            continue
        try:
            encoded = list(tokenizer.encode(text))
        except ValueError as err:
            raise ValueError(f"{where}: got {text!r}, which the tokenizer cannot encode ({err})") from None
        if len(encoded) != 1:
            raise ValueError(
                f"{where}: got {text!r}, which the tokenizer encodes as {len(encoded)} tokens, expected one"
            )
        ids.append(int(encoded[0]))
    return ids
