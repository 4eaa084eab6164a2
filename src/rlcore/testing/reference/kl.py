"""Loop references for :mod:`rlcore.algos.kl`: element-by-element estimators and step-by-step controllers."""

from __future__ import annotations

import math

import torch

__all__ = ["adaptive_entropy_coefs_ref", "adaptive_kl_coefs_ref", "kl_in_reward_ref", "kl_penalty_ref"]


def _one(lp: float, rp: float, estimator: str) -> float:
    d = lp - rp
    if estimator == "k1":
        return d
    if estimator == "abs":
        return abs(d)
    if estimator == "k2":
        return 0.5 * d * d
    r = min(max(rp - lp, -20.0), 20.0)
    return min(max(math.exp(r) - r - 1.0, -10.0), 10.0)


def kl_penalty_ref(logp: torch.Tensor, ref_logp: torch.Tensor, *, estimator: str = "k1") -> torch.Tensor:
    """Schulman's estimators one element at a time, in float64 (k3 with verl's clamps)."""
    lps, rps = logp.double().flatten().tolist(), ref_logp.double().flatten().tolist()
    out = [_one(a, b, estimator) if math.isfinite(a) and math.isfinite(b) else math.nan for a, b in zip(lps, rps)]
    return torch.tensor(out, dtype=torch.float64).reshape(logp.shape)


def kl_in_reward_ref(
    rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loop reference of :func:`rlcore.algos.kl_in_reward`, written for clarity."""
    kl = kl_penalty_ref(logp, ref_logp, estimator=estimator).tolist()
    r, m = rewards.double().tolist(), mask.bool().tolist()
    shaped, seq_kls, tokens = [], [], []
    for r_row, k_row, m_row in zip(r, kl, m):
        shaped.append([rv - kl_coef * kv if mv else 0.0 for rv, kv, mv in zip(r_row, k_row, m_row)])
        counted = [kv for kv, mv in zip(k_row, m_row) if mv]
        tokens.extend(counted)
        if counted:
            seq_kls.append(math.fsum(counted))
    metrics = {
        "kl": math.fsum(seq_kls) / len(seq_kls) if seq_kls else 0.0,
        "kl_per_token": math.fsum(tokens) / len(tokens) if tokens else 0.0,
    }
    return torch.tensor(shaped, dtype=torch.float64).reshape(rewards.shape), metrics


def adaptive_kl_coefs_ref(
    kls: list[float], n_steps: list[int], *, init_kl_coef: float = 0.2, target: float = 6.0, horizon: float = 10000.0
) -> list[float]:
    """The coefficient after each update of Ziegler et al.'s controller, as verl/TRL's loop."""
    value, out = init_kl_coef, []
    for kl, n in zip(kls, n_steps):
        error = min(max(kl / target - 1.0, -0.2), 0.2)
        value *= 1.0 + error * n / horizon
        out.append(value)
    return out


def adaptive_entropy_coefs_ref(
    entropies: list[float],
    *,
    target: float = 0.2,
    delta: float = 1e-4,
    init_coef: float = 0.0,
    max_coef: float | None = 0.005,
) -> list[tuple[float, float]]:
    """``(alpha, coef)`` after each update of the adaptive entropy controller, skipping non-finite entropies."""
    alpha, coef, out = init_coef, init_coef, []
    for h in entropies:
        if math.isfinite(h):
            alpha = max(alpha + (delta if h < target else -delta), 0.0)
            if max_coef is not None:
                alpha = min(alpha, max_coef)
            coef = alpha if h < target else 0.0
        out.append((alpha, coef))
    return out
