"""DPO and its pairwise family: one loss per preference pair, against a reference policy.

Every loss here is a function of the per-sequence log-ratios against the reference,
``l_w = log pi(y_w|x) - log pi_ref(y_w|x)`` (chosen) and ``l_l`` (rejected), written
in overflow-free forms (``softplus`` / ``logsigmoid``, never ``log(sigmoid)``), so
``|margin|`` up to 1e4 gives finite losses and gradients in float32 and bfloat16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlcore._checks import check_choice, check_positive
from rlcore.algos.preference import (
    capped_exp,
    check_label_smoothing,
    check_sequences,
    pair_metrics,
    smoothed_logistic,
)
from rlcore.ops import acc_dtype

__all__ = ["DIVERGENCES", "DPO_LOSS_TYPES", "dpo_loss"]

DPO_LOSS_TYPES = (
    "sigmoid",
    "robust",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_pair",
    "apo_zero",
    "apo_down",
    "discopop",
)
DIVERGENCES = ("reverse_kl", "forward_kl", "js", "alpha")


def _scores(logratio: torch.Tensor, divergence: str, alpha: float) -> torch.Tensor:
    """f-DPO implicit reward per unit beta: ``f'(u) - f'(1)`` with ``u = exp(logratio)``.

    Subtracting ``f'(1)`` makes every score 0 when the policy equals the reference, so
    the losses that use one score at a time (NCA, BCO, SPPO, APO) keep their anchor at
    the reference whatever the divergence; pairwise differences are unchanged.
    """
    if divergence == "reverse_kl":  # f(u) = u log u,  f'(u) = log u + 1
        return logratio
    if divergence == "forward_kl":  # f(u) = -log u,  f'(u) = -1/u
        return 1.0 - capped_exp(-logratio)
    if divergence == "js":  # f'(u) = log(2u / (1 + u))
        return math.log(2.0) + F.logsigmoid(logratio)
    # alpha-divergence, f'(u) = (1 - u^-alpha) / alpha
    return (1.0 - capped_exp(-alpha * logratio)) / alpha


def _pair_loss(
    loss_type: str,
    sc: torch.Tensor,
    sr: torch.Tensor,
    policy_logratio: torch.Tensor,
    ref_logratio: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float,
    discopop_tau: float,
    bco_delta: float | torch.Tensor | None,
) -> torch.Tensor:
    h = sc - sr
    x = beta * h
    eps = label_smoothing
    if loss_type == "sigmoid":
        return smoothed_logistic(x, eps)
    if loss_type == "robust":
        return ((1.0 - eps) * F.softplus(-x) - eps * F.softplus(x)) / (1.0 - 2.0 * eps)
    if loss_type == "hinge":
        return torch.relu(1.0 - x)
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "exo_pair":
        return torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-eps)) + torch.sigmoid(-x) * (
            F.logsigmoid(-x) - math.log(eps)
        )
    cr, rr = beta * sc, beta * sr
    if loss_type == "nca_pair":
        return F.softplus(-cr) + 0.5 * F.softplus(cr) + 0.5 * F.softplus(rr)
    if loss_type == "bco_pair":
        delta = torch.cat([cr, rr]).mean().detach() if bco_delta is None else torch.as_tensor(bco_delta).reshape(())
        return F.softplus(-(cr - delta)) + F.softplus(rr - delta)
    if loss_type == "sppo_hard":
        return (sc - 0.5 / beta) ** 2 + (sr + 0.5 / beta) ** 2
    if loss_type == "aot":
        delta = torch.sort(policy_logratio).values - torch.sort(ref_logratio).values
        return smoothed_logistic(beta * delta, eps)
    if loss_type == "aot_pair":
        return smoothed_logistic(beta * (torch.sort(sc).values - torch.sort(sr).values), eps)
    if loss_type == "apo_zero":
        return torch.sigmoid(-cr) + torch.sigmoid(rr)
    if loss_type == "apo_down":
        return torch.sigmoid(cr) + torch.sigmoid(-x)
    # discopop: sigmoid(x / tau) * exp(-x) taken as one exponent, so that the
    # 0 * inf of TRL's product (x << 0: the weight underflows, exp(-x) overflows) cannot occur.
    modulation = torch.sigmoid(x / discopop_tau)
    return (1.0 - modulation) * F.softplus(-x) + capped_exp(F.logsigmoid(x / discopop_tau) - x)


def dpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    divergence: str = "reverse_kl",
    alpha: float = 0.5,
    discopop_tau: float = 0.05,
    bco_delta: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair DPO-family preference loss from sequence log-probs of policy and reference.

    DPO: Rafailov et al., 2023, "Direct Preference Optimization", arXiv:2305.18290.
    With log-ratios ``l_w = pi_chosen - ref_chosen``, ``l_l = pi_rejected - ref_rejected``,
    scores ``s = f'(e^l) - f'(1)`` of the chosen f-divergence (f-DPO, Wang et al., 2023,
    arXiv:2309.16240: ``reverse_kl`` s = l, ``forward_kl`` s = 1 - e^-l, ``js``
    s = log 2 + log sigmoid(l), ``alpha`` s = (1 - e^(-alpha l)) / alpha), margin
    ``h = s_w - s_l``, ``x = beta h`` and ``eps = label_smoothing``::

        sigmoid    -(1-eps) log s(x) - eps log s(-x)      DPO; eps > 0 is cDPO (Mitchell, 2023)
        robust     (-(1-eps) log s(x) + eps log s(-x)) / (1 - 2 eps)   rDPO, arXiv:2403.00409
        hinge      max(0, 1 - x)                          SLiC / RSO, arXiv:2305.10425, 2309.06657
        ipo        (h - 1/(2 beta))^2                     IPO, arXiv:2310.12036
        exo_pair   KL(q || p), q = (s(x), s(-x)), p = (1-eps, eps)   EXO, arXiv:2402.00856
        nca_pair   -log s(beta s_w) - 1/2 log s(-beta s_w) - 1/2 log s(-beta s_l)   NCA, arXiv:2402.05369
        bco_pair   -log s(beta s_w - d) - log s(-(beta s_l - d))   BCO, arXiv:2404.04656
        sppo_hard  (s_w - 1/(2 beta))^2 + (s_l + 1/(2 beta))^2      SPPO, arXiv:2405.00675
        aot        smoothed sigmoid loss of beta (sort(pi_w - pi_l) - sort(ref_w - ref_l))   AOT, arXiv:2406.05882
        aot_pair   smoothed sigmoid loss of beta (sort(s_w) - sort(s_l))
        apo_zero   1 - s(beta s_w) + s(beta s_l)          APO, arXiv:2408.06266
        apo_down   s(beta s_w) + 1 - s(x)                 APO, arXiv:2408.06266
        discopop   (1 - m) (-log s(x)) + m e^-x, m = s(x / tau)   DiscoPOP, arXiv:2406.08414

    where ``s`` is the logistic sigmoid. AOT sorts over the batch (TRL's names: ``aot``
    is for paired data, ``aot_pair`` for unpaired). BCO's shift ``d`` is ``bco_delta``,
    by default the detached batch mean of the implicit rewards (TRL keeps a running
    mean across steps; pass it here to do the same). IPO is usually run on
    length-normalised log-probs (``sequence_logps(..., reduce="mean")``), as TRL does.
    DiscoPOP is non-convex: its gradient points toward a *smaller* margin for x in
    about (-0.11, 0.07) at tau = 0.05 (at x = 0 the slope is (1 - log 2)/(4 tau) - 3/4).

    Where TRL differs: its DiscoPOP multiplies ``sigmoid(x/tau)`` by ``exp(-x)``, which
    is ``0 * inf = nan`` in float32 once ``x < -88.7``; its alpha-divergence clamps the
    exponent at ``log(finfo.max)``, so the score still overflows to ``inf`` after
    ``/ alpha`` and its gradient is zero past the clamp. Here DiscoPOP's product is one
    exponent, and the exponentials continue linearly past ``e^20`` (finite, slope kept).

    Args:
      pi_chosen: ``[B]`` sequence log-probs of the chosen responses under the policy.
      pi_rejected: ``[B]`` the same for the rejected responses.
      ref_chosen: ``[B]`` chosen log-probs under the reference policy.
      ref_rejected: ``[B]`` rejected log-probs under the reference policy.
      beta: KL-regularisation strength (IPO's tau). Default 0.1.
      loss_type: one of ``DPO_LOSS_TYPES`` above.
      label_smoothing: probability ``eps`` in [0, 0.5) that a label is flipped; used by
        ``sigmoid``, ``robust``, ``exo_pair`` (which needs ``eps > 0``; the EXO paper
        uses 1e-3), ``aot`` and ``aot_pair``.
      divergence: ``"reverse_kl"`` (standard DPO), ``"forward_kl"``, ``"js"`` or
        ``"alpha"``; ``aot`` needs ``"reverse_kl"``.
      alpha: the alpha of the alpha-divergence (-> 0: reverse KL; 1: forward KL).
      discopop_tau: DiscoPOP's temperature tau. Default 0.05 (the paper's).
      bco_delta: BCO's reward shift, a float or 0-d tensor; ``None`` = batch mean.

    Returns:
      ``(loss, metrics)``: ``loss`` ``[B]`` in the input dtype; ``metrics`` holds detached
      ``[B]`` tensors ``chosen_rewards`` (``beta s_w``), ``rejected_rewards``
      (``beta s_l``), ``margins`` (their difference) and ``accuracies`` (1 where
      ``margins > 0``).

    >>> pi_w, pi_l = torch.tensor([-10.0, -12.0]), torch.tensor([-20.0, -8.0])
    >>> ref_w, ref_l = torch.tensor([-15.0, -12.0]), torch.tensor([-15.0, -12.0])
    >>> loss, metrics = dpo_loss(pi_w, pi_l, ref_w, ref_l, beta=0.1)
    >>> loss
    tensor([0.3133, 0.9130])
    >>> metrics["margins"]
    tensor([ 1.0000, -0.4000])
    >>> dpo_loss(ref_w, ref_l, ref_w, ref_l)[0]  # policy == reference: log 2
    tensor([0.6931, 0.6931])
    """
    check_sequences(pi_chosen=pi_chosen, pi_rejected=pi_rejected, ref_chosen=ref_chosen, ref_rejected=ref_rejected)
    check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    check_choice("divergence", divergence, DIVERGENCES)
    check_positive("beta", beta, finite=True)
    check_positive("alpha", alpha, finite=True)
    check_positive("discopop_tau", discopop_tau, finite=True)
    check_label_smoothing(label_smoothing)
    if isinstance(bco_delta, torch.Tensor):
        if bco_delta.numel() != 1:  # never a silent broadcast over the pairs
            raise ValueError(f"bco_delta: got a tensor of shape {tuple(bco_delta.shape)}, expected a scalar")
    elif bco_delta is not None and (
        isinstance(bco_delta, bool) or not isinstance(bco_delta, (int, float)) or not math.isfinite(bco_delta)
    ):
        raise ValueError(f"bco_delta: got {bco_delta!r}, expected None, a finite number or a 0-d tensor")
    if loss_type == "exo_pair" and label_smoothing == 0.0:
        raise ValueError(
            "label_smoothing: got 0.0, expected a number in (0, 0.5) for loss_type='exo_pair' "
            "(EXO's target puts 1 - eps on the chosen response; the paper uses 1e-3)"
        )
    if loss_type == "aot" and divergence != "reverse_kl":
        raise ValueError(
            f"divergence: got {divergence!r}, expected 'reverse_kl' for loss_type='aot' "
            "(it sorts policy and reference log-ratios separately, not scores)"
        )
    dtype = pi_chosen.dtype
    acc = acc_dtype(dtype)
    pw, pl = pi_chosen.to(acc), pi_rejected.to(acc)
    rw, rl = ref_chosen.to(acc), ref_rejected.to(acc)
    sc = _scores(pw - rw, divergence, alpha)
    sr = _scores(pl - rl, divergence, alpha)
    loss = _pair_loss(
        loss_type,
        sc,
        sr,
        pw - pl,
        rw - rl,
        beta=beta,
        label_smoothing=label_smoothing,
        discopop_tau=discopop_tau,
        bco_delta=bco_delta,
    )
    return loss.to(dtype), pair_metrics(beta * sc, beta * sr, dtype)
