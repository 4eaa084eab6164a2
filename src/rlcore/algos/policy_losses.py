"""Per-token policy-gradient losses: PPO-clip (DAPO clip-higher, dual-clip), GSPO, CISPO, SAPO, GMPO, GPG, REINFORCE.

Every loss takes ``(logp, old_logp, advantages, mask)``, all ``[B, T]``, and returns
``(loss_t, metrics)``: the per-token loss ``[B, T]`` in the dtype of ``logp`` (0 where
``mask`` is 0) and a dict of detached float32 scalars. Reduction to one number is
:func:`rlcore.algos.aggregate`'s job, so the same loss serves every normalisation.

Numerics: the log-ratio is formed in float32 (float64 for float64 inputs) and clamped
to ``[-20, 20]`` before ``exp``, so a stale or corrupted token cannot overflow the
ratio to ``inf``; beyond the clamp its gradient is 0. Inputs at mask-0 positions never
reach the loss or its gradient, even when they are ``nan`` (padding).

Metrics (all masked means over the counted tokens unless named otherwise):
``approx_kl`` is Schulman's k3 estimate ``r - 1 - log r`` of KL(old || new) (non-negative,
lower variance than the ``-log r`` that verl reports), ``ratio_mean``, ``ratio_min``,
``ratio_max`` (0 for an empty mask), and the clip fractions of each loss.
"""

from __future__ import annotations

import torch

from rlcore._checks import check_floating, check_ndim, check_positive, check_same_shape
from rlcore.ops import masked_mean
from rlcore.ops._accum import acc_dtype

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


def _check_clip(name: str, value: float) -> None:
    check_positive(name, value, strict=False)


def _prepare(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keep, logp, log_ratio, advantages)`` in the accumulation dtype, zeroed where ``mask`` is 0.

    ``torch.where`` (not a multiply) keeps ``nan`` padding out of values and gradients.
    """
    acc = acc_dtype(logp.dtype)
    keep = mask != 0
    lp = torch.where(keep, logp.to(acc), 0.0)
    log_ratio = (lp - torch.where(keep, old_logp.to(acc), 0.0)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    adv = torch.where(keep, advantages.to(acc), 0.0)
    return keep, lp, log_ratio, adv


def _frac(cond: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(cond.float(), mask)


def _ratio_metrics(log_ratio: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor) -> Metrics:
    lr = log_ratio.detach().float()
    ratio = lr.exp()
    any_kept = keep.any()
    big = torch.finfo(ratio.dtype).max
    rmin = torch.where(keep, ratio, big).amin()
    rmax = torch.where(keep, ratio, 0.0).amax()
    return {
        "approx_kl": masked_mean(ratio - 1.0 - lr, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_min": torch.where(any_kept, rmin, 0.0),
        "ratio_max": rmax,
    }


def _out(loss: torch.Tensor, keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, loss, 0.0).to(like.dtype)


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
) -> tuple[torch.Tensor, Metrics]:
    """Per-token PPO clipped surrogate loss, with DAPO's clip-higher and dual-clip PPO.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347;
    asymmetric bounds ("clip-higher", ``clip_high=0.28``) from DAPO, arXiv:2503.14476;
    dual clip from Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL",
    arXiv:1912.09729.

    Formula, with ``r = exp(clamp(logp - old_logp, -20, 20))`` and ``A = advantages``::

        loss = w * max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        if dual_clip is c and A < 0:  loss = w * min(loss, -A * c)

    ``w`` is ``is_weights`` (detached; 1 when ``None``). A token whose ratio is clipped
    (``A > 0, r > 1 + clip_high``; ``A < 0, r < 1 - clip_low``; or dual-clipped) has zero
    gradient. When ``logp == old_logp`` the loss is ``-A`` and its gradient ``-A * d logp``,
    the policy gradient.

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

    Returns:
      ``(loss_t, metrics)``: ``loss_t`` ``[B, T]`` in ``logp.dtype``; metrics
      ``clip_frac_low``, ``clip_frac_high`` (and ``clip_frac_dual`` with ``dual_clip``),
      ``approx_kl``, ``ratio_mean``, ``ratio_min``, ``ratio_max``.

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
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip: got {dual_clip!r}, expected None or a number > 1")
    keep, _, log_ratio, adv = _prepare(logp, old_logp, advantages, mask)
    ratio = log_ratio.exp()
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
    with torch.no_grad():
        metrics = {
            "clip_frac_low": _frac((adv < 0) & (ratio < lo), mask),
            "clip_frac_high": _frac((adv > 0) & (ratio > hi), mask),
        }
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
        with torch.no_grad():
            metrics["clip_frac_dual"] = _frac((adv < 0) & (ratio > dual_clip), mask)
    if is_weights is not None:
        check_same_shape("is_weights", is_weights, "logp", logp)
        loss = loss * torch.where(keep, is_weights.detach().to(loss.dtype), 0.0)
    metrics.update(_ratio_metrics(log_ratio, keep, mask))
    return _out(loss, keep, logp), metrics


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
    keep, lp, log_ratio, adv = _prepare(logp, old_logp, advantages, mask)
    log_s = masked_mean(log_ratio, mask, dim=-1, keepdim=True).detach()
    # Adding the detached sequence term last keeps logp - sg(logp) an exact 0 in value.
    log_st = (lp - lp.detach() + log_s).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_st.exp()
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
    with torch.no_grad():
        metrics = {
            "clip_frac_low": _frac((adv < 0) & (ratio < lo), mask),
            "clip_frac_high": _frac((adv > 0) & (ratio > hi), mask),
        }
    metrics.update(_ratio_metrics(log_st, keep, mask))
    return _out(loss, keep, logp), metrics


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
    keep, lp, log_ratio, adv = _prepare(logp, old_logp, advantages, mask)
    ratio = log_ratio.detach().exp()
    lo = None if clip_low is None else 1.0 - clip_low
    hi = 1.0 + clip_high
    weight = ratio.clamp(lo, hi)
    loss = -weight * adv * lp
    with torch.no_grad():
        low = ratio < lo if lo is not None else torch.zeros_like(keep)
        metrics = {"clip_frac_low": _frac(low, mask), "clip_frac_high": _frac(ratio > hi, mask)}
    metrics.update(_ratio_metrics(log_ratio, keep, mask))
    return _out(loss, keep, logp), metrics


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
    keep, lp, log_ratio, adv = _prepare(logp, old_logp, advantages, mask)
    return _out(-adv * lp, keep, logp), _ratio_metrics(log_ratio, keep, mask)


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
    check_positive("tau_pos", tau_pos)
    check_positive("tau_neg", tau_neg)
    keep, _, log_ratio, adv = _prepare(logp, old_logp, advantages, mask)
    ratio = log_ratio.exp()
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -gate * (4.0 / tau) * adv
    metrics = _ratio_metrics(log_ratio, keep, mask)
    with torch.no_grad():
        metrics["gate_mean"] = masked_mean((4.0 * gate * (1.0 - gate)).float(), mask)
    return _out(loss, keep, logp), metrics


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
    keep, _, log_ratio, adv = _prepare(logp, old_logp, advantages, mask)
    sign = torch.sign(adv)
    clipped = log_ratio.clamp(-clip_low, clip_high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clipped)
    rho = masked_mean(chosen, mask, dim=-1, keepdim=True).exp()
    seq_adv = masked_mean(adv, mask, dim=-1, keepdim=True)
    loss = (-seq_adv * rho).expand_as(adv)
    with torch.no_grad():
        metrics = {
            "clip_frac_low": _frac((adv < 0) & (log_ratio < -clip_low), mask),
            "clip_frac_high": _frac((adv > 0) & (log_ratio > clip_high), mask),
        }
    metrics.update(_ratio_metrics(log_ratio, keep, mask))
    return _out(loss, keep, logp), metrics
