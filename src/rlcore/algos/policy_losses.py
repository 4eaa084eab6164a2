"""Per-token policy-gradient losses: PPO-clip (DAPO clip-higher, dual-clip), GSPO, CISPO, SAPO, GMPO, GPG, REINFORCE.

Every loss takes ``(logp, old_logp, advantages, mask)``, all ``[B, T]``, and returns
``(loss_t, metrics)``: the per-token loss ``[B, T]`` in the dtype of ``logp`` (0 where
``mask`` is 0) and a dict of detached float32 scalars. Reduction to one number is
:func:`rlcore.algos.aggregate`'s job, so the same loss serves every normalisation.

Numerics: the log-ratio is formed in float32 (float64 for float64 inputs) and clamped
to ``[-20, 20]`` before ``exp``, so a stale or corrupted token cannot overflow the
ratio to ``inf``; beyond the clamp its gradient is 0. The loss is computed in that
precision and rounded to ``logp``'s dtype with saturation: in float16 (largest finite
65504, below ``exp(12)``) a per-token loss or gradient beyond the range becomes
``±65504``, never ``inf``; bfloat16 has float32's range. Inputs at mask-0 positions never
reach the loss or its gradient, even when they are ``nan`` (padding).

Metrics (all masked means over the counted tokens unless named otherwise):
``approx_kl`` is Schulman's k3 estimate ``r - 1 - log r`` of KL(old || new) (non-negative,
lower variance than the ``-log r`` that verl reports), ``ratio_mean``, ``ratio_min``,
``ratio_max`` (0 for an empty mask), and the clip fractions of each loss.

Gradients: each loss is its formula under autograd. Only ``logp`` is differentiated: old
log-probs, advantages and importance weights are data. A stop-gradient of the paper
(``sg``) is a ``detach``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rlcore._checks import check_counts, check_floating, check_ndim, check_positive, check_same_shape
from rlcore.ops import acc_dtype, saturating_cast

__all__ = ["cispo_loss", "gmpo_loss", "gpg_loss", "gspo_loss", "ppo_clip_loss", "reinforce_loss", "sapo_loss"]

Metrics = dict[str, torch.Tensor]

# exp(20) ~ 4.9e8: far outside any trust region, still finite in bf16/fp16 arithmetic.
_MAX_LOG_RATIO = 20.0


def _check(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> None:
    check_floating("logp", logp)
    check_ndim("logp", logp, 2)
    for name, x in (("old_logp", old_logp), ("advantages", advantages)):
        check_same_shape(name, x, "logp", logp)
        check_floating(name, x)
    check_same_shape("mask", mask, "logp", logp)
    if mask.dtype != torch.bool:
        check_counts("mask", mask)  # weights >= 0: a negative one would flip its token's gradient


def _check_clip(name: str, value: float) -> None:
    check_positive(name, value, strict=False)


class _SaturatingCast(torch.autograd.Function):
    """:func:`saturating_cast` with a gradient cast back the same way: a straight-through cast.

    A plain float32 -> float16 cast rounds a value or a gradient beyond 65504 to ``inf``,
    and the clamp inside :func:`saturating_cast` would give a saturated loss a zero
    gradient; here both directions saturate and the gradient passes through unchanged.
    """

    @staticmethod
    def forward(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        return saturating_cast(x, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        ctx.dtype = inputs[0].dtype

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[no-untyped-def,override]
        return saturating_cast(g, ctx.dtype), None


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` whose value and gradient saturate where either dtype is float16 (see above)."""
    if x.dtype == dtype:
        return x
    if min(torch.finfo(x.dtype).max, torch.finfo(dtype).max) > 1e30:
        return x.to(dtype)  # bfloat16, float32, float64: one exponent range, a plain cast
    return _SaturatingCast.apply(x, dtype)


class _Tokens(NamedTuple):
    """Per-token inputs in the accumulation dtype, 0 where the mask is 0."""

    keep: torch.Tensor  # bool: the token counts
    weights: torch.Tensor  # the mask as weights (bool or float), for the metrics' sums
    total: torch.Tensor  # total weight, replaced by 1 when 0 (empty masks give 0 metrics)
    log_ratio: torch.Tensor  # logp - old_logp clamped to +-20 (beyond it the gradient is 0), differentiable
    neg_adv: torch.Tensor  # -advantages, detached: every loss is linear in it, and +0 at mask 0 stays +0
    counted: torch.Tensor  # total weight as it is (0 for an empty mask)


def _prepare(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> _Tokens:
    # torch.where (not a multiply) keeps nan padding out of every value and every gradient.
    acc = acc_dtype(logp.dtype)
    keep = mask if mask.dtype == torch.bool else mask != 0
    with torch.no_grad():
        # A boolean mask serves as 0/1 weights as it is (no float copy).
        weights = mask if mask.dtype == torch.bool else mask.to(acc)
        # A count, not a sum with a dtype (which first copies the whole mask to that dtype).
        total = torch.count_nonzero(mask).to(acc) if mask.dtype == torch.bool else mask.sum(dtype=acc)
        neg_adv = torch.where(keep, -advantages.detach().to(acc), 0.0)
    raw = torch.where(keep, _cast(logp, acc) - old_logp.detach().to(acc), 0.0)
    log_ratio = raw.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return _Tokens(keep, weights, torch.where(total > 0, total, 1.0), log_ratio, neg_adv, total)


def _logp(logp: torch.Tensor, tok: _Tokens) -> torch.Tensor:
    """``logp`` in the accumulation dtype, differentiable, 0 where the mask is 0."""
    return torch.where(tok.keep, _cast(logp, tok.neg_adv.dtype), 0.0)


def _mean(x: torch.Tensor, tok: _Tokens) -> torch.Tensor:
    """Weighted mean over the counted tokens of a metric input that is finite everywhere.

    Every metric input is built from the zeroed inputs of :func:`_prepare`, so it is
    finite at mask-0 positions and a weighted sum is the masked sum; it skips the
    ``nan`` guard of :func:`rlcore.ops.masked_sum`, which costs several passes per metric.
    """
    return ((x * tok.weights).sum() / tok.total).float()


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, tok: _Tokens) -> Metrics:
    """``approx_kl`` and ratio statistics over the counted tokens (0 for an empty mask)."""
    with torch.no_grad():
        if ratio.numel() == 0:
            # An empty batch (e.g. dynamic sampling dropped every group): zero metrics.
            zero = ratio.new_zeros((), dtype=torch.float32)
            return {"approx_kl": zero, "ratio_mean": zero, "ratio_min": zero, "ratio_max": zero}
        rmin = torch.where(tok.keep, ratio, torch.inf).amin()
        return {
            "approx_kl": _mean(ratio - 1.0 - log_ratio, tok),
            "ratio_mean": _mean(ratio, tok),
            "ratio_min": torch.where(torch.isfinite(rmin), rmin, 0.0).float(),
            "ratio_max": torch.where(tok.keep, ratio, 0.0).amax().float(),
        }


def _frac(flags: torch.Tensor, tok: _Tokens) -> torch.Tensor:
    """Weighted fraction of the counted tokens where ``flags`` (False at every mask-0 position) holds."""
    if tok.weights.dtype == torch.bool:
        return (torch.count_nonzero(flags) / tok.total).float()  # a count: no weights, no copy
    return _mean(flags, tok)


def _ratio_sums(ratio: torch.Tensor, tok: _Tokens) -> Metrics:
    """As :func:`_ratio_metrics`, with fewer passes (PPO: ``ratio`` is ``exp(log_ratio)``, so 1 at mask 0).

    With a boolean mask the mask-0 positions hold ``log_ratio = 0`` and ``ratio = 1``,
    where ``ratio - 1`` and ``ratio - 1 - log_ratio`` are 0: plain sums over all tokens
    are the masked sums, with no weights to multiply.
    """
    if tok.weights.dtype != torch.bool or ratio.numel() == 0:
        return _ratio_metrics(ratio, tok.log_ratio, tok)
    excess = ratio - 1.0  # exact near 1; the mean ratio is 1 + its mean
    mean_excess = excess.sum() / tok.total
    rmin = torch.where(tok.keep, ratio, torch.inf).amin()
    return {
        "approx_kl": (excess.sub_(tok.log_ratio).sum() / tok.total).float(),
        "ratio_mean": torch.where(tok.counted > 0, 1.0 + mean_excess, 0.0).float(),
        "ratio_min": torch.where(torch.isfinite(rmin), rmin, 0.0).float(),
        "ratio_max": torch.where(tok.keep, ratio, 0.0).amax().float(),
    }


def _kl_only(ratio: torch.Tensor, tok: _Tokens) -> Metrics:
    """``approx_kl`` alone (see :func:`_ratio_sums`)."""
    if tok.weights.dtype != torch.bool:
        return {"approx_kl": _mean(ratio - 1.0 - tok.log_ratio, tok)}
    return {"approx_kl": ((ratio - 1.0).sub_(tok.log_ratio).sum() / tok.total).float()}


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
    ratio_stats: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token PPO clipped surrogate loss, with DAPO's clip-higher and dual-clip PPO.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347;
    asymmetric bounds ("clip-higher", ``clip_high=0.28``) from DAPO, arXiv:2503.14476;
    dual clip from Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL",
    arXiv:1912.09729.

    Formula, with ``r = exp(clamp(logp - old_logp, -20, 20))`` and ``A = advantages``::

        loss = w * max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        if dual_clip is c and A < 0:  loss = w * min(loss, -A * c)

    that is ``-A`` times the ratio clipped on one side, as the paper's figure 1 draws it,
    which is the form computed (fewer passes than ``max`` and ``min`` under autograd)::

        loss = w * -A * clip(r, 0, 1 + clip_high)          if A > 0
        loss = w * -A * clip(r, 1 - clip_low, c)           if A < 0   (c = inf without dual_clip)

    ``w`` is ``is_weights`` (detached; 1 when ``None``). A token whose ratio is clipped
    (``A > 0, r > 1 + clip_high``; ``A < 0, r < 1 - clip_low``; or dual-clipped) has zero
    gradient; one exactly on a bound keeps it. When ``logp == old_logp`` the loss is ``-A``
    and its gradient ``-A * d logp``, the policy gradient.

    Args:
      logp: ``[B, T]`` log-probabilities of the sampled tokens under the current policy.
      old_logp: ``[B, T]`` log-probabilities under the policy that sampled them.
      advantages: ``[B, T]`` advantages (broadcast outcome advantages to tokens first).
      mask: ``[B, T]``, 1 where a token counts.
      clip_low: lower clip range ``eps_low``, >= 0.
      clip_high: upper clip range ``eps_high``, >= 0.
      dual_clip: the dual-clip constant ``c`` (> 1, 3.0 in the paper), or ``None``.
      is_weights: optional ``[B, T]`` per-token importance weights (e.g. truncated IS
        weights for the rollout/training-engine mismatch), treated as constants.
      ratio_stats: also report ``ratio_mean``, ``ratio_min`` and ``ratio_max``; the
        extremes take two extra passes over the tokens, so a hot loop that does not
        log them can pass False.

    Returns:
      ``(loss_t, metrics)``: ``loss_t`` ``[B, T]`` in ``logp.dtype``; metrics
      ``clip_frac_low``, ``clip_frac_high`` (and ``clip_frac_dual`` with ``dual_clip``),
      ``approx_kl``, and with ``ratio_stats`` ``ratio_mean``, ``ratio_min``, ``ratio_max``.

    >>> lp = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> loss, m = ppo_clip_loss(lp, lp - 0.5, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    >>> loss
    tensor([[-1.2000,  1.6487]])
    >>> m["clip_frac_high"]
    tensor(0.5000)
    """
    _check(logp, old_logp, advantages, mask)
    _check_clip("clip_low", clip_low)
    _check_clip("clip_high", clip_high)
    if dual_clip is not None and not 1.0 < dual_clip < math.inf:
        raise ValueError(f"dual_clip: got {dual_clip!r}, expected None or a finite number > 1")
    if is_weights is not None:
        check_same_shape("is_weights", is_weights, "logp", logp)
    tok = _prepare(logp, old_logp, advantages, mask)
    nadv = tok.neg_adv  # -A
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    up = math.inf if dual_clip is None else dual_clip
    adv_pos, adv_neg = nadv < 0, nadv > 0  # A > 0, A < 0; both False at mask-0 positions
    ratio = tok.log_ratio.exp()
    # The one-sided clip of the docstring; bounds in the ratio's dtype keep them exact in float64.
    lower = torch.where(adv_neg, ratio.new_full((), lo), 0.0)
    upper = torch.where(adv_pos, ratio.new_full((), hi), up)
    loss = nadv * ratio.clamp(lower, upper)
    if is_weights is not None:
        loss = loss * torch.where(tok.keep, is_weights.detach().to(loss.dtype), 0.0)
    with torch.no_grad():
        ratio = ratio.detach()
        metrics = _ratio_sums(ratio, tok) if ratio_stats else _kl_only(ratio, tok)
        metrics["clip_frac_low"] = _frac(adv_neg.logical_and(ratio < lo), tok)
        metrics["clip_frac_high"] = _frac(adv_pos.logical_and_(ratio > hi), tok)
        if dual_clip is not None:
            metrics["clip_frac_dual"] = _frac(adv_neg.logical_and_(ratio > dual_clip), tok)
    return _cast(loss, logp.dtype), metrics


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token GSPO loss: PPO clipping of the length-normalised sequence ratio.

    Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071 (the
    GSPO-token form, eq. 13-14). Defaults are the paper's clip ranges (3e-4, 4e-4).

    Formula, per sequence ``i`` with ``n_i`` counted tokens::

        s_i     = exp(sum_t mask * (logp - old_logp) / n_i)
        s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t))          (value s_i, gradient s_i * d logp_t)
        loss_t  = max(-A_t * s_{i,t}, -A_t * clip(s_{i,t}, 1 - clip_low, 1 + clip_high))

    With advantages constant along a sequence, aggregating with ``"seq-mean-token-mean"``
    gives exactly the paper's sequence-level objective and gradient. The log of ``s_i``
    is clamped to ``[-20, 20]``.

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`.
      clip_low, clip_high: clip ranges of the sequence ratio.

    Returns:
      ``(loss_t, metrics)``; ``clip_frac_low`` / ``clip_frac_high`` count tokens whose
      sequence ratio is clipped, ratio stats are over the sequence ratios of the tokens.

    >>> lp = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    >>> loss, _ = gspo_loss(lp, lp, torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[1, 1, 0]]))
    >>> loss
    tensor([[-1., -1.,  0.]])
    """
    _check(logp, old_logp, advantages, mask)
    _check_clip("clip_low", clip_low)
    _check_clip("clip_high", clip_high)
    tok = _prepare(logp, old_logp, advantages, mask)
    nadv = tok.neg_adv  # -A
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    with torch.no_grad():
        n = tok.weights.sum(-1, keepdim=True, dtype=nadv.dtype)
        log_s = (tok.log_ratio * tok.weights).sum(-1, keepdim=True) / torch.where(n > 0, n, 1.0)  # log s_i
    lp = _logp(logp, tok)
    # log s_{i,t} = sg(log s_i) + logp_t - sg(logp_t), clamped to +-20 (no gradient beyond).
    log_st = torch.where(tok.keep, log_s + (lp - lp.detach()), 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_st.exp()
    loss = torch.maximum(nadv * ratio, nadv * ratio.clamp(lo, hi))
    with torch.no_grad():
        ratio, log_st = ratio.detach(), log_st.detach()
        metrics = _ratio_metrics(ratio, log_st, tok)
        metrics["clip_frac_low"] = _mean((nadv > 0) & (ratio < lo), tok)
        metrics["clip_frac_high"] = _mean((nadv < 0) & (ratio > hi), tok)
    return _cast(loss, logp.dtype), metrics


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token CISPO loss: REINFORCE weighted by a clipped, stop-gradient importance ratio.

    MiniMax et al. 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", arXiv:2506.13585, eq. 4-5.

    Formula::

        loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t

    Unlike PPO, no token loses its gradient: a clipped ratio only caps the token's weight.
    The paper sets no lower bound (``clip_low=None``) and tunes only ``eps_high`` without
    publishing its value; the default 0.28 is DAPO's clip-higher bound, as in Trinity-RFT.
    The loss value is ``-w A logp``, not ``-A``; only its gradient is the estimator. The
    paper normalises by the token count (``"token-mean"``).

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`.
      clip_low: lower bound ``eps_low`` (>= 0), or ``None`` for none.
      clip_high: upper bound ``eps_high`` (>= 0).

    Returns:
      ``(loss_t, metrics)``; ``clip_frac_low`` / ``clip_frac_high`` count tokens whose
      weight was clipped from below / above.

    >>> lp = torch.log(torch.tensor([[0.5, 0.25]]))
    >>> loss, _ = cispo_loss(lp, lp - 1.0, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
    >>> loss
    tensor([[0.8872, 1.7745]])
    """
    _check(logp, old_logp, advantages, mask)
    if clip_low is not None:
        _check_clip("clip_low", clip_low)
    _check_clip("clip_high", clip_high)
    tok = _prepare(logp, old_logp, advantages, mask)
    lo = None if clip_low is None else 1.0 - clip_low
    hi = 1.0 + clip_high
    ratio = tok.log_ratio.detach().exp()
    loss = ratio.clamp(lo, hi) * tok.neg_adv * _logp(logp, tok)  # the ratio is detached: sg(clip(r))
    with torch.no_grad():
        metrics = _ratio_metrics(ratio, tok.log_ratio, tok)
        low = ratio < lo if lo is not None else torch.zeros_like(tok.keep)
        metrics["clip_frac_low"] = _mean(low, tok)
        metrics["clip_frac_high"] = _mean(ratio > hi, tok)
    return _cast(loss, logp.dtype), metrics


def reinforce_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, Metrics]:
    """Per-token REINFORCE loss ``-A * logp``, the vanilla policy-gradient surrogate.

    Williams 1992, "Simple Statistical Gradient-Following Algorithms for Connectionist
    Reinforcement Learning" (Machine Learning 8); in the LLM setting, Ahmadian et al.
    2024, "Back to Basics", arXiv:2402.14740.

    Formula::

        loss_t = -A_t * logp_t          (gradient: -A_t * d logp_t)

    On-policy only: nothing corrects for ``logp != old_logp``; ``old_logp`` feeds the
    metrics, which show how far the data has drifted off-policy.

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`.

    Returns:
      ``(loss_t, metrics)`` with ``approx_kl`` and ratio stats.

    >>> lp = torch.log(torch.tensor([[0.5, 0.25]]))
    >>> reinforce_loss(lp, lp, torch.tensor([[1.0, -2.0]]), torch.ones(1, 2))[0]
    tensor([[ 0.6931, -2.7726]])
    """
    _check(logp, old_logp, advantages, mask)
    tok = _prepare(logp, old_logp, advantages, mask)
    loss = tok.neg_adv * _logp(logp, tok)
    with torch.no_grad():
        metrics = _ratio_metrics(tok.log_ratio.exp(), tok.log_ratio, tok)
    return _cast(loss, logp.dtype), metrics


def gpg_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, Metrics]:
    """Per-token GPG loss: the REINFORCE surrogate on GPG's corrected group advantages.

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546, eq. 8.

    Formula::

        loss_t = -A_t * logp_t

    GPG has no ratio, no clipping and no KL; what it changes is the advantage
    (:func:`rlcore.algos.gpg_advantages`, with the ``alpha`` correction for groups that
    carry no signal) and the ``"token-mean"`` normalisation.

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`.

    Returns:
      ``(loss_t, metrics)`` as :func:`reinforce_loss`.

    >>> lp = torch.log(torch.tensor([[0.5]]))
    >>> gpg_loss(lp, lp, torch.tensor([[2.0]]), torch.ones(1, 1))[0]
    tensor([[1.3863]])
    """
    return reinforce_loss(logp, old_logp, advantages, mask)


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token SAPO loss: a temperature-controlled sigmoid gate in place of the hard clip.

    Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347. Defaults are
    the paper's temperatures (tau_neg > tau_pos damps negative-advantage tokens faster).

    Formula, with ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``::

        f(r)   = sigmoid(tau * (r - 1)) * 4 / tau
        loss_t = -f(r_t) * A_t              (gradient: -4 s (1 - s) * r_t * A_t * d logp_t,
                                             s = sigmoid(tau * (r_t - 1)))

    At ``r = 1`` the gate's slope is 1, so the on-policy gradient is the policy gradient
    ``-A d logp``; it decays smoothly as ``r`` leaves 1. The paper averages per sequence
    (``"seq-mean-token-mean"``).

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`.
      tau_pos: gate temperature for positive advantages (> 0).
      tau_neg: gate temperature for zero and negative advantages (> 0).

    Returns:
      ``(loss_t, metrics)``; ``gate_mean`` is the mean gradient weight ``4 s (1 - s)``.

    >>> lp = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> sapo_loss(lp, lp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))[0]
    tensor([[-2.0000,  1.9048]])
    """
    _check(logp, old_logp, advantages, mask)
    check_positive("tau_pos", tau_pos, finite=True)
    check_positive("tau_neg", tau_neg, finite=True)
    tok = _prepare(logp, old_logp, advantages, mask)
    nadv = tok.neg_adv  # -A
    ratio = tok.log_ratio.exp()
    tau = torch.where(nadv < 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = gate * (4.0 / tau) * nadv  # -f(r) A
    with torch.no_grad():
        ratio, gate = ratio.detach(), gate.detach()
        metrics = _ratio_metrics(ratio, tok.log_ratio, tok)
        metrics["gate_mean"] = _mean(4.0 * gate * (1.0 - gate), tok)
    return _cast(loss, logp.dtype), metrics


def gmpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token GMPO loss: PPO on the geometric mean of token ratios, clipped in log space.

    Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673, eq. 4;
    defaults are the paper's log-space range ``(e^-0.4, e^0.4)``.

    Formula, per sequence ``i`` with ``n_i`` counted tokens, ``l_t = logp_t - old_logp_t``
    and ``sg = sign(A_t)``::

        c_t    = sg * min(sg * l_t, sg * clip(l_t, -clip_low, clip_high))
        rho_i  = exp(sum_t mask * c_t / n_i)
        loss_t = -mean_i(A) * rho_i                 (the same value on every token of i)

    The sequence loss is written onto each of its tokens, so ``"seq-mean-token-mean"``
    aggregation gives the paper's objective; any aggregation gives the matching gradient.
    Advantages are meant to be constant along a sequence; token-level ones enter through
    their per-sequence mean (as in verl).

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`.
      clip_low, clip_high: clip range of the token log-ratio, >= 0.

    Returns:
      ``(loss_t, metrics)``; clip fractions count tokens whose log-ratio was clipped,
      ratio stats are over the token ratios.

    >>> lp = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> gmpo_loss(lp, lp + torch.tensor([[0.2, -0.2]]), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))[0]
    tensor([[-1., -1.]])
    """
    _check(logp, old_logp, advantages, mask)
    _check_clip("clip_low", clip_low)
    _check_clip("clip_high", clip_high)
    tok = _prepare(logp, old_logp, advantages, mask)
    nadv, log_ratio = tok.neg_adv, tok.log_ratio  # -A, l
    sign = -torch.sign(nadv)  # sg = sign(A)
    chosen = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-clip_low, clip_high))  # c_t
    # Both are 0 at mask-0 positions, so weighted sums are masked sums.
    n = tok.weights.sum(-1, keepdim=True, dtype=nadv.dtype)
    n = torch.where(n > 0, n, 1.0)
    rho = ((chosen * tok.weights).sum(-1, keepdim=True) / n).exp()
    seq_nadv = (nadv * tok.weights).sum(-1, keepdim=True) / n  # -mean_i(A)
    loss = torch.where(tok.keep, seq_nadv * rho, 0.0)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio.exp(), log_ratio, tok)
        metrics["clip_frac_low"] = _mean((nadv > 0) & (log_ratio < -clip_low), tok)
        metrics["clip_frac_high"] = _mean((nadv < 0) & (log_ratio > clip_high), tok)
    return _cast(loss, logp.dtype), metrics
