"""Loop references for evaluation metrics and for combining a step's tagged metrics."""

from __future__ import annotations

import math

import torch

__all__ = ["merge_metrics_ref", "pass_at_k_ref"]


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


def merge_metrics_ref(produced: list[list[dict[str, tuple[float, str]]]]) -> dict[str, float]:
    """A step's metrics from every rank's updates, each value ``(value, reduction)``: float64 loops over all of them.

    ``"sum"`` adds every value, ``"max"`` takes the largest, ``"mean"`` averages every value
    produced (each update on each rank counts once).
    """
    seen: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for rank in produced:
        for update in rank:
            for name, (value, kind) in update.items():
                seen.setdefault(name, []).append(float(value))
                kinds[name] = kind
    out = {}
    for name, vals in seen.items():
        if kinds[name] == "sum":
            out[name] = math.fsum(vals)
        elif kinds[name] == "max":
            out[name] = max(vals)
        else:
            out[name] = math.fsum(vals) / len(vals)
    return out
