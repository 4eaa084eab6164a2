"""Loop references for :mod:`rlcore.algos.shaping`: the piecewise overlong penalty and an exact running normaliser."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

__all__ = ["RunningNormalizerRef", "clip_rewards_ref", "overlong_penalty_ref", "scores_to_token_rewards_ref"]


def overlong_penalty_ref(
    lengths: torch.Tensor, *, max_length: int = 20480, cache_length: int = 4096, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO eq. 13, case by case."""
    expected = max_length - cache_length
    out = []
    for n in lengths.double().tolist():
        if n <= expected:
            r = 0.0
        elif n <= max_length:
            r = (expected - n) / cache_length
        else:
            r = -1.0
        out.append(r * penalty_factor)
    return torch.tensor(out, dtype=torch.float64)


def clip_rewards_ref(rewards: torch.Tensor, *, low: float = -10.0, high: float = 10.0) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.clip_rewards`, written for clarity."""
    vals = [min(max(v, low), high) for v in rewards.double().flatten().tolist()]
    return torch.tensor(vals, dtype=torch.float64).reshape(rewards.shape)


def scores_to_token_rewards_ref(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.scores_to_token_rewards`, written for clarity."""
    out = []
    for s, row in zip(scores.double().tolist(), mask.bool().tolist()):
        rew = [0.0] * len(row)
        counted = [t for t, m in enumerate(row) if m]
        if counted:
            rew[counted[-1]] = s
        out.append(rew)
    return torch.tensor(out, dtype=torch.float64).reshape(mask.shape)


class RunningNormalizerRef:
    """Keeps every reward ever seen and normalises each batch by the exact statistics of all of them."""

    def __init__(self, *, shift_mean: bool = True, eps: float = 1e-8) -> None:
        self.seen: list[Fraction] = []
        self.shift_mean = shift_mean
        self.eps = eps

    def update(self, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        vals = rewards.double().flatten().tolist()
        keep = mask.bool().flatten().tolist()
        self.seen.extend(Fraction(v) for v, k in zip(vals, keep) if k)
        n = len(self.seen)
        mean = sum(self.seen, Fraction(0)) / n if n else Fraction(0)
        var = sum(((v - mean) ** 2 for v in self.seen), Fraction(0)) / (n - 1) if n > 1 else Fraction(0)
        inv = 1.0 / math.sqrt(float(var) + self.eps) if float(var) + self.eps > 0 else 0.0
        out = []
        for v, k in zip(vals, keep):
            if not k:
                out.append(0.0)
            elif self.shift_mean:
                out.append(float(Fraction(v) - mean) * inv)
            else:
                out.append(v * inv)
        return torch.tensor(out, dtype=torch.float64).reshape(rewards.shape)
