"""Weighted composition of rewards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlcore._checks import finite_weight
from rlcore.rewards.protocol import RewardError, evaluate, reward_name

__all__ = ["Weighted"]


class Weighted:
    """``sum_k w_k * reward_k(prompts, responses, **columns)``: one reward from several.

    Each component is called through :func:`rlcore.rewards.evaluate`, so
    ``BaseReward``-style objects mix with plain callables and a failing component is
    named in the error. :meth:`components` gives the unweighted scores by name, and
    :meth:`scores_and_parts` the total with them from one call (a
    :class:`rlcore.rewards.RewardPool` counts them: the per-reward breakdown a run logs).

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
            if not finite_weight(weight):
                raise ValueError(
                    f"rewards[{i}]: got weight {weight!r}, expected a finite number (in float32, the scores' dtype)"
                )
        self.rewards = list(rewards)

    def names(self) -> list[str]:
        """The components' names, the keys of :meth:`components` (``name#i`` where a name repeats)."""
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
            for key, (_, reward) in zip(self.names(), self.rewards)
        }

    def scores_and_parts(
        self, prompts: Sequence[str], responses: Sequence[str], *, batch: Any = None, **columns: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The weighted total ``[B]`` and each component's unweighted scores (:meth:`components`) of one call."""
        parts = self.components(prompts, responses, batch=batch, **columns)
        total = torch.zeros(len(responses), dtype=torch.float32)
        for (weight, _), scores in zip(self.rewards, parts.values()):
            total += weight * scores
        if not torch.isfinite(total).all():
            index = int(torch.nonzero(~torch.isfinite(total))[0])
            raise RewardError(
                f"reward {self.name!r} on batch {batch!r}: the weighted sum of {self.names()} is {total[index]} "
                f"at index {index} (weights {[w for w, _ in self.rewards]}), expected a finite float32 score"
            )
        return total, parts

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], *, batch: Any = None, **columns: Any
    ) -> torch.Tensor:
        return self.scores_and_parts(prompts, responses, batch=batch, **columns)[0]
