"""Reference-free preference losses: SimPO, CPO and ORPO.

No reference policy: the implicit reward is the policy's own (scaled) log-probability.
CPO and ORPO add a supervised term on the chosen response, passed in as ``chosen_nll``
so that its normalisation (per token, per sequence, global token count) stays the
caller's choice.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlcore._checks import check_positive, value_bounds
from rlcore.algos.preference import check_label_smoothing, check_sequences, pair_metrics, smoothed_logistic
from rlcore.ops import acc_dtype

__all__ = ["cpo_loss", "orpo_loss", "simpo_loss"]


def simpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO: length-normalised, reference-free DPO with a target reward margin.

    Meng, Xia & Chen, 2024, "SimPO: Simple Preference Optimization with a
    Reference-Free Reward", arXiv:2405.14734::

        x = beta * (pi_chosen - pi_rejected) - gamma
        loss = -(1 - eps) log sigmoid(x) - eps log sigmoid(-x)

    with ``pi_*`` the *average* per-token log-probs (``sequence_logps(..., reduce="mean")``)
    and ``eps = label_smoothing`` (0 in the paper). Defaults beta = 2, gamma = 0.5 are
    the paper's (gamma / beta = 0.25).

    Args:
      pi_chosen: ``[B]`` length-normalised log-probs of the chosen responses.
      pi_rejected: ``[B]`` the same for the rejected responses.
      beta: reward scale.
      gamma: target reward margin.
      label_smoothing: flip probability in [0, 0.5), as in cDPO.

    Returns:
      ``(loss [B], metrics)``; detached ``[B]`` metrics ``chosen_rewards``
      (``beta pi_chosen``), ``rejected_rewards``, ``margins``, ``accuracies``.

    >>> loss, m = simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]))
    >>> loss  # x = 2 * 0.5 - 0.5 = 0.5
    tensor([0.4741])
    """
    check_sequences(pi_chosen=pi_chosen, pi_rejected=pi_rejected)
    check_positive("beta", beta, finite=True)
    check_positive("gamma", gamma, strict=False, finite=True)
    check_label_smoothing(label_smoothing)
    dtype = pi_chosen.dtype
    acc = acc_dtype(dtype)
    cw, cl = beta * pi_chosen.to(acc), beta * pi_rejected.to(acc)
    loss = smoothed_logistic(cw - cl - gamma, label_smoothing)
    return loss.to(dtype), pair_metrics(cw, cl, dtype)


def cpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    beta: float = 0.1,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CPO: reference-free DPO plus a behaviour-cloning NLL term on the chosen response.

    Xu et al., 2024, "Contrastive Preference Optimization: Pushing the Boundaries of
    LLM Performance in Machine Translation", arXiv:2401.08417::

        loss = -(1 - eps) log sigmoid(x) - eps log sigmoid(-x) + alpha * chosen_nll,
        x = beta * (pi_chosen - pi_rejected)

    The paper's ``L_prefer + L_NLL`` is ``alpha = 1`` (TRL's ``cpo_alpha``), ``eps = 0``.

    Args:
      pi_chosen: ``[B]`` sequence log-probs of the chosen responses (summed, as in the paper).
      pi_rejected: ``[B]`` the same for the rejected responses.
      chosen_nll: ``[B]`` negative log-likelihood of each chosen response, e.g.
        ``-sequence_logps(logp, mask, reduce="mean")`` (TRL's per-token cross-entropy).
      beta: reward scale. Default 0.1.
      alpha: weight of the NLL term.
      label_smoothing: flip probability in [0, 0.5).

    Returns:
      ``(loss [B], metrics)``; detached ``[B]`` metrics ``chosen_rewards``
      (``beta pi_chosen``), ``rejected_rewards``, ``margins``, ``accuracies``, ``nll``.

    >>> loss, m = cpo_loss(torch.tensor([-10.0]), torch.tensor([-20.0]), torch.tensor([1.0]))
    >>> loss  # -log sigmoid(1) + 1
    tensor([1.3133])
    """
    check_sequences(pi_chosen=pi_chosen, pi_rejected=pi_rejected, chosen_nll=chosen_nll)
    check_positive("beta", beta, finite=True)
    check_positive("alpha", alpha, strict=False, finite=True)
    check_label_smoothing(label_smoothing)
    dtype = pi_chosen.dtype
    acc = acc_dtype(dtype)
    cw, cl = beta * pi_chosen.to(acc), beta * pi_rejected.to(acc)
    nll = chosen_nll.to(acc)
    loss = smoothed_logistic(cw - cl, label_smoothing) + alpha * nll
    metrics = pair_metrics(cw, cl, dtype)
    metrics["nll"] = nll.detach().to(dtype)
    return loss.to(dtype), metrics


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0`` without cancellation (Maechler, 2012, "Accurately
    Computing log(1 - exp(-|a|))"): ``log(-expm1(x))`` near 0, ``log1p(-exp(x))`` below -log 2.

    Each branch gets a harmless stand-in where it is not selected, so neither can send a
    ``nan`` gradient through ``torch.where``.
    """
    near = x > -math.log(2.0)
    stand_in = torch.full_like(x, -1.0)
    return torch.where(
        near,
        torch.log(-torch.expm1(torch.where(near, x, stand_in))),
        torch.log1p(-torch.exp(torch.where(near, stand_in, x))),
    )


def _check_log_probs(name: str, x: torch.Tensor) -> None:
    """Mean log-probs are ``<= 0`` (rounding up to the dtype's epsilon allowed): read on CPU tensors in eager mode."""
    bounds = value_bounds(x)
    if bounds is not None and bounds[1] > torch.finfo(x.dtype).eps:
        raise ValueError(
            f"{name}: got log-probs up to {bounds[1]!r}, expected average log-probabilities <= 0 "
            "(a probability is at most 1; pass log pi, not a score or -log pi)"
        )


def orpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    lam: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO: NLL on the chosen response plus a log odds-ratio preference penalty.

    Hong, Lee & Thorne, 2024, "ORPO: Monolithic Preference Optimization without
    Reference Model", arXiv:2403.07691::

        log odds(y) = p - log(1 - e^p),   p = (1/|y|) sum_t log pi(y_t | x, y_<t)
        loss = chosen_nll - lam * log sigmoid(log odds(y_w) - log odds(y_l))

    ``log(1 - e^p)`` is computed as a stable log1mexp. TRL writes
    ``log1p(-exp(p))``, which loses all digits as ``p -> 0`` (``exp(p)`` rounds to 1
    for ``|p| < 6e-8`` in float32) and returns ``-inf`` log-odds with ``nan`` gradients
    there. Mean log-probs closer to 0 than the accumulation dtype's epsilon are taken
    at ``-eps`` (odds capped near ``1/eps``), where ``1 - e^p`` is not resolvable anyway.

    Args:
      pi_chosen: ``[B]`` *average* per-token log-probs of the chosen responses (<= 0; a
        positive value is a ``ValueError`` where it can be read without a sync).
      pi_rejected: ``[B]`` the same for the rejected responses.
      chosen_nll: ``[B]`` NLL of the chosen responses (the paper's L_SFT, per-token mean).
      lam: weight of the odds-ratio term (the paper's lambda, TRL's ``beta``). Default 0.1.

    Returns:
      ``(loss [B], metrics)``; detached ``[B]`` metrics ``chosen_rewards``
      (``lam pi_chosen``, as TRL logs them), ``rejected_rewards``, ``margins``,
      ``accuracies``, ``log_odds_ratio``, ``nll``.

    >>> p_w, p_l = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.2)])
    >>> loss, m = orpo_loss(p_w, p_l, -p_w, lam=1.0)
    >>> m["log_odds_ratio"]  # log((0.5/0.5) / (0.2/0.8)) = log 4
    tensor([1.3863])
    """
    check_sequences(pi_chosen=pi_chosen, pi_rejected=pi_rejected, chosen_nll=chosen_nll)
    check_positive("lam", lam, strict=False, finite=True)
    for name, x in (("pi_chosen", pi_chosen), ("pi_rejected", pi_rejected)):
        _check_log_probs(name, x)
    dtype = pi_chosen.dtype
    acc = acc_dtype(dtype)
    ceiling = -torch.finfo(acc).eps
    pw = pi_chosen.to(acc).clamp(max=ceiling)
    pl = pi_rejected.to(acc).clamp(max=ceiling)
    log_odds_ratio = (pw - _log1mexp(pw)) - (pl - _log1mexp(pl))
    nll = chosen_nll.to(acc)
    loss = nll + lam * F.softplus(-log_odds_ratio)
    metrics = pair_metrics(lam * pi_chosen.to(acc), lam * pi_rejected.to(acc), dtype)
    metrics["log_odds_ratio"] = log_odds_ratio.detach().to(dtype)
    metrics["nll"] = nll.detach().to(dtype)
    return loss.to(dtype), metrics
