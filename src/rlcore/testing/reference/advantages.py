"""Loop references for :mod:`rlcore.algos.advantages`, one sample and one time step at a time.

Group statistics are exact (:class:`fractions.Fraction`), recurrences run backwards over
Python floats in float64, and the pass@k reference enumerates every k-subset instead
of using the closed form. Results are float64 tensors.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import torch

__all__ = [
    "batch_normalize_ref",
    "gae_ref",
    "gdpo_advantages_ref",
    "gpg_advantages_ref",
    "grpo_advantages_ref",
    "opo_advantages_ref",
    "optimal_token_baseline_advantages_ref",
    "passk_advantages_ref",
    "reinforce_pp_advantages_ref",
    "reinforce_pp_baseline_advantages_ref",
    "remax_advantages_ref",
    "rloo_advantages_ref",
]


def _members(group_ids: torch.Tensor) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        out.setdefault(g, []).append(i)
    return out


def _mean(xs: list[float]) -> Fraction:
    return sum((Fraction(x) for x in xs), Fraction(0)) / len(xs)


def _std(xs: list[float], *, unbiased: bool = True) -> float:
    den = len(xs) - 1 if unbiased else len(xs)
    if den <= 0:
        return 0.0
    mu = _mean(xs)
    return math.sqrt(float(sum(((Fraction(x) - mu) ** 2 for x in xs), Fraction(0)) / den))


def gae_ref(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-time-step GAE, skipping mask-0 tokens (they carry the next value and advantage)."""
    r_rows, v_rows, m_rows = rewards.double().tolist(), values.double().tolist(), mask.bool().tolist()
    adv_out, ret_out = [], []
    for r, v, m in zip(r_rows, v_rows, m_rows):
        next_value, running = 0.0, 0.0
        adv = [0.0] * len(r)
        ret = [0.0] * len(r)
        for t in range(len(r) - 1, -1, -1):
            if not m[t]:
                continue
            delta = r[t] + gamma * next_value - v[t]
            running = delta + gamma * lam * running
            next_value = v[t]
            adv[t] = running
            ret[t] = running + v[t]
        adv_out.append(adv)
        ret_out.append(ret)
    shape = rewards.shape
    return torch.tensor(adv_out, dtype=torch.float64).reshape(shape), torch.tensor(
        ret_out, dtype=torch.float64
    ).reshape(shape)


def batch_normalize_ref(
    x: torch.Tensor, mask: torch.Tensor | None = None, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whitening over every element with nonzero mask (exact mean and unbiased variance)."""
    xs = x.double().flatten().tolist()
    ws = [1.0] * len(xs) if mask is None else mask.double().flatten().tolist()
    count = sum((Fraction(w) for w in ws if w != 0), Fraction(0))
    total = sum((Fraction(v) * Fraction(w) for v, w in zip(xs, ws) if w != 0), Fraction(0))
    mean = total / count if count > 0 else Fraction(0)
    m2 = sum((Fraction(w) * (Fraction(v) - mean) ** 2 for v, w in zip(xs, ws) if w != 0), Fraction(0))
    var = m2 / (count - 1) if count > 1 else Fraction(0)
    inv = 1.0 / math.sqrt(float(var) + eps)
    out = []
    for v, w in zip(xs, ws):
        if w == 0:
            out.append(0.0)
        else:
            z = float(Fraction(v) - mean) * inv
            out.append(z if shift_mean else z + float(mean))
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def reinforce_pp_advantages_ref(
    rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, eps: float = 1e-8
) -> torch.Tensor:
    """Reward-to-go over the counted tokens only, then whitening over all counted tokens."""
    returns = []
    for r, m in zip(rewards.double().tolist(), mask.bool().tolist()):
        running = 0.0
        row = [0.0] * len(r)
        for t in range(len(r) - 1, -1, -1):
            if m[t]:
                running = r[t] + gamma * running
                row[t] = running
        returns.append(row)
    g = torch.tensor(returns, dtype=torch.float64).reshape(rewards.shape)
    return batch_normalize_ref(g, mask, eps=eps)


def reinforce_pp_baseline_advantages_ref(
    scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8
) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.reinforce_pp_baseline_advantages`, written for clarity."""
    s = scores.double().tolist()
    centred = [0.0] * len(s)
    for idx in _members(group_ids).values():
        mu = _mean([s[i] for i in idx])
        for i in idx:
            centred[i] = float(Fraction(s[i]) - mu)
    tokens = torch.tensor(centred, dtype=torch.float64)[:, None].expand(mask.shape)
    return batch_normalize_ref(tokens, mask, eps=eps)


def grpo_advantages_ref(
    scores: torch.Tensor, group_ids: torch.Tensor, *, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.grpo_advantages`, written for clarity."""
    s = scores.double().tolist()
    batch_std = _std(s)
    out = [0.0] * len(s)
    for idx in _members(group_ids).values():
        xs = [s[i] for i in idx]
        mu = _mean(xs)
        std = {"group": _std(xs), "batch": batch_std, "none": None}[scale]
        for i in idx:
            c = float(Fraction(s[i]) - mu)
            out[i] = c if std is None else c / (std + eps)
    return torch.tensor(out, dtype=torch.float64)


def rloo_advantages_ref(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Literal leave-one-out: each score minus the mean of the others in its group."""
    s = scores.double().tolist()
    out = [0.0] * len(s)
    for idx in _members(group_ids).values():
        for i in idx:
            others = [s[j] for j in idx if j != i]
            out[i] = float(Fraction(s[i]) - _mean(others)) if others else 0.0
    return torch.tensor(out, dtype=torch.float64)


def gpg_advantages_ref(
    scores: torch.Tensor, group_ids: torch.Tensor, *, f_norm: float = 1.0, alpha: float | str = 1.0
) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.gpg_advantages`, written for clarity."""
    s = scores.double().tolist()
    groups = _members(group_ids)
    if alpha == "auto":
        invalid = sum(len(idx) for idx in groups.values() if len({s[i] for i in idx}) == 1)
        a = len(s) / max(len(s) - invalid, 1)
    else:
        a = float(alpha)
    out = [0.0] * len(s)
    for idx in groups.values():
        mu = _mean([s[i] for i in idx])
        for i in idx:
            out[i] = a * float(Fraction(s[i]) - mu) / f_norm
    return torch.tensor(out, dtype=torch.float64)


def opo_advantages_ref(scores: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.opo_advantages`, written for clarity."""
    s = scores.double().tolist()
    ln = lengths.double().tolist()
    out = [0.0] * len(s)
    for idx in _members(group_ids).values():
        total = sum(Fraction(ln[i]) for i in idx)
        if total != 0:
            base = sum(Fraction(ln[i]) * Fraction(s[i]) for i in idx) / total
        else:
            base = _mean([s[i] for i in idx])
        for i in idx:
            out[i] = float(Fraction(s[i]) - base)
    return torch.tensor(out, dtype=torch.float64)


def remax_advantages_ref(scores: torch.Tensor, baseline_scores: torch.Tensor) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.remax_advantages`, written for clarity."""
    return torch.tensor(
        [float(Fraction(a) - Fraction(b)) for a, b in zip(scores.double().tolist(), baseline_scores.double().tolist())],
        dtype=torch.float64,
    )


def passk_advantages_ref(scores: torch.Tensor, group_ids: torch.Tensor, *, k: int = 4) -> torch.Tensor:
    """Enumerates the k-subsets of each group: a response's advantage is the mean, over the
    subsets that contain it, of ``(max reward of the subset - mean) / std`` (population std
    over all subsets; 0 when the std is 0)."""
    correct = [1 if v > 0 else 0 for v in scores.double().tolist()]
    out = [0.0] * len(correct)
    for idx in _members(group_ids).values():
        kk = min(k, len(idx))
        subsets = list(itertools.combinations(idx, kk))
        rewards = [max(correct[i] for i in sub) for sub in subsets]
        mu = Fraction(sum(rewards), len(rewards))
        var = sum(((r - mu) ** 2 for r in rewards), Fraction(0)) / len(rewards)
        if var == 0:
            continue
        sigma = math.sqrt(float(var))
        for i in idx:
            mine = [r for sub, r in zip(subsets, rewards) if i in sub]
            out[i] = float(sum((r - mu for r in mine), Fraction(0)) / len(mine)) / sigma
    return torch.tensor(out, dtype=torch.float64)


def gdpo_advantages_ref(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    weights: list[float] | None = None,
    eps: float = 1e-6,
    batch_norm: bool = True,
) -> torch.Tensor:
    """GDPO: a GRPO z-score per component and group, the weighted sum, then whitened over the samples."""
    columns = scores.double()[:, None] if scores.dim() == 1 else scores.double()
    total = [0.0] * columns.shape[0]
    for k in range(columns.shape[1]):
        adv = grpo_advantages_ref(columns[:, k], group_ids, eps=eps).tolist()
        w = 1.0 if weights is None else weights[k]
        total = [t + w * a for t, a in zip(total, adv)]
    if batch_norm:
        mu = float(_mean(total))
        std = _std(total)
        total = [(t - mu) / math.sqrt(std * std + 1e-8) for t in total]
    return torch.tensor(total, dtype=torch.float64)


def optimal_token_baseline_advantages_ref(
    rewards: torch.Tensor,
    old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    multi_turn: bool = False,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline, one group and one aligned step at a time.

    Each response becomes a list of ``(position, G_t, W_t)`` over its counted tokens;
    responses are lined up by position, or by counted index with ``multi_turn``.
    """
    rs, lps, sps, ms = (x.double().tolist() for x in (rewards, old_logp, sum_pi_squared, mask))
    rho = is_weights.double().tolist() if is_weights is not None else None
    b, t_len = len(ms), len(ms[0]) if ms else 0
    steps: list[dict[int, tuple[int, float, float]]] = []
    ret_out = [[0.0] * t_len for _ in range(b)]
    for i in range(b):
        counted = [t for t in range(t_len) if ms[i][t] != 0]
        running, path = 0.0, 0.0
        g = {}
        for t in reversed(counted):
            running += rs[i][t]
            g[t] = running
        row: dict[int, tuple[int, float, float]] = {}
        for k, t in enumerate(counted):
            w = 1.0 - 2.0 * math.exp(lps[i][t]) + sps[i][t]
            path += w * (rho[i][t] ** 2 if rho is not None else 1.0)
            row[k if multi_turn else t] = (t, g[t], path)
            ret_out[i][t] = g[t]
        steps.append(row)
    adv_out = [[0.0] * t_len for _ in range(b)]
    for idx in _members(group_ids).values():
        members = [i for i in idx if steps[i]] if multi_turn else idx
        for i in idx:
            for key, (t, g_t, _) in steps[i].items():
                present = [steps[j][key] for j in idx if key in steps[j]]
                if len(members) == 1 or (handle_zero_tail and len(present) == 1):
                    base = 0.0
                else:
                    base = math.fsum(gj * wj for _, gj, wj in present) / (math.fsum(wj for *_, wj in present) + eps)
                adv_out[i][t] = g_t - base
    return torch.tensor(adv_out, dtype=torch.float64), torch.tensor(ret_out, dtype=torch.float64)
