"""Weighted composition of rewards."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from rlcore.rewards.protocol import evaluate, reward_name

__all__ = ["Weighted"]


def _finite(weight: float) -> bool:
    try:
        return math.isfinite(weight)
    except OverflowError:  # an int past float's range
        return False


class Weighted:
    """``sum_k w_k * reward_k(prompts, responses, **columns)``: one reward from several.

    Each component is called through :func:`rlcore.rewards.evaluate`, so
    ``BaseReward``-style objects mix with plain callables and a failing component is
    named in the error. :meth:`components` gives the unweighted scores by name, and
    :meth:`pop_metrics` each component's raw scores summed since the last pop (the
    per-reward breakdown a run logs: :func:`rlcore.rewards.reward_log_values`).

    Args:
      rewards: a sequence of ``(weight, reward)`` pairs.

    >>> from rlcore.rewards import FormatMatch, LengthReward
    >>> r = Weighted([(1.0, FormatMatch(r"\\d+")), (0.5, LengthReward(max_length=1))])
    >>> r(["q", "q"], ["7", "77"])
    tensor([1.5000, 1.0000])
    """

    name = "weighted"

    def __init__(self, rewards: Sequence[tuple[float, Any]]):
        if not rewards:
            raise ValueError("rewards: got an empty sequence, expected (weight, reward) pairs")
        for i, pair in enumerate(rewards):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"rewards[{i}]: got {pair!r}, expected a (weight, reward) pair")
            weight = pair[0]
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not _finite(weight):
                raise ValueError(f"rewards[{i}]: got weight {weight!r}, expected a finite number")
        self.rewards = list(rewards)
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._sums = dict.fromkeys(self._keys(), 0.0)
        self._scored = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"rewards": self.rewards}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def _keys(self) -> list[str]:
        keys: list[str] = []
        for i, (_, reward) in enumerate(self.rewards):
            key = reward_name(reward)
            keys.append(key if key not in keys else f"{key}#{i}")
        return keys

    def components(
        self, prompts: Sequence[str], responses: Sequence[str], *, batch: Any = None, **columns: Any
    ) -> dict[str, torch.Tensor]:
        """The unweighted scores ``[B]`` of each component, keyed by name (``name#i`` if a name repeats)."""
        return {
            key: evaluate(reward, prompts, responses, batch=batch, **columns)
            for key, (_, reward) in zip(self._keys(), self.rewards)
        }

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], *, batch: Any = None, **columns: Any
    ) -> torch.Tensor:
        parts = self.components(prompts, responses, batch=batch, **columns)
        total = torch.zeros(len(responses), dtype=torch.float32)
        for (weight, _), scores in zip(self.rewards, parts.values()):
            total += weight * scores
        with self._lock:  # counted only once every component has scored
            for key, scores in parts.items():
                self._sums[key] += float(scores.double().sum())
            self._scored += len(responses)
        return total

    def pop_metrics(self) -> dict[str, float]:
        """Each component's raw scores summed since the last call, ``{name}/score_sum``, and ``{name}/scored``; resets.

        Sums (not means), so that batches and data-parallel ranks add up before
        :func:`rlcore.rewards.reward_log_values` divides.
        """
        with self._lock:
            sums, scored = self._sums, self._scored
            self._sums, self._scored = dict.fromkeys(sums, 0.0), 0
        return {
            **{f"{key}/score_sum": value for key, value in sums.items()},
            **{f"{key}/scored": float(scored) for key in sums},
        }
