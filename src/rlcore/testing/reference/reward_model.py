"""Loop references for :mod:`rlcore.algos.reward_model`, one pair or step at a time in float64."""

from __future__ import annotations

import math

import torch

__all__ = ["bradley_terry_loss_ref", "process_reward_loss_ref"]


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def bradley_terry_loss_ref(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: torch.Tensor | float | None = None,
    center_coef: float = 0.0,
) -> torch.Tensor:
    """``-log sigmoid(r_w - r_l - margin) + center_coef (r_w + r_l)^2`` per pair."""
    ws, ls = chosen_rewards.double().tolist(), rejected_rewards.double().tolist()
    if isinstance(margin, torch.Tensor):
        margins = margin.double().tolist()
    else:
        margins = [float(margin or 0.0)] * len(ws)
    return torch.tensor(
        [-_log_sigmoid(w - r - m) + center_coef * (w + r) ** 2 for w, r, m in zip(ws, ls, margins)],
        dtype=torch.float64,
    )


def process_reward_loss_ref(step_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of each counted step: ``-(y log s(z) + (1 - y) log s(-z))``."""
    zs, ys, ms = step_logits.double().tolist(), labels.double().tolist(), mask.double().tolist()
    out = [
        [-(y * _log_sigmoid(z) + (1.0 - y) * _log_sigmoid(-z)) if m != 0 else 0.0 for z, y, m in zip(zr, yr, mr)]
        for zr, yr, mr in zip(zs, ys, ms)
    ]
    return torch.tensor(out, dtype=torch.float64).reshape(mask.shape)
