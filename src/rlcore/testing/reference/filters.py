"""Loop references for :mod:`rlcore.algos.filters`: group-by-group dynamic sampling, token-by-token ratios."""

from __future__ import annotations

import math

import torch

__all__ = ["dynamic_sampling_mask_ref", "refill_groups_ref", "rejection_mask_ref", "truncated_is_weights_ref"]


def dynamic_sampling_mask_ref(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.dynamic_sampling_mask`, written for clarity."""
    s, ids = scores.double().tolist(), group_ids.tolist()
    distinct: dict[int, set[float]] = {}
    for v, g in zip(s, ids):
        distinct.setdefault(g, set()).add(v)
    return torch.tensor([len(distinct[g]) > 1 for g in ids], dtype=torch.bool)


def refill_groups_ref(scores: torch.Tensor, group_ids: torch.Tensor, *, wanted: int) -> tuple[list[int], int]:
    """Loop reference of :func:`rlcore.algos.refill_groups`: walk the groups in draw order, keep the informative.

    Returns the picked group ids (at most ``wanted``) and the shortfall.
    """
    values: dict[int, list[float]] = {}
    for v, g in zip(scores.double().tolist(), group_ids.tolist()):
        values.setdefault(g, []).append(v)
    picked: list[int] = []
    for g in sorted(values):
        vs = values[g]
        if all(math.isfinite(v) for v in vs) and max(vs) != min(vs) and len(picked) < wanted:
            picked.append(g)
    return picked, wanted - len(picked)


def _rows(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor):  # type: ignore[no-untyped-def]
    for lp, rl, m in zip(logp.double().tolist(), rollout_logp.double().tolist(), mask.bool().tolist()):
        yield [a - b if k else 0.0 for a, b, k in zip(lp, rl, m)], m


def truncated_is_weights_ref(
    logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, level: str = "token", cap: float = 2.0
) -> torch.Tensor:
    """``min(rho, cap)`` per token, or ``min(prod rho, cap)`` per sequence (the product summed in log space)."""
    out = []
    for logs, m in _rows(logp, rollout_logp, mask):
        if level == "token":
            row = [min(math.exp(v), cap) if k else 0.0 for v, k in zip(logs, m)]
        else:
            total = math.fsum(v for v, k in zip(logs, m) if k)
            w = cap if total >= math.log(cap) else math.exp(total)
            row = [w if k else 0.0 for k in m]
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(logp.shape)


def rejection_mask_ref(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    high: float = 2.0,
    low: float | None = None,
    veto: float | None = None,
) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.rejection_mask`, written for clarity."""
    lo = 1.0 / high if low is None else low
    out = []
    for logs, m in _rows(logp, rollout_logp, mask):
        counted = [v for v, k in zip(logs, m) if k]
        if level == "token":
            keep = [k and math.log(lo) <= v <= math.log(high) for v, k in zip(logs, m)]
        else:
            total = math.fsum(counted)
            if level == "geometric" and counted:
                total /= len(counted)
            ok = math.log(lo) <= total <= math.log(high)
            keep = [k and ok for k in m]
        if veto is not None and any(v < math.log(veto) for v in counted):
            keep = [False] * len(m)
        out.append(keep)
    return torch.tensor(out, dtype=torch.bool).reshape(mask.shape)
