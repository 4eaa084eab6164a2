"""Per-token policy-gradient losses: PPO-clip (DAPO clip-higher, dual-clip), GSPO, CISPO, SAPO, GMPO, GPG, REINFORCE,
the divergence trust regions of DPPO, DRO's quadratic penalty, and the entropy-controlling Clip-Cov and KL-Cov.

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
from rlcore.ops import acc_dtype, keep_bits, masked_zero, masked_zero_, saturating_cast

__all__ = [
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "gmpo_loss",
    "gpg_loss",
    "gspo_loss",
    "kl_cov_loss",
    "ppo_clip_loss",
    "reinforce_loss",
    "sapo_loss",
]

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
    lp: torch.Tensor | None  # logp, differentiable, 0 where the mask is 0 (with_logp only)
    old_lp: torch.Tensor | None  # old_logp, detached, 0 where the mask is 0 (with_logp only)
    bits: torch.Tensor  # keep as rlcore.ops.keep_bits of the accumulation dtype: zeroes padding as a bitwise and


def _prepare(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    with_logp: bool = False,
) -> _Tokens:
    """The per-token inputs every loss starts from; ``with_logp`` also keeps ``logp`` and ``old_logp``
    (zeroed), for losses that read them beside the ratio: the log-ratio is then their difference,
    one graph node fewer than zeroing ``logp`` twice."""
    # Zeroing (not a multiply) keeps nan padding out of every value and every gradient; as a bitwise
    # and (rlcore.ops.masked_zero), the same bits as torch.where, which is a scalar loop on the CPU.
    acc = acc_dtype(logp.dtype)
    keep = mask if mask.dtype == torch.bool else mask != 0
    bits = keep_bits(keep, acc)
    lp: torch.Tensor | None = None
    old_lp: torch.Tensor | None = None
    with torch.no_grad():
        # A boolean mask serves as 0/1 weights as it is (no float copy).
        weights = mask if mask.dtype == torch.bool else mask.to(acc)
        # A count, not a sum with a dtype (which first copies the whole mask to that dtype).
        total = torch.count_nonzero(mask).to(acc) if mask.dtype == torch.bool else mask.sum(dtype=acc)
        # -A in one buffer, +0 at mask 0 (the negation first, then the zeroing).
        neg_adv = masked_zero_(torch.neg(advantages.detach().to(acc)), bits)
    if with_logp:
        with torch.no_grad():
            old_lp = masked_zero(old_logp.detach().to(acc), bits)
        lp = masked_zero(_cast(logp, acc), bits)
        raw = lp - old_lp
    else:
        raw = masked_zero(_cast(logp, acc) - old_logp.detach().to(acc), bits)
    log_ratio = raw.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return _Tokens(keep, weights, torch.where(total > 0, total, 1.0), log_ratio, neg_adv, total, lp, old_lp, bits)


def _logp(logp: torch.Tensor, tok: _Tokens) -> torch.Tensor:
    """``logp`` in the accumulation dtype, differentiable, 0 where the mask is 0."""
    if tok.lp is not None:
        return tok.lp
    return masked_zero(_cast(logp, tok.neg_adv.dtype), tok.bits)


def _mean(x: torch.Tensor, tok: _Tokens) -> torch.Tensor:
    """Weighted mean over the counted tokens of a metric input that is finite everywhere.

    Every metric input is built from the zeroed inputs of :func:`_prepare`, so it is
    finite at mask-0 positions and a weighted sum is the masked sum; it skips the
    ``nan`` guard of :func:`rlcore.ops.masked_sum`, which costs several passes per metric.
    """
    return ((x * tok.weights).sum() / tok.total).float()


def _padded_mean(x: torch.Tensor, tok: _Tokens) -> torch.Tensor:
    """:func:`_mean` of a metric input that is 0 at every mask-0 position: with a boolean mask, a plain sum.

    The inputs of :func:`_prepare` are 0 there, and so is anything that vanishes at 0
    (``log_ratio ** 2``, a product with ``neg_adv``): summing all tokens is the masked
    sum, with no weights to convert and multiply.
    """
    if tok.weights.dtype == torch.bool:
        return (x.sum() / tok.total).float()
    return _mean(x, tok)


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


def _kl_only(ratio: torch.Tensor, tok: _Tokens, *, owned: bool = False) -> Metrics:
    """``approx_kl`` alone (see :func:`_ratio_sums`); ``owned``: ``ratio`` is the caller's spent buffer, used in place."""
    if tok.weights.dtype != torch.bool:
        return {"approx_kl": _mean(ratio - 1.0 - tok.log_ratio, tok)}
    excess = ratio.sub_(1.0) if owned else ratio - 1.0
    return {"approx_kl": (excess.sub_(tok.log_ratio).sum() / tok.total).float()}


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


def _probs_in_range(logp: torch.Tensor) -> torch.Tensor:
    """A log-probability as a probability; a value above 0 (not a log-probability) counts as 1."""
    return logp.clamp(max=0.0).exp()


def _binary_kl(old_lp: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """``KL(Bern(p_old) || Bern(p))`` from log-probabilities ``<= 0``, exact near ``p = 1``.

    ``log(1 - p)`` is ``log(-expm1(logp))``, so a probability within float rounding of 1
    keeps its distance to 1 (peers add ``1e-8`` to both sides instead). A token whose
    old probability is 1 contributes no second term (``0 log 0 = 0``); one whose new
    probability is 1 and old is not is infinitely far.
    """
    old_lp, lp = old_lp.clamp(max=0.0), lp.clamp(max=0.0)
    q = old_lp.exp()
    # (1 - q) (log(1 - q) - log(1 - p)), in place (a hot path: no gradient flows through it). Where
    # q = 1 (padding among them) the term is 0: both logs are taken of 1 more than their argument
    # there, so that no log of 0 is taken (the CPU's log takes a slow path for each 0 and subnormal,
    # 8x the time at 40% padding) and the factor 1 - q = 0 zeroes the finite difference.
    certain = (old_lp >= 0).to(q.dtype)
    tail = torch.expm1(old_lp).neg_().add_(certain).log_()
    tail.sub_(torch.expm1(lp).neg_().add_(certain).log_()).mul_(1.0 - q)
    return tail.addcmul_(q, old_lp - lp)


def _dppo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    divergence: str,
    clip_low: float,
    clip_high: float,
    ratio_cap: float | None,
    ratio_stats: bool,
) -> tuple[torch.Tensor, Metrics]:
    _check(logp, old_logp, advantages, mask)
    _check_clip("clip_low", clip_low)
    _check_clip("clip_high", clip_high)
    if ratio_cap is not None:
        check_positive("ratio_cap", ratio_cap, finite=True)
    tok = _prepare(logp, old_logp, advantages, mask, with_logp=True)
    nadv = tok.neg_adv  # -A
    lp = _logp(logp, tok)
    with torch.no_grad():
        old_lp = tok.old_lp
        assert old_lp is not None
        new_lp = lp.detach()
        if divergence == "tv":
            step = _probs_in_range(new_lp).sub_(_probs_in_range(old_lp))  # p - p_old
            up_ok, down_ok = step <= clip_high, step >= -clip_low
        else:
            kl = _binary_kl(old_lp, new_lp)
            up_ok = (kl <= clip_high).logical_or_(new_lp <= old_lp)
            down_ok = (kl <= clip_low).logical_or_(new_lp >= old_lp)
        # A > 0 may not push p up too far, A <= 0 not down.
        # As boolean ops: a torch.where over booleans is a branching scalar loop on the CPU.
        pushed_up = nadv < 0
        inside = up_ok.logical_and_(pushed_up).logical_or_(down_ok.logical_and_(pushed_up.logical_not_()))
        inside.logical_and_(tok.keep)
        ratio = tok.log_ratio.detach().exp()
        coef = nadv * ratio if ratio_cap is None else ratio.clamp(max=ratio_cap).mul_(nadv)  # -sg(min(r, C)) A
    loss = masked_zero(coef * lp, inside)
    with torch.no_grad():
        metrics = _ratio_sums(ratio, tok) if ratio_stats else _kl_only(ratio, tok)
        metrics["trust_region_frac"] = _frac(inside.logical_not().logical_and_(tok.keep), tok)
        capped = torch.zeros_like(inside) if ratio_cap is None else inside.logical_and(ratio > ratio_cap)
        metrics["cap_frac"] = _frac(capped, tok)
    return _cast(loss, logp.dtype), metrics


def dppo_tv_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.15,
    clip_high: float = 0.15,
    ratio_cap: float | None = 20.0,
    ratio_stats: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token DPPO-Binary-TV loss: the policy gradient masked by a total-variation trust region.

    Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning"
    (Divergence PPO), arXiv:2602.04879; verl's ``dppo_tv``. Defaults: the TV bound 0.15 of
    verl's DPPO example, and the importance-weight cap ``C = 20`` that verl's DPPO code
    names (the paper's section 5.4 recommends a large cap; verl's actor config overrides
    it with its dual-clip default 3.0 unless ``clip_ratio_c`` is set).

    PPO's ratio clip over-restrains rare tokens (a small change of probability is a large
    ratio) and under-restrains likely ones. DPPO bounds the change of the sampled token's
    probability instead, ``p = exp(logp)``, ``p_old = exp(old_logp)``, and only in the
    direction the advantage pushes::

        inside_t = (p - p_old <= clip_high)   if A_t > 0
                   (p - p_old >= -clip_low)   otherwise
        loss_t   = -sg(min(r_t, C)) * A_t * logp_t * inside_t

    A token outside its trust region has loss and gradient 0; inside, the gradient is the
    truncated importance-weighted policy gradient ``-min(r, C) A d logp``. Like CISPO's,
    the loss value is ``-w A logp``; only its gradient is the estimator. ``ratio_cap=None``
    leaves the weight untruncated.

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`. A
        log-probability above 0 (not one) is read as 0, probability 1.
      clip_low: the bound ``delta_low`` (>= 0) on a decrease of ``p`` where ``A <= 0``.
      clip_high: the bound ``delta_high`` (>= 0) on an increase of ``p`` where ``A > 0``.
      ratio_cap: ``C`` (> 0), the truncation of the importance weight, or ``None``.
      ratio_stats: also report ``ratio_mean``, ``ratio_min`` and ``ratio_max`` (as in
        :func:`ppo_clip_loss`: a hot loop that does not log them can pass False).

    Returns:
      ``(loss_t, metrics)``; ``trust_region_frac`` is the fraction of counted tokens
      outside their trust region, ``cap_frac`` of those inside whose ratio exceeds ``C``;
      ``approx_kl`` and ratio stats.

    >>> lp = torch.log(torch.tensor([[0.9, 0.5]]))
    >>> old = torch.log(torch.tensor([[0.5, 0.45]]))
    >>> loss, m = dppo_tv_loss(lp, old, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
    >>> loss  # p rose by 0.4 > 0.15: outside; by 0.05: inside, weight 0.5 / 0.45
    tensor([[0.0000, 0.7702]])
    >>> m["trust_region_frac"]
    tensor(0.5000)

    In a recipe, in place of PPO's clip:

    >>> from functools import partial
    >>> from rlcore.algos import grpo
    >>> grpo()._replace(policy_loss=partial(dppo_tv_loss, clip_high=0.2)).policy_loss.keywords
    {'clip_high': 0.2}
    """
    return _dppo(
        logp,
        old_logp,
        advantages,
        mask,
        divergence="tv",
        clip_low=clip_low,
        clip_high=clip_high,
        ratio_cap=ratio_cap,
        ratio_stats=ratio_stats,
    )


def dppo_kl_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.05,
    clip_high: float = 0.05,
    ratio_cap: float | None = 20.0,
    ratio_stats: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token DPPO-Binary-KL loss: the policy gradient masked by a binary-KL trust region.

    Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv:2602.04879; verl's ``dppo_kl``. Defaults: the KL bound 0.05 of verl's DPPO
    example and ``C = 20`` (see :func:`dppo_tv_loss`).

    The divergence is the KL between the Bernoulli distributions "the sampled token or
    not" under the old and the current policy, with ``p = exp(logp)``, ``q = exp(old_logp)``::

        D_t      = q log(q / p) + (1 - q) log((1 - q) / (1 - p))
        inside_t = (D_t <= clip_high or p <= q)   if A_t > 0
                   (D_t <= clip_low  or p >= q)   otherwise
        loss_t   = -sg(min(r_t, C)) * A_t * logp_t * inside_t

    so a token may move against its advantage without limit and along it only within the
    divergence bound. ``log(1 - p)`` is computed as ``log(-expm1(logp))``, exact where
    ``p`` is within rounding of 1 (verl adds ``1e-8`` inside both logarithms, which moves
    the bound for likely tokens).

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`. A
        log-probability above 0 (not one) is read as 0, probability 1.
      clip_low: the KL bound (>= 0) where ``A <= 0``.
      clip_high: the KL bound (>= 0) where ``A > 0``.
      ratio_cap: ``C`` (> 0), the truncation of the importance weight, or ``None``.
      ratio_stats: also report the ratio's mean, min and max (see :func:`dppo_tv_loss`).

    Returns:
      ``(loss_t, metrics)`` as :func:`dppo_tv_loss`.

    >>> lp = torch.log(torch.tensor([[0.9, 0.5]]))
    >>> old = torch.log(torch.tensor([[0.5, 0.45]]))
    >>> dppo_kl_loss(lp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))[0]
    tensor([[ 0.0000, -0.7702]])
    """
    return _dppo(
        logp,
        old_logp,
        advantages,
        mask,
        divergence="kl",
        clip_low=clip_low,
        clip_high=clip_high,
        ratio_cap=ratio_cap,
        ratio_stats=ratio_stats,
    )


def dro_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    ratio_stats: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token DRO loss: the policy gradient plus a quadratic penalty on the log-ratio.

    Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large Language
    Models Alignment" (Direct Reward Optimization), arXiv:2405.19107; the same objective,
    with the sampling policy as the anchor, is Kimi k1.5's policy optimisation
    (arXiv:2501.12599); verl's ``dro``. ``beta`` (the paper's ``tau``) has no published default.

    Formula, with ``l_t = logp_t - old_logp_t`` (not clamped: the penalty's restoring
    gradient ``beta * l_t`` is largest exactly where the policy has drifted furthest)::

        loss_t = -A_t * logp_t + beta / 2 * l_t ** 2       (gradient: (-A_t + beta * l_t) d logp_t)

    On-policy the gradient is the policy gradient; as ``logp`` moves, the penalty pulls it
    back towards the sampling policy, a soft trust region in place of a clip.

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`.
      beta: the penalty's coefficient (> 0).
      ratio_stats: also report the ratio's mean, min and max (see :func:`dppo_tv_loss`).

    Returns:
      ``(loss_t, metrics)``: ``approx_kl``, ratio stats, and ``log_ratio_sq``, the mean
      of ``l_t ** 2``.

    >>> lp = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> dro_loss(lp, lp - torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), beta=0.2)[0]
    tensor([[0.6931, 0.7931]])
    """
    _check(logp, old_logp, advantages, mask)
    check_positive("beta", beta, finite=True)
    acc = acc_dtype(logp.dtype)
    keep = mask if mask.dtype == torch.bool else mask != 0
    bits = keep_bits(keep, acc)
    with torch.no_grad():
        weights = mask if mask.dtype == torch.bool else mask.to(acc)
        total = torch.count_nonzero(mask).to(acc) if mask.dtype == torch.bool else mask.sum(dtype=acc)
        neg_adv = masked_zero_(torch.neg(advantages.detach().to(acc)), bits)
    loss, log_ratio = _DroLoss.apply(logp, bits, old_logp.detach().to(acc), neg_adv, beta)
    with torch.no_grad():
        # log_ratio is this function's own buffer (the backward keeps the slope, not it): clamped in place.
        tok = _Tokens(keep, weights, torch.where(total > 0, total, 1.0), log_ratio, neg_adv, total, None, None, bits)
        if tok.weights.dtype == torch.bool:
            flat = log_ratio.flatten()
            squares = (torch.dot(flat, flat) / tok.total).float()
        else:
            squares = _mean(log_ratio.square(), tok)
        log_ratio.clamp_(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio = log_ratio.exp()
        metrics = _ratio_sums(ratio, tok) if ratio_stats else _kl_only(ratio, tok, owned=True)
        metrics["log_ratio_sq"] = squares
    return _cast(loss, logp.dtype), metrics


class _DroLoss(torch.autograd.Function):
    """DRO's per-token loss and the log-ratio, both 0 at padding; the backward is one product.

    The gradient of ``-A lp + beta / 2 l^2`` is ``(-A + beta l) d lp``: the forward keeps that
    slope (0 at padding) and the backward multiplies by it. Autograd of the formula keeps
    ``lp`` and ``l`` and takes five full-size passes backward (the square's two products, the
    advantage's, their sum and the padding ``where``); the loss is a few elementwise ops
    (verl's has six), so those passes were most of its cost.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        logp: torch.Tensor,
        bits: torch.Tensor,
        old_logp: torch.Tensor,
        neg_adv: torch.Tensor,
        beta: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Zeroing (not a multiply) keeps nan padding out of the loss and the slope; the log-ratio
        # is zeroed after the difference, in its own buffer (no zeroed copy of old_logp).
        lp = masked_zero(logp.to(neg_adv.dtype), bits)
        log_ratio = masked_zero_(logp.to(neg_adv.dtype) - old_logp, bits)
        return lp.mul_(neg_adv).addcmul_(log_ratio, log_ratio, value=0.5 * beta), log_ratio

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        logp, _, _, neg_adv, beta = inputs
        ctx.dtype = logp.dtype
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # no [B, T] of zeros for the log-ratio's (unused) gradient
        # The slope -A + beta l, in neg_adv's buffer: dro_loss made it and reads it no more.
        ctx.save_for_backward(neg_adv.add_(output[1], alpha=beta))

    @staticmethod
    def backward(ctx, g: torch.Tensor | None, _: torch.Tensor | None):  # type: ignore[no-untyped-def,override]
        if g is None:  # the loss took no part in what was differentiated
            return None, None, None, None, None
        (slope,) = ctx.saved_tensors
        return saturating_cast(g * slope, ctx.dtype), None, None, None, None


def _covariance(tok: _Tokens, lp: torch.Tensor) -> torch.Tensor:
    """Each counted token's ``(A_t - mean A) (logp_t - mean logp)``, means over the counted tokens (mask weights).

    ``lp`` is 0 where the mask is 0, like ``neg_adv``: with a boolean mask the masked sums are plain sums.
    """
    nadv = tok.neg_adv
    if tok.weights.dtype == torch.bool:
        sum_nadv, sum_lp = nadv.sum(), lp.sum()
    else:
        sum_nadv, sum_lp = (nadv * tok.weights).sum(), (lp * tok.weights).sum()
    # A - mean A = -(nadv - mean nadv), exactly.
    return (nadv - sum_nadv / tok.total).mul_(lp - sum_lp / tok.total).neg_()


def _select_count(fraction: float, tok: _Tokens) -> tuple[torch.Tensor, int | None]:
    """``(count, bound)``: ``count = max(floor(fraction * n), 1)`` for ``n`` the counted weight, as a float64
    device scalar (no host read), and a bound on it known from the shape (``None`` when the mask's
    weights may exceed 1, so that ``n`` is not bounded by the number of tokens)."""
    count = torch.clamp(torch.floor(fraction * tok.counted.double()), min=1.0)
    bound = max(math.floor(fraction * tok.keep.numel()), 1) if tok.weights.dtype == torch.bool else None
    return count, bound


def _first_ranked(
    keys: torch.Tensor,
    eligible: torch.Tensor,
    count: torch.Tensor,
    bound: int | None,
    *,
    owned: bool = False,
    masked: bool = False,
) -> torch.Tensor:
    """The ``count`` eligible positions with the largest ``keys`` (fewer if fewer are eligible), as a bool mask.

    Ties go to the earlier position in row-major order. ``count`` is a device scalar, so no
    count is read back: with a static ``bound >= count`` the ``count``-th largest key is read
    from a ``topk`` of ``bound`` keys (a few hundred of a batch's tokens at the published
    fractions), every key above it is selected and the ties at it are taken in order;
    without one, a stable sort of the whole batch ranks every position. ``owned``: ``keys`` is a
    buffer of the caller's that may be overwritten. ``masked``: ``keys`` (an integer buffer) are
    already 0 at the positions that are not eligible and ``>= 0`` at those that are.
    """
    if masked:
        flat = keys.flatten()
    elif owned:
        flat = _fill_dropped_(keys, eligible, -torch.inf).flatten()
    else:
        flat = torch.where(eligible, keys, -torch.inf).flatten()
    n = flat.numel()
    if n == 0:
        return eligible
    if bound is None or bound >= n:
        order = torch.argsort(flat, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=flat.device))
        return eligible & (rank.view(keys.shape) < count)
    top = _top_values(flat, bound)  # sorted, largest first
    pivot = top.gather(0, (count.long() - 1).clamp(0, bound - 1).view(1))  # the count-th largest key
    above = flat > pivot
    tied = (flat == pivot).logical_and_(eligible.flatten())
    # An int32 bound for the int32 running count: a float64 one sends the comparison through a casting loop.
    need = (count.long() - above.sum()).to(torch.int32)
    return above.logical_or_(tied.logical_and_(torch.cumsum(tied, 0, dtype=torch.int32) <= need)).view(keys.shape)


def _top_values(flat: torch.Tensor, k: int, chunk: int = 16384) -> torch.Tensor:
    """``flat.topk(k).values``, equal value for value (ties and ``-inf`` included), by way of the chunks' top ``k``.

    The ``k`` largest keys of the whole are among the ``k`` largest of each chunk of
    ``chunk`` keys. On the CPU a ``topk`` over one long vector works on a copy of all of
    it: over KL-Cov's 262144 keys inside a training step's forward and backward it took
    2.2 ms a call where the chunked form takes 0.4 ms.
    """
    n = flat.numel()
    rows = n // chunk
    if rows < 2 or k >= chunk:
        return flat.topk(k).values
    head = flat[: rows * chunk].view(rows, chunk).topk(k, dim=1).values.flatten()
    return torch.cat([head, flat[rows * chunk :]]).topk(k).values


def _fill_dropped_(x: torch.Tensor, keep: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` (float32 or float64) set to ``value`` where ``keep`` is False, in place, as bitwise ops.

    ``masked_fill_`` and ``torch.where`` are scalar loops on the CPU (3-14x a vectorised pass).
    """
    bits = keep_bits(keep, x.dtype)
    fill = torch.tensor(value, dtype=x.dtype, device=x.device).view(bits.dtype)
    # (x & b) | (fill & ~b) = ((x ^ fill) & b) ^ fill.
    x.view(bits.dtype).bitwise_xor_(fill).bitwise_and_(bits).bitwise_xor_(fill)
    return x


def _random_keys(eligible: torch.Tensor) -> torch.Tensor:
    """Uniform 31-bit integer keys at the eligible positions, 0 elsewhere: the ranks of Clip-Cov's draw.

    Each int64 draw of the generator gives two keys (its halves), half the generator calls of
    ``torch.rand``, and the keys are masked by a bitwise ``and`` instead of a ``masked_fill``.
    """
    n = eligible.numel()
    # [0, 2**63 - 1): 31 uniform bits in each int32 half once the sign bit is cleared.
    raw = torch.randint(0, 2**63 - 1, ((n + 1) // 2,), dtype=torch.int64, device=eligible.device)
    keys = raw.view(torch.int32)[:n].view(eligible.shape)
    # keep_bits for float32 is the int32 pattern (-1 where eligible); without the sign bit it keeps 31 bits.
    return keys.bitwise_and_(keep_bits(eligible, torch.float32).bitwise_and_(0x7FFFFFFF))


def clip_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 1.0,
    cov_fraction: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    noise: torch.Tensor | None = None,
    ratio_stats: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token Clip-Cov loss: PPO-clip with the gradient of a few high-covariance tokens removed.

    Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv:2505.22617, section 4 (verl's ``clip_cov``). Policy entropy
    falls in proportion to the covariance of a token's log-probability and its advantage;
    cutting the update of the tokens with the largest covariance keeps entropy from
    collapsing. Defaults are the authors' runs: ``r = 2e-4``, the band ``[1, 5]``, and
    PPO's clip range widened to 1 (the ratio clipped to ``[0, 2]``), so the covariance
    cut, not the clip, is the trust region; verl's ``clip_cov`` takes the actor's clip
    range instead (0.2 unless set).

    Formula, over the counted tokens of the batch (means weighted by the mask)::

        cov_t     = (A_t - mean A) * (sg(logp_t) - mean sg(logp))
        eligible  = cov_low < cov_t < cov_high, and the token is not clipped by PPO
        selected  = max(floor(cov_fraction * N), 1) eligible tokens drawn uniformly
        loss_t    = 0 if selected, else the PPO-clip loss (:func:`ppo_clip_loss`)

    The draw ranks the eligible tokens by ``noise`` (uniform ``[B, T]``; when ``None``,
    uniform 31-bit integer keys from torch's generator) and keeps the first ``max(floor(r N), 1)``, on the
    device: no count is read back (verl reads the token count and the selection to the
    host). The covariance is a statistic of the batch the loss sees, so a micro-batch
    selects from its own tokens, as in verl; for a selection over the whole batch, call
    the loss on the whole batch.

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`.
      clip_low, clip_high: PPO's clip ranges (>= 0; 1 in the authors' runs).
      cov_fraction: ``r``, the fraction of counted tokens whose gradient is cut, in ``(0, 1]``.
      cov_low, cov_high: the covariance band of the tokens eligible for the cut.
      noise: ``[B, T]`` uniform draws ranking the eligible tokens, or ``None``.
      ratio_stats: also report the ratio's mean, min and max (see :func:`dppo_tv_loss`).

    Returns:
      ``(loss_t, metrics)``: PPO's ``clip_frac_low`` / ``clip_frac_high``, ``cov_frac``
      (the fraction of counted tokens cut), ``approx_kl`` and ratio stats.

    >>> lp = torch.log(torch.tensor([[0.9, 0.1, 0.5, 0.5]]))
    >>> adv = torch.tensor([[4.0, -4.0, 0.0, 0.0]])
    >>> clip_cov_loss(lp, lp, adv, torch.ones(1, 4), cov_fraction=0.25, noise=torch.rand(1, 4))[0]
    tensor([[0., 4., -0., -0.]])

    Entropy control for GRPO (the paper's setting) is a change of its policy loss:

    >>> from rlcore.algos import grpo
    >>> grpo(kl_coef=0.0)._replace(policy_loss=clip_cov_loss).policy_loss.__name__
    'clip_cov_loss'
    """
    _check(logp, old_logp, advantages, mask)
    _check_clip("clip_low", clip_low)
    _check_clip("clip_high", clip_high)
    if not 0.0 < cov_fraction <= 1.0:
        raise ValueError(f"cov_fraction: got {cov_fraction!r}, expected a number in (0, 1]")
    if not cov_low < cov_high:
        raise ValueError(f"cov_high: got {cov_high!r} with cov_low={cov_low!r}, expected cov_low < cov_high")
    if noise is not None:
        check_same_shape("noise", noise, "logp", logp)
    tok = _prepare(logp, old_logp, advantages, mask)
    nadv = tok.neg_adv
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    with torch.no_grad():
        r = tok.log_ratio.detach().exp()
        clip_low_t, clip_high_t = (nadv > 0).logical_and_(r < lo), (nadv < 0).logical_and_(r > hi)
        cov = _covariance(tok, _logp(logp, tok).detach())
        clipped = clip_low_t.logical_or(clip_high_t)
        eligible = (cov > cov_low).logical_and_(cov < cov_high).logical_and_(tok.keep)
        eligible.logical_and_(clipped.logical_not())
        if noise is None:
            cut = _first_ranked(_random_keys(eligible), eligible, *_select_count(cov_fraction, tok), masked=True)
        else:
            cut = _first_ranked(noise.detach().to(cov.dtype), eligible, *_select_count(cov_fraction, tok))
    loss, _ = _ClipCutLoss.apply(tok.log_ratio, r, nadv, lo, hi, cut, clipped)
    with torch.no_grad():
        metrics = _ratio_sums(r, tok) if ratio_stats else _kl_only(r, tok)
        metrics["clip_frac_low"] = _frac(clip_low_t, tok)
        metrics["clip_frac_high"] = _frac(clip_high_t, tok)
        metrics["cov_frac"] = _frac(cut, tok)
    return _cast(loss, logp.dtype), metrics


class _ClipCutLoss(torch.autograd.Function):
    """Clip-Cov's per-token loss from the log-ratio: PPO's clipped surrogate, 0 at the cut tokens.

    The value is ``max(-A r, -A clip(r, lo, hi))`` (PPO's one-sided clip: the ``max`` of
    the two surrogates is it for either sign of ``A``), 0 where ``cut``; the gradient in the
    log-ratio is ``-A r`` where the token is neither clipped nor cut, else 0 (the clip's
    gradient passes at its bounds, as ``torch.clamp``'s does). The forward keeps that slope
    and the backward is one product: autograd of the same formula takes the bounds' two
    ``torch.where``s, a tensor clamp and the cut's ``where`` forward and backward, scalar
    loops on the CPU.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        log_ratio: torch.Tensor,
        ratio: torch.Tensor,
        nadv: torch.Tensor,
        lo: float,
        hi: float,
        cut: torch.Tensor,
        clipped: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        surrogate = nadv * ratio
        loss = torch.maximum(surrogate, ratio.clamp(lo, hi).mul_(nadv))
        masked_zero_(loss, keep_bits(cut.logical_not(), loss.dtype))
        # The slope: the surrogate's buffer, zeroed where the token is clipped or cut.
        return loss, masked_zero_(surrogate, keep_bits(clipped.logical_or(cut).logical_not_(), loss.dtype))

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx, g: torch.Tensor | None, _: torch.Tensor | None):  # type: ignore[no-untyped-def,override]
        if g is None:
            return (None,) * 7
        (slope,) = ctx.saved_tensors
        return (g * slope, *(None,) * 6)


def kl_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cov_fraction: float = 2e-4,
    kl_coef: float = 1.0,
    ratio_stats: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token KL-Cov loss: the unclipped surrogate, with a KL penalty on the highest-covariance tokens.

    Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv:2505.22617, section 4 (verl's ``kl_cov``). Defaults: the
    authors' 32B runs, ``k = 2e-4`` (their 7B runs use ``2e-3``) and ``beta = 1`` (verl's
    shipped config sets 0.1).

    Formula, over the counted tokens of the batch (means weighted by the mask), with the
    KL of the paper estimated as ``|log r_t|`` (as in its code)::

        cov_t    = (A_t - mean A) * (sg(logp_t) - mean sg(logp))
        selected = the max(floor(cov_fraction * N), 1) tokens of largest cov_t
        loss_t   = -A_t * r_t + kl_coef * |log r_t| * selected

    There is no ratio clip: the penalty on the few tokens that drive entropy down is the
    only trust region. The top tokens are found by a stable sort on the device (ties go to
    the earlier token; verl reads the tokens to the host for ``torch.topk``). As for
    :func:`clip_cov_loss`, the selection is over the batch the loss sees.

    Args:
      logp, old_logp, advantages, mask: ``[B, T]`` as in :func:`ppo_clip_loss`.
      cov_fraction: ``k``, the fraction of counted tokens penalised, in ``(0, 1]``.
      kl_coef: ``beta`` (>= 0), the penalty's coefficient.
      ratio_stats: also report the ratio's mean, min and max (see :func:`dppo_tv_loss`).

    Returns:
      ``(loss_t, metrics)``: ``cov_frac`` (the fraction penalised), ``abs_log_ratio`` (the
      mean ``|log r|``), ``approx_kl`` and ratio stats.

    >>> lp = torch.log(torch.tensor([[0.9, 0.1, 0.5, 0.5]]))
    >>> adv = torch.tensor([[4.0, -4.0, 0.0, 0.0]])
    >>> kl_cov_loss(lp, lp - 0.1, adv, torch.ones(1, 4), cov_fraction=0.25)[0]
    tensor([[-4.4207,  4.5207,  0.0000,  0.0000]])
    """
    _check(logp, old_logp, advantages, mask)
    if not 0.0 < cov_fraction <= 1.0:
        raise ValueError(f"cov_fraction: got {cov_fraction!r}, expected a number in (0, 1]")
    check_positive("kl_coef", kl_coef, strict=False, finite=True)
    tok = _prepare(logp, old_logp, advantages, mask)
    ratio = tok.log_ratio.exp()
    with torch.no_grad():
        cov = _covariance(tok, _logp(logp, tok).detach())
        selected = _first_ranked(cov, tok.keep, *_select_count(cov_fraction, tok), owned=True)
        coef = selected.to(ratio.dtype).mul_(kl_coef)  # a torch.where would be a scalar loop on the CPU
    abs_log_ratio = tok.log_ratio.abs()
    loss = torch.addcmul(tok.neg_adv * ratio, coef, abs_log_ratio)
    with torch.no_grad():
        r = ratio.detach()
        metrics = _ratio_sums(r, tok) if ratio_stats else _kl_only(r, tok)
        metrics["cov_frac"] = _frac(selected, tok)
        metrics["abs_log_ratio"] = _padded_mean(abs_log_ratio.detach(), tok)
    return _cast(loss, logp.dtype), metrics
