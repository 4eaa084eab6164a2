"""Loop references for :mod:`rlcore.algos.off_policy`: the behaviour weights and the interpolated proximal log-probs."""

from __future__ import annotations

import math

import torch

__all__ = ["behaviour_weights_ref", "interpolated_prox_logp_ref", "staleness_weights_ref"]


def behaviour_weights_ref(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, *, cap: float = 2.0, mode: str = "truncate"
) -> torch.Tensor:
    """``w = pi_prox / pi_behav`` token by token: ``min(w, cap)`` (truncate) or ``w if w <= cap else 0`` (mask)."""
    out = []
    for ps, bs, ms in zip(prox_logp.double().tolist(), behav_logp.double().tolist(), (mask != 0).tolist()):
        row = []
        for p, b, on in zip(ps, bs, ms):
            if not on:
                row.append(0.0)
                continue
            w = math.exp(p - b)
            row.append(min(w, cap) if mode == "truncate" else (w if w <= cap else 0.0))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(prox_logp.shape)


def interpolated_prox_logp_ref(
    behav_logp: torch.Tensor, logp: torch.Tensor, *, behav_version: torch.Tensor, prox_version: int, version: int
) -> torch.Tensor:
    """``behav + alpha (logp - behav)`` with ``alpha = (v_prox - v_behav) / (v - v_behav)`` in [0, 1], token by token."""
    per_row = behav_version.dim() == 1
    out = []
    for i, (bs, ls) in enumerate(zip(behav_logp.double().tolist(), logp.double().tolist())):
        row = []
        for t, (b, lp) in enumerate(zip(bs, ls)):
            vb = int(behav_version[i]) if per_row else int(behav_version[i, t])
            alpha = 0.0 if version == vb else min(max((prox_version - vb) / (version - vb), 0.0), 1.0)
            row.append(b + alpha * (lp - b))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(logp.shape)


def staleness_weights_ref(lag: torch.Tensor, *, max_lag: int, mode: str = "drop", decay: float = 0.5) -> torch.Tensor:
    """Row by row: 1 when ``lag <= max_lag``, else 0 (drop) or ``decay ** (lag - max_lag)`` (weight)."""
    out = []
    for value in lag.double().tolist():
        if value <= max_lag:
            out.append(1.0)
        else:
            out.append(0.0 if mode == "drop" else decay ** (value - max_lag))
    return torch.tensor(out, dtype=torch.float64)
