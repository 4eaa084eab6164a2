"""Loop reference for :mod:`rlcore.algos.supervised`, one token at a time in float64."""

from __future__ import annotations

import torch

__all__ = ["sft_loss_ref"]


def sft_loss_ref(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``-m_t * logp_t`` per token (0 off the mask) and the token-mean NLL over the mask's weights."""
    lps, ms = logp.double().tolist(), mask.double().tolist()
    out, total, weight = [], 0.0, 0.0
    for lr, mr in zip(lps, ms):
        row = []
        for lp, m in zip(lr, mr):
            value = -lp * m if m != 0 else 0.0
            row.append(value)
            total += value
            weight += m
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(logp.shape), total / weight if weight else 0.0
