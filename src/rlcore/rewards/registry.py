"""Rewards from a config: built-in rewards by name, user rewards by reference, each with a weight and keyword arguments.

A config lists its rewards::

    rewards:
      - math                                  # a built-in, weight 1
      - {reward: format, weight: 0.1}
      - {reward: my_rewards.py:QualityReward, weight: 0.5, kwargs: {min_length: 100}}
      - {reward: my_package.rewards:score, name: score}

or, in short, ``{math: 1.0, format: 0.1}``. A reference is ``"file.py:Name"`` (relative
to ``base_dir``, e.g. the config's folder) or ``"package.module:Name"``; a class is
built with ``kwargs``, a function is used as it is (``kwargs`` bound with
``functools.partial``). A seed-style ``BaseReward`` subclass in the user's own file works
unchanged, booleans included.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlcore._checks import finite_weight
from rlcore.references import load_reference
from rlcore.rewards.compose import Weighted
from rlcore.rewards.llm_judge import LLMJudge
from rlcore.rewards.protocol import RewardError
from rlcore.rewards.reward_model import RewardModel
from rlcore.rewards.rules import AnswerMatch, FormatMatch, LengthReward
from rlcore.rewards.verified_math import VerifiedMath

__all__ = [
    "REWARDS",
    "ConfiguredReward",
    "build_reward",
    "close_reward",
    "register_reward",
    "reward_log_values",
    "reward_metrics",
    "reward_weights",
]

# DeepSeek-R1's format (arXiv:2501.12948): reasoning in <think>, the answer in <answer>.
R1_FORMAT = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


def _format(*, pattern: str = R1_FORMAT, search: bool = False) -> FormatMatch:
    return FormatMatch(pattern, search=search)


REWARDS: dict[str, Callable[..., Any]] = {
    "math": VerifiedMath,
    "answer_match": AnswerMatch,
    "format": _format,
    "length": LengthReward,
    "reward_model": RewardModel,
    "llm_judge": LLMJudge,
}
_KEYS = ("reward", "weight", "kwargs", "name")


def register_reward(name: str, factory: Callable[..., Any]) -> None:
    """Make ``factory(**kwargs)`` the built-in reward ``name`` (a config then writes ``reward: name``).

    >>> register_reward("always_one", lambda: (lambda prompts, responses, **_: [1.0] * len(responses)))
    >>> build_reward(["always_one"])(["q"], ["r"])
    tensor([1.])
    >>> del REWARDS["always_one"]
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"name: got {name!r}, expected a non-empty name without ':'")
    if not callable(factory):
        raise ValueError(f"factory: got {type(factory).__name__}, expected a callable returning a reward")
    REWARDS[name] = factory


def _has_forward(obj: Any) -> bool:
    return callable(getattr(obj, "forward", None))


def _scores(obj: Any) -> bool:
    """Whether ``obj`` can score: it is callable or has a callable ``forward``."""
    return callable(obj) or _has_forward(obj)


def _load(ref: str, *, what: str, base_dir: str | None) -> Any:
    """:func:`rlcore.references.load_reference`, with a ``sys.exit`` in the user's module as a named error."""
    try:
        return load_reference(ref, what=what, base_dir=base_dir)
    except SystemExit as err:
        source = ref.rpartition(":")[0]
        path = source if not source.endswith(".py") or base_dir is None else os.path.join(base_dir, source)
        raise ValueError(
            f"{what}: got {ref!r}, but importing {path!r} raised SystemExit: {err.code} "
            "(a reward module must not exit when imported)"
        ) from err


def _rebuild(entry: dict[str, Any], base_dir: str | None, what: str) -> ConfiguredReward:
    return ConfiguredReward(entry, base_dir=base_dir, what=what)


class ConfiguredReward:
    """One reward built from a config entry ``{reward, weight, kwargs, name}``; pickles as its entry.

    A worker process that unpickles it builds the reward again from the entry (importing
    the user's file there), so rewards defined in files outside any package work in a
    :class:`rlcore.rewards.RewardPool`.

    Args:
      entry: the normalised config entry.
      base_dir: the folder relative file references start from.
      what: the entry's place in the config, named in errors (``"rewards[1]"``).
    """

    def __init__(self, entry: Mapping[str, Any], *, base_dir: str | os.PathLike | None = None, what: str = "rewards"):
        self.entry = dict(entry)
        self.base_dir = None if base_dir is None else os.fspath(base_dir)
        self.what = what
        ref, kwargs = self.entry["reward"], dict(self.entry.get("kwargs") or {})
        if ":" in ref:
            target = _load(ref, what=f"{what}.reward", base_dir=self.base_dir)
        elif ref in REWARDS:
            target = REWARDS[ref]
        else:
            raise ValueError(
                f"{what}.reward: got {ref!r}, expected a built-in reward {sorted(REWARDS)} "
                "or a reference 'file.py:Name' / 'package.module:Name'"
            )
        self.reward = self._instantiate(target, ref, kwargs)
        default = ref if ":" not in ref else ref.rsplit(":", 1)[1].rsplit(".", 1)[-1]
        self.name = str(self.entry.get("name") or default)
        self.weight = float(self.entry.get("weight", 1.0))

    def _instantiate(self, target: Any, ref: str, kwargs: dict[str, Any]) -> Any:
        if inspect.isclass(target) or (ref in REWARDS and ":" not in ref):
            try:
                built = target(**kwargs)
            except (Exception, SystemExit) as err:  # a constructor's exit() is a bad reward, not the run's status
                raise ValueError(
                    f"{self.what}: building {ref!r} with kwargs {kwargs} raised {type(err).__name__}: {err}"
                ) from err
            if not _scores(built):
                raise ValueError(
                    f"{self.what}.reward: {ref!r} built a {type(built).__name__} with neither __call__ nor forward, "
                    "expected a reward: scores = reward(prompts, responses, **columns)"
                )
            method = "forward" if _has_forward(built) else "__call__"
            self._check_signature(
                getattr(built, method), ref, {}, f"built a {type(built).__name__} whose {method} is async"
            )
            return built
        if not _scores(target):
            raise ValueError(
                f"{self.what}.reward: {ref!r} is a {type(target).__name__}, expected a class or a callable"
            )
        self._check_signature(target, ref, kwargs, "is an async function")
        return functools.partial(target, **kwargs) if kwargs else target

    def _check_signature(self, fn: Any, ref: str, kwargs: dict[str, Any], is_async: str) -> None:
        """Refuse, when built, what would fail at the first step: an async reward, or one that cannot take the call."""
        if inspect.iscoroutinefunction(fn) or (
            not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)
        ):
            raise ValueError(
                f"{self.what}.reward: {ref!r} {is_async}, expected a plain function (def): "
                "rewards are called synchronously, in a worker process or thread"
            )
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check
            return
        try:
            signature.bind_partial([], [])
        except TypeError:
            raise ValueError(
                f"{self.what}.reward: {ref!r} cannot be called as reward(prompts, responses, **columns): "
                f"its signature is {signature}"
            ) from None
        try:
            signature.bind_partial([], [], **kwargs)
        except TypeError:
            raise ValueError(
                f"{self.what}.kwargs: {ref!r} does not take {kwargs}: its signature is {signature}"
            ) from None

    def forward(self, prompts: Sequence[Any], responses: Sequence[str], **columns: Any) -> Any:
        """The wrapped reward's scores (through its ``forward`` when it has one)."""
        fn = self.reward.forward if _has_forward(self.reward) else self.reward
        return fn(prompts, responses, **columns)

    def __call__(self, prompts: Sequence[Any], responses: Sequence[str], **columns: Any) -> Any:
        return self.forward(prompts, responses, **columns)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.entry, self.base_dir, self.what))


def _entries(spec: Any, what: str) -> list[dict[str, Any]]:
    if isinstance(spec, Mapping):
        spec = [{"reward": name, "weight": weight} for name, weight in spec.items()]
    if isinstance(spec, str) or not isinstance(spec, Sequence) or not spec:
        raise ValueError(f"{what}: got {spec!r}, expected a non-empty list of rewards or a {{name: weight}} mapping")
    out = []
    for i, item in enumerate(spec):
        where = f"{what}[{i}]"
        entry = {"reward": item} if isinstance(item, str) else item
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: got {item!r}, expected a name, a reference or a mapping with 'reward'")
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown or "reward" not in entry:
            raise ValueError(f"{where}: got keys {sorted(entry)}, expected 'reward' and any of {list(_KEYS[1:])}")
        if not isinstance(entry["reward"], str):
            raise ValueError(f"{where}.reward: got {entry['reward']!r}, expected a name or a reference string")
        weight = entry.get("weight", 1.0)
        if not finite_weight(weight):
            shown = repr(weight) if len(repr(weight)) <= 40 else f"{repr(weight)[:20]}... ({len(repr(weight))} digits)"
            raise ValueError(f"{where}.weight: got {shown}, expected a finite number (at most 3.4e38, float32's range)")
        name = entry.get("name")
        if name is not None and (
            isinstance(name, bool) or not isinstance(name, (str, int)) or (isinstance(name, str) and not name.strip())
        ):
            raise ValueError(f"{where}.name: got {name!r}, expected a non-empty string (the reward's name in the logs)")
        if not isinstance(entry.get("kwargs") or {}, Mapping):
            raise ValueError(f"{where}.kwargs: got {entry['kwargs']!r}, expected a mapping of keyword arguments")
        out.append(dict(entry))
    return out


def build_reward(spec: Any, *, base_dir: str | os.PathLike | None = None, what: str = "rewards") -> Weighted:
    """One reward from a config's list: ``sum_k weight_k * reward_k``, each component named for the metrics.

    Args:
      spec: a list of entries (a name or reference string, or a mapping with ``reward``
        and optional ``weight``, ``kwargs``, ``name``), or a ``{name: weight}`` mapping.
      base_dir: the folder relative ``file.py`` references start from (the config's).
      what: the config key, named in errors.

    Returns:
      A :class:`rlcore.rewards.Weighted` of :class:`ConfiguredReward`; its
      ``components`` gives the unweighted scores by name.

    Raises:
      ValueError: one line naming the entry (``rewards[1].reward``) and the problem: an
        unknown name, a reference that does not import (with the import error), bad
        keyword arguments.

    >>> reward = build_reward([{"reward": "length", "weight": 0.5, "kwargs": {"max_length": 3}}])
    >>> reward(["q", "q"], ["abc", "abcd"])
    tensor([0.5000, 0.0000])
    """
    entries = _entries(spec, what)
    rewards = [ConfiguredReward(entry, base_dir=base_dir, what=f"{what}[{i}]") for i, entry in enumerate(entries)]
    return Weighted([(r.weight, r) for r in rewards])


def reward_weights(spec: Any, *, what: str = "rewards") -> list[float]:
    """The weight of each entry of a config's rewards list (1 where unset), in order, without building a reward.

    >>> reward_weights([{"reward": "length", "weight": 0.5}, "format"])
    [0.5, 1.0]
    """
    return [float(entry.get("weight", 1.0)) for entry in _entries(spec, what)]


def _components(reward: Any) -> list[tuple[str, Any]]:
    if isinstance(reward, Weighted):
        return [pair for _, r in reward.rewards for pair in _components(r)]
    if isinstance(reward, ConfiguredReward):
        return [(reward.name, reward.reward)]
    return [(getattr(reward, "name", type(reward).__name__), reward)]


def reward_metrics(reward: Any) -> dict[str, float]:
    """The counters of every component that keeps some (``pop_metrics``), as ``{"name/counter": value}``; resets them.

    >>> reward_metrics(build_reward(["length"]))
    {}
    """
    out: dict[str, float] = {}
    for name, component in _components(reward):
        pop = getattr(component, "pop_metrics", None)
        if callable(pop):
            out.update({f"{name}/{key}": value for key, value in _counters(name, pop).items()})
    return out


def _counters(name: str, pop: Callable[[], Any]) -> dict[str, float]:
    """``pop()`` as counters, or a :class:`RewardError` naming the reward: a user class's own ``pop_metrics`` may be anything."""
    expected = "expected pop_metrics() -> a mapping of counter names to numbers"
    try:
        counts = pop()
    except Exception as err:
        raise RewardError(f"reward {name!r}: pop_metrics() raised {type(err).__name__}: {err}; {expected}") from err
    if not isinstance(counts, Mapping):
        raise RewardError(f"reward {name!r}: pop_metrics() returned {type(counts).__name__}; {expected}")
    out = {}
    for key, value in counts.items():
        if not isinstance(value, numbers.Real):
            raise RewardError(f"reward {name!r}: pop_metrics() counter {key!r} is {value!r}; {expected}")
        out[str(key)] = float(value)
    return out


def reward_log_values(counts: Mapping[str, float]) -> dict[str, float]:
    """What a run logs from reward counters (summed over batches and ranks): each component's mean raw score.

    A :class:`rlcore.rewards.RewardPool` scoring a :class:`rlcore.rewards.Weighted` (what
    :func:`build_reward` returns) counts each component's raw scores of every call,
    ``name/score_sum`` and ``name/scored``: sums, so that batches and data-parallel ranks
    add up before the division here.

    ``name/score_sum`` and ``name/scored`` become ``name``, their ratio (left out when
    nothing was scored); every other counter (``math/timeouts``, ...) passes unchanged.

    >>> reward_log_values({"length/score_sum": 3.0, "length/scored": 4.0, "math/timeouts": 1.0})
    {'length': 0.75, 'math/timeouts': 1.0}
    """
    out: dict[str, float] = {}
    for key, value in counts.items():
        name, _, counter = key.rpartition("/")
        if counter == "score_sum" and f"{name}/scored" in counts:
            if counts[f"{name}/scored"] > 0:
                out[name] = float(value) / float(counts[f"{name}/scored"])
        elif not (counter == "scored" and f"{name}/score_sum" in counts):
            out[key] = float(value)
    return out


def close_reward(reward: Any) -> None:
    """Stop what the components hold (worker processes): call ``close()`` on each that has one."""
    for _, component in _components(reward):
        close = getattr(component, "close", None)
        if callable(close):
            close()
