"""Loop references for evaluation metrics."""

from __future__ import annotations

import math

import torch

__all__ = ["pass_at_k_ref"]


def pass_at_k_ref(
    scores: torch.Tensor, group_ids: torch.Tensor, *, k: int, threshold: float = 0.0, num_groups: int | None = None
) -> torch.Tensor:
    """``1 - C(n - c, min(k, n)) / C(n, min(k, n))`` per group, with exact binomials (0 for an empty group)."""
    g = scores.shape[0] if num_groups is None else num_groups
    out = []
    for group in range(g):
        members = [float(s) for s, i in zip(scores.tolist(), group_ids.tolist()) if i == group]
        n, c = len(members), sum(s > threshold for s in members)
        if n == 0:
            out.append(0.0)
            continue
        kk = min(k, n)
        out.append(1.0 - math.comb(n - c, kk) / math.comb(n, kk))
    return torch.tensor(out, dtype=torch.float32)
