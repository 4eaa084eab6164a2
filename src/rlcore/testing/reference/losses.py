"""Loop references for the policy and value losses and for loss aggregation.

Each policy-loss reference walks the tokens one at a time in float64 and returns
``(loss_t, grad_t, metrics)``: the per-token loss, the gradient of ``sum(loss_t)`` with
respect to ``logp`` (``values`` for the value loss) derived by hand from the paper's
formula, and the clip fractions and ratio statistics. Positions with mask 0 are skipped
and hold 0, so ``nan`` padding never enters.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "aggregate_ref",
    "cispo_loss_ref",
    "clip_cov_loss_ref",
    "dppo_kl_loss_ref",
    "dppo_tv_loss_ref",
    "dro_loss_ref",
    "gmpo_loss_ref",
    "gspo_loss_ref",
    "kl_cov_loss_ref",
    "ppo_clip_loss_ref",
    "reinforce_loss_ref",
    "sapo_loss_ref",
    "value_loss_ref",
]

_CLAMP = 20.0

Result = tuple[torch.Tensor, torch.Tensor, dict[str, float]]


def _rows(*xs: torch.Tensor) -> list[list[list[float]]]:
    return [x.double().tolist() for x in xs]


def _log_ratio(lp: float, olp: float) -> float:
    return min(max(lp - olp, -_CLAMP), _CLAMP)


def _tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _ratio_stats(log_ratios: list[float]) -> dict[str, float]:
    n = len(log_ratios)
    if n == 0:
        return {"approx_kl": 0.0, "ratio_mean": 0.0, "ratio_min": 0.0, "ratio_max": 0.0}
    ratios = [math.exp(x) for x in log_ratios]
    return {
        "approx_kl": math.fsum(r - 1.0 - x for r, x in zip(ratios, log_ratios)) / n,
        "ratio_mean": math.fsum(ratios) / n,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def _frac(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def ppo_clip_loss_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> Result:
    """PPO-clip per token: ``max(-A r, -A clip(r))``, then ``min(., -A c)`` for ``A < 0``."""
    lps, olps, advs, ms = _rows(logp, old_logp, advantages, mask)
    ws = is_weights.double().tolist() if is_weights is not None else None
    loss, grad = [], []
    lrs, low, high, dual = [], [], [], []
    for i, row in enumerate(ms):
        lrow, grow = [], []
        for t, m in enumerate(row):
            if m == 0:
                lrow.append(0.0)
                grow.append(0.0)
                continue
            lr = _log_ratio(lps[i][t], olps[i][t])
            r = math.exp(lr)
            a = advs[i][t]
            w = ws[i][t] if ws is not None else 1.0
            lo, hi = 1.0 - clip_low, 1.0 + clip_high
            unclipped, clipped = -a * r, -a * min(max(r, lo), hi)
            value = max(unclipped, clipped)
            # The gradient flows only through an active unclipped branch.
            live = unclipped >= clipped and (lo <= r <= hi or unclipped > clipped)
            live = live and -_CLAMP < lps[i][t] - olps[i][t] < _CLAMP
            if dual_clip is not None and a < 0 and value > -a * dual_clip:
                value = -a * dual_clip
                live = False
                dual.append(True)
            else:
                dual.append(False)
            lrow.append(w * value)
            grow.append(w * -a * r if live else 0.0)
            lrs.append(lr)
            low.append(a < 0 and r < lo)
            high.append(a > 0 and r > hi)
        loss.append(lrow)
        grad.append(grow)
    metrics = {"clip_frac_low": _frac(low), "clip_frac_high": _frac(high), **_ratio_stats(lrs)}
    if dual_clip is not None:
        metrics["clip_frac_dual"] = _frac(dual)
    return _tensor(loss), _tensor(grad), metrics


def gspo_loss_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> Result:
    """GSPO per token: the sequence ratio ``exp(mean_t log r_t)`` clipped PPO-style.

    The gradient of ``sum(loss_t)`` at token ``t`` is ``-A_t s_i`` where the token's
    clipped branch is inactive: GSPO-token routes ``s_i`` onto each token's own logp.
    """
    lps, olps, advs, ms = _rows(logp, old_logp, advantages, mask)
    loss, grad = [], []
    lrs, low, high = [], [], []
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    for i, row in enumerate(ms):
        idx = [t for t, m in enumerate(row) if m != 0]
        raw = math.fsum(_log_ratio(lps[i][t], olps[i][t]) for t in idx) / len(idx) if idx else 0.0
        log_s = min(max(raw, -_CLAMP), _CLAMP)
        s = math.exp(log_s)
        lrow, grow = [0.0] * len(row), [0.0] * len(row)
        for t in idx:
            a = advs[i][t]
            unclipped, clipped = -a * s, -a * min(max(s, lo), hi)
            lrow[t] = max(unclipped, clipped)
            live = (lo <= s <= hi or unclipped > clipped) and -_CLAMP < raw < _CLAMP
            grow[t] = -a * s if live else 0.0
            lrs.append(log_s)
            low.append(a < 0 and s < lo)
            high.append(a > 0 and s > hi)
        loss.append(lrow)
        grad.append(grow)
    metrics = {"clip_frac_low": _frac(low), "clip_frac_high": _frac(high), **_ratio_stats(lrs)}
    return _tensor(loss), _tensor(grad), metrics


def cispo_loss_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float = 0.28,
) -> Result:
    """CISPO per token: ``-min(max(r, 1 - eps_low), 1 + eps_high) * A * logp``; gradient ``-w A``."""
    lps, olps, advs, ms = _rows(logp, old_logp, advantages, mask)
    loss, grad = [], []
    lrs, low, high = [], [], []
    lo = -math.inf if clip_low is None else 1.0 - clip_low
    hi = 1.0 + clip_high
    for i, row in enumerate(ms):
        lrow, grow = [], []
        for t, m in enumerate(row):
            if m == 0:
                lrow.append(0.0)
                grow.append(0.0)
                continue
            lr = _log_ratio(lps[i][t], olps[i][t])
            r = math.exp(lr)
            w = min(max(r, lo), hi)
            a = advs[i][t]
            lrow.append(-w * a * lps[i][t])
            grow.append(-w * a)
            lrs.append(lr)
            low.append(r < lo)
            high.append(r > hi)
        loss.append(lrow)
        grad.append(grow)
    metrics = {"clip_frac_low": _frac(low), "clip_frac_high": _frac(high), **_ratio_stats(lrs)}
    return _tensor(loss), _tensor(grad), metrics


def reinforce_loss_ref(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> Result:
    """REINFORCE per token: ``-A * logp``; gradient ``-A``."""
    lps, olps, advs, ms = _rows(logp, old_logp, advantages, mask)
    loss, grad = [], []
    lrs: list[float] = []
    for i, row in enumerate(ms):
        loss.append([-advs[i][t] * lps[i][t] if m != 0 else 0.0 for t, m in enumerate(row)])
        grad.append([-advs[i][t] if m != 0 else 0.0 for t, m in enumerate(row)])
        lrs.extend(_log_ratio(lps[i][t], olps[i][t]) for t, m in enumerate(row) if m != 0)
    return _tensor(loss), _tensor(grad), _ratio_stats(lrs)


def sapo_loss_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> Result:
    """SAPO per token: ``-sigmoid(tau (r - 1)) * 4 / tau * A``; gradient ``-4 s (1 - s) r A``."""
    lps, olps, advs, ms = _rows(logp, old_logp, advantages, mask)
    loss, grad, lrs, gates = [], [], [], []
    for i, row in enumerate(ms):
        lrow, grow = [], []
        for t, m in enumerate(row):
            if m == 0:
                lrow.append(0.0)
                grow.append(0.0)
                continue
            lr = _log_ratio(lps[i][t], olps[i][t])
            r = math.exp(lr)
            a = advs[i][t]
            tau = tau_pos if a > 0 else tau_neg
            s = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
            lrow.append(-s * 4.0 / tau * a)
            live = -_CLAMP < lps[i][t] - olps[i][t] < _CLAMP
            grow.append(-4.0 * s * (1.0 - s) * r * a if live else 0.0)
            lrs.append(lr)
            gates.append(4.0 * s * (1.0 - s))
        loss.append(lrow)
        grad.append(grow)
    metrics = _ratio_stats(lrs)
    metrics["gate_mean"] = math.fsum(gates) / len(gates) if gates else 0.0
    return _tensor(loss), _tensor(grad), metrics


def gmpo_loss_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> Result:
    """GMPO: ``-mean(A) * exp(mean_t c_t)`` on every token, ``c_t`` the sign-aware clipped log-ratio.

    ``sum_t loss_t = -n mean(A) rho``, so its gradient at token ``t`` is ``-mean(A) rho``
    where ``c_t`` takes the unclipped branch, else 0.
    """
    lps, olps, advs, ms = _rows(logp, old_logp, advantages, mask)
    loss, grad = [], []
    lrs, low, high = [], [], []
    for i, row in enumerate(ms):
        idx = [t for t, m in enumerate(row) if m != 0]
        chosen, live = {}, {}
        for t in idx:
            lr = _log_ratio(lps[i][t], olps[i][t])
            a = advs[i][t]
            sg = (a > 0) - (a < 0)
            cl = min(max(lr, -clip_low), clip_high)
            chosen[t] = sg * min(sg * lr, sg * cl)
            in_range = -_CLAMP < lps[i][t] - olps[i][t] < _CLAMP
            live[t] = sg != 0 and sg * lr <= sg * cl and in_range
            lrs.append(lr)
            low.append(a < 0 and lr < -clip_low)
            high.append(a > 0 and lr > clip_high)
        n = len(idx)
        rho = math.exp(math.fsum(chosen.values()) / n) if n else 1.0
        mean_a = math.fsum(advs[i][t] for t in idx) / n if n else 0.0
        lrow, grow = [0.0] * len(row), [0.0] * len(row)
        for t in idx:
            lrow[t] = -mean_a * rho
            grow[t] = -mean_a * rho if live[t] else 0.0
        loss.append(lrow)
        grad.append(grow)
    metrics = {"clip_frac_low": _frac(low), "clip_frac_high": _frac(high), **_ratio_stats(lrs)}
    return _tensor(loss), _tensor(grad), metrics


def value_loss_ref(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
) -> Result:
    """``0.5 * max((v - R)^2, (v_clip - R)^2)`` per token; gradient with respect to ``values``."""
    vs, olds, rets, ms = _rows(values, old_values, returns, mask)
    loss, grad, clipped_flags, errs = [], [], [], []
    for i, row in enumerate(ms):
        lrow, grow = [], []
        for t, m in enumerate(row):
            if m == 0:
                lrow.append(0.0)
                grow.append(0.0)
                continue
            v, old, ret = vs[i][t], olds[i][t], rets[i][t]
            err = (v - ret) ** 2
            errs.append(err)
            if clip is None:
                lrow.append(0.5 * err)
                grow.append(v - ret)
                clipped_flags.append(False)
                continue
            vc = old + min(max(v - old, -clip), clip)
            err_c = (vc - ret) ** 2
            lrow.append(0.5 * max(err, err_c))
            # A larger clipped error means v is outside the clip band, where v_clip is constant.
            grow.append(0.0 if err_c > err else v - ret)
            clipped_flags.append(err_c > err)
        loss.append(lrow)
        grad.append(grow)
    metrics = {"clip_frac": _frac(clipped_flags), "mse": math.fsum(errs) / len(errs) if errs else 0.0}
    return _tensor(loss), _tensor(grad), metrics


def aggregate_ref(
    loss_t: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    horizon: float | None = None,
) -> float:
    """The aggregation formulas one sequence at a time, with ``math.fsum``."""
    ls, ms = _rows(loss_t, mask)
    seq_sums, seq_means, weights = [], [], []
    for lrow, mrow in zip(ls, ms):
        terms = [v * m for v, m in zip(lrow, mrow) if m != 0]
        w = math.fsum(m for m in mrow if m != 0)
        weights.append(w)
        seq_sums.append(math.fsum(terms))
        seq_means.append(math.fsum(terms) / w if w > 0 else 0.0)
    n_tok = math.fsum(weights) if num_tokens is None else float(num_tokens)
    n_seq = sum(1 for m in ms if any(v != 0 for v in m)) if num_seqs is None else float(num_seqs)
    t_len = len(ms[0]) if ms else 0
    hor = float(t_len if horizon is None else horizon)
    total = math.fsum(seq_sums)
    if mode == "token-sum":
        return total
    if mode == "token-mean":
        return total / n_tok if n_tok > 0 else 0.0
    if mode == "seq-mean-token-sum":
        return total / n_seq if n_seq > 0 else 0.0
    if mode == "seq-mean-token-mean":
        return math.fsum(seq_means) / n_seq if n_seq > 0 else 0.0
    if mode == "seq-mean-token-sum-norm":
        return total / (n_seq * hor) if n_seq > 0 else 0.0
    raise ValueError(f"mode: got {mode!r}")


def _binary_kl_ref(old_lp: float, lp: float) -> float:
    """``KL(Bern(q) || Bern(p))`` for log-probabilities (clamped to <= 0), with ``0 log 0 = 0``."""
    old_lp, lp = min(old_lp, 0.0), min(lp, 0.0)
    q = math.exp(old_lp)
    head = q * (old_lp - lp)
    if old_lp == 0.0:
        return head
    if lp == 0.0:
        return math.inf
    return head + (1.0 - q) * (math.log(-math.expm1(old_lp)) - math.log(-math.expm1(lp)))


def _dppo_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    divergence: str,
    clip_low: float,
    clip_high: float,
    ratio_cap: float | None,
) -> Result:
    lps, olps, advs, ms = _rows(logp, old_logp, advantages, mask)
    loss, grad, lrs, outside, capped = [], [], [], [], []
    for i, row in enumerate(ms):
        lrow, grow = [], []
        for t, m in enumerate(row):
            if m == 0:
                lrow.append(0.0)
                grow.append(0.0)
                continue
            lp, olp, a = lps[i][t], olps[i][t], advs[i][t]
            p, q = math.exp(min(lp, 0.0)), math.exp(min(olp, 0.0))
            if divergence == "tv":
                ok = p - q <= clip_high if a > 0 else p - q >= -clip_low
            else:
                d = _binary_kl_ref(olp, lp)
                ok = (d <= clip_high or p <= q) if a > 0 else (d <= clip_low or p >= q)
            lr = _log_ratio(lp, olp)
            r = math.exp(lr)
            w = r if ratio_cap is None else min(r, ratio_cap)
            lrow.append(-w * a * lp if ok else 0.0)
            grow.append(-w * a if ok else 0.0)
            lrs.append(lr)
            outside.append(not ok)
            capped.append(ok and ratio_cap is not None and r > ratio_cap)
        loss.append(lrow)
        grad.append(grow)
    metrics = {"trust_region_frac": _frac(outside), "cap_frac": _frac(capped), **_ratio_stats(lrs)}
    return _tensor(loss), _tensor(grad), metrics


def dppo_tv_loss_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.15,
    clip_high: float = 0.15,
    ratio_cap: float | None = 20.0,
) -> Result:
    """DPPO-Binary-TV per token: ``-min(r, C) A logp`` where ``p - p_old`` stays within its bound, else 0."""
    return _dppo_ref(
        logp,
        old_logp,
        advantages,
        mask,
        divergence="tv",
        clip_low=clip_low,
        clip_high=clip_high,
        ratio_cap=ratio_cap,
    )


def dppo_kl_loss_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.05,
    clip_high: float = 0.05,
    ratio_cap: float | None = 20.0,
) -> Result:
    """DPPO-Binary-KL per token: as the TV one, with the Bernoulli KL bounding moves along the advantage."""
    return _dppo_ref(
        logp,
        old_logp,
        advantages,
        mask,
        divergence="kl",
        clip_low=clip_low,
        clip_high=clip_high,
        ratio_cap=ratio_cap,
    )


def dro_loss_ref(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, beta: float
) -> Result:
    """DRO per token: ``-A logp + beta / 2 (logp - old_logp)^2``; gradient ``-A + beta (logp - old_logp)``."""
    lps, olps, advs, ms = _rows(logp, old_logp, advantages, mask)
    loss, grad, lrs, squares = [], [], [], []
    for i, row in enumerate(ms):
        lrow, grow = [], []
        for t, m in enumerate(row):
            if m == 0:
                lrow.append(0.0)
                grow.append(0.0)
                continue
            lp, olp, a = lps[i][t], olps[i][t], advs[i][t]
            lrow.append(-a * lp + 0.5 * beta * (lp - olp) ** 2)
            grow.append(-a + beta * (lp - olp))
            lrs.append(_log_ratio(lp, olp))
            squares.append((lp - olp) ** 2)
        loss.append(lrow)
        grad.append(grow)
    metrics = {"log_ratio_sq": math.fsum(squares) / len(squares) if squares else 0.0, **_ratio_stats(lrs)}
    return _tensor(loss), _tensor(grad), metrics


def _covariances_ref(lps: list[list[float]], advs: list[list[float]], ms: list[list[float]]) -> dict:
    """``{(i, t): (A - mean A) (logp - mean logp)}`` over the counted tokens."""
    cells = [(i, t) for i, row in enumerate(ms) for t, m in enumerate(row) if m != 0]
    if not cells:
        return {}
    mean_a = math.fsum(advs[i][t] for i, t in cells) / len(cells)
    mean_lp = math.fsum(lps[i][t] for i, t in cells) / len(cells)
    return {(i, t): (advs[i][t] - mean_a) * (lps[i][t] - mean_lp) for i, t in cells}


def clip_cov_loss_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    noise: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 1.0,
    cov_fraction: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
) -> Result:
    """Clip-Cov: PPO-clip, with loss and gradient 0 on the eligible tokens of largest ``noise``.

    Eligible: covariance strictly inside ``(cov_low, cov_high)`` and not clipped by PPO;
    ``max(int(cov_fraction * N), 1)`` of them are cut, ties to the earlier token.
    """
    loss, grad, metrics = ppo_clip_loss_ref(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    lps, olps, advs, ms, us = _rows(logp, old_logp, advantages, mask, noise)
    cov = _covariances_ref(lps, advs, ms)
    eligible = []
    for (i, t), c in cov.items():
        r = math.exp(_log_ratio(lps[i][t], olps[i][t]))
        a = advs[i][t]
        clipped = (a > 0 and r > 1.0 + clip_high) or (a < 0 and r < 1.0 - clip_low)
        if cov_low < c < cov_high and not clipped:
            eligible.append((-us[i][t], i * len(ms[0]) + t, i, t))
    count = max(int(cov_fraction * len(cov)), 1)
    cut = [(i, t) for _, _, i, t in sorted(eligible)[:count]]
    for i, t in cut:
        loss[i, t] = 0.0
        grad[i, t] = 0.0
    metrics["cov_frac"] = len(cut) / len(cov) if cov else 0.0
    return loss, grad, metrics


def kl_cov_loss_ref(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cov_fraction: float = 2e-4,
    kl_coef: float = 1.0,
) -> Result:
    """KL-Cov: ``-A r`` per token, plus ``kl_coef |log r|`` on the ``max(int(k N), 1)`` tokens of largest covariance."""
    lps, olps, advs, ms = _rows(logp, old_logp, advantages, mask)
    cov = _covariances_ref(lps, advs, ms)
    width = len(ms[0]) if ms else 0
    ranked = sorted((-c, i * width + t, i, t) for (i, t), c in cov.items())
    chosen = {(i, t) for _, _, i, t in ranked[: max(int(cov_fraction * len(cov)), 1)]}
    loss = [[0.0] * width for _ in ms]
    grad = [[0.0] * width for _ in ms]
    lrs, abs_lrs = [], []
    for i, t in cov:
        lr = _log_ratio(lps[i][t], olps[i][t])
        r, a = math.exp(lr), advs[i][t]
        live = -_CLAMP < lps[i][t] - olps[i][t] < _CLAMP
        penalty = kl_coef * abs(lr) if (i, t) in chosen else 0.0
        slope = kl_coef * math.copysign(1.0, lr) if (i, t) in chosen and lr != 0 else 0.0
        loss[i][t] = -a * r + penalty
        grad[i][t] = (-a * r + slope) if live else 0.0
        lrs.append(lr)
        abs_lrs.append(abs(lr))
    metrics = {
        "cov_frac": len(chosen) / len(cov) if cov else 0.0,
        "abs_log_ratio": math.fsum(abs_lrs) / len(abs_lrs) if abs_lrs else 0.0,
        **_ratio_stats(lrs),
    }
    return _tensor(loss), _tensor(grad), metrics
