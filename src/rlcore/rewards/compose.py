"""Weighted composition of rewards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlcore.rewards.protocol import evaluate, reward_name

__all__ = ["Weighted"]


class Weighted:
    """``sum_k w_k * reward_k(prompts, responses, **columns)``: one reward from several.

    Each component is called through :func:`rlcore.rewards.evaluate`, so
    ``BaseReward``-style objects mix with plain callables and a failing component is
    named in the error. :meth:`components` gives the unweighted scores by name, for logging.

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
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], (int, float))):
                raise ValueError(f"rewards[{i}]: got {pair!r}, expected a (weight, reward) pair")
        self.rewards = list(rewards)

    def components(
        self, prompts: Sequence[str], responses: Sequence[str], *, batch: Any = None, **columns: Any
    ) -> dict[str, torch.Tensor]:
        """The unweighted scores ``[B]`` of each component, keyed by name (``name#i`` if a name repeats)."""
        out: dict[str, torch.Tensor] = {}
        for i, (_, reward) in enumerate(self.rewards):
            key = reward_name(reward)
            out[key if key not in out else f"{key}#{i}"] = evaluate(reward, prompts, responses, batch=batch, **columns)
        return out

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], *, batch: Any = None, **columns: Any
    ) -> torch.Tensor:
        total = torch.zeros(len(responses), dtype=torch.float32)
        for weight, reward in self.rewards:
            total += weight * evaluate(reward, prompts, responses, batch=batch, **columns)
        return total
