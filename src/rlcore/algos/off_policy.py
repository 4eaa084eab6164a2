"""The decoupled PPO objective: the behaviour policy weights the tokens, the proximal policy anchors the clip.

Reference: Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning System
for Language Reasoning", arXiv 2505.24298, eq. 5 (after Hilton et al., "Batch size-
invariance for policy optimization", 2022). In asynchronous RL a response is sampled by
a *behaviour* policy ``pi_behav`` (the weights the rollout engine held, one or more
versions old); the update trains ``pi_theta`` starting from the *proximal* policy
``pi_prox`` (the weights at the start of this step's updates). Per token::

    J(theta) = E_{y ~ pi_behav} [ w_t * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t) ]
    w_t = pi_prox(y_t) / pi_behav(y_t)     (detached; truncated or masked above a cap)
    r_t = pi_theta(y_t) / pi_prox(y_t)

Standard PPO is the case ``pi_prox = pi_behav``: ``w_t = 1`` exactly. An
:class:`rlcore.algos.Algorithm` with ``behaviour_weights`` set multiplies ``w_t`` into
its policy loss, whatever that loss is, with ``old_logp`` as the proximal log-probs and
the batch's ``rollout_logp`` as the behaviour's (:func:`decoupled`).

The proximal log-probs cost a forward pass unless the step has one optimiser update:
then ``pi_prox`` *is* the update's own ``pi_theta``, detached. With several updates
:func:`interpolated_prox_logp` approximates them from the versions (AReaL's
"prox-approx"), saving that forward.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from rlcore._checks import check_choice, check_ndim, check_positive, check_same_shape
from rlcore.algos.filters import truncated_is_weights
from rlcore.algos.recipes.algorithm import Algorithm
from rlcore.ops import acc_dtype

__all__ = [
    "BEHAVIOUR_MODES",
    "STALE_MODES",
    "behaviour_weights",
    "decoupled",
    "interpolated_prox_logp",
    "staleness_weights",
]

BEHAVIOUR_MODES = ("truncate", "mask")
STALE_MODES = ("drop", "weight")


def behaviour_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    mode: str = "truncate",
) -> torch.Tensor:
    """The decoupled objective's per-token weight ``w_t = pi_prox(y_t) / pi_behav(y_t)``, bounded by ``cap``.

    Reference: AReaL (arXiv 2505.24298), eq. 5; its ``behav_imp_weight_cap`` masks the
    tokens whose weight exceeds the cap (``mode="mask"``); truncating them to the cap
    (``mode="truncate"``) is the truncated importance sampling of Ionides (2008), as in
    :func:`rlcore.algos.truncated_is_weights`.

    Formula: ``w_t = exp(prox_logp_t - behav_logp_t)``; ``truncate``: ``min(w_t, cap)``;
    ``mask``: ``w_t if w_t <= cap else 0``. Computed in float32 or wider (the difference
    of two bfloat16 log-probs is exact there), detached, 0 off the mask.

    Args:
      prox_logp: ``[B, T]`` log-probs of the sampled tokens under the proximal policy
        (the batch's ``old_logp``).
      behav_logp: ``[B, T]`` log-probs the rollout engine sampled them with (``rollout_logp``).
      mask: ``[B, T]``; non-zero marks a response token.
      cap: the bound on ``w_t`` (> 0).
      mode: ``"truncate"`` or ``"mask"``.

    Returns:
      ``[B, T]`` weights in ``prox_logp.dtype``, 0 where the mask is 0.

    >>> prox = torch.tensor([[0.0, 0.0, -1.0]]); behav = torch.tensor([[-0.5, -2.0, -1.0]])
    >>> behaviour_weights(prox, behav, torch.ones(1, 3))
    tensor([[1.6487, 2.0000, 1.0000]])
    >>> behaviour_weights(prox, behav, torch.ones(1, 3), mode="mask")
    tensor([[1.6487, 0.0000, 1.0000]])
    """
    check_positive("cap", cap)
    check_choice("mode", mode, BEHAVIOUR_MODES)
    if mode == "truncate":
        return truncated_is_weights(prox_logp, behav_logp, mask, cap=cap)
    # In float32 (or wider): the comparison with the cap must not see bfloat16 rounding.
    acc = acc_dtype(prox_logp.dtype)
    w = truncated_is_weights(prox_logp.to(acc), behav_logp.to(acc), mask, cap=math.inf)
    return torch.where(w <= cap, w, 0.0).to(prox_logp.dtype)


def staleness_weights(lag: torch.Tensor, *, max_lag: int, mode: str = "drop", decay: float = 0.5) -> torch.Tensor:
    """Per-row weights of asynchronous rows by their policy lag: 1 up to ``max_lag`` versions, then 0 or decaying.

    Reference: the staleness control of asynchronous RL systems (AReaL, arXiv 2505.24298,
    sec. 5: rows more than ``eta`` versions old are not trained on). ``drop`` is that
    filter; ``weight`` keeps the old rows at a geometric discount instead::

        drop:    w = 1 if lag <= k else 0
        weight:  w = 1 if lag <= k else decay ** (lag - k)

    Args:
      lag: ``[B]`` each row's lag in versions (the trained version minus the row's oldest
        token's version), integer or floating.
      max_lag: ``k``, the largest lag kept whole (an int >= 0).
      mode: ``"drop"`` or ``"weight"``.
      decay: the discount per version beyond ``k``, in ``(0, 1]`` (``weight`` only).

    Returns:
      ``[B]`` weights in ``[0, 1]``: float32 for an integer ``lag``, else ``lag``'s dtype.

    >>> staleness_weights(torch.tensor([0, 1, 2, 3]), max_lag=1)
    tensor([1., 1., 0., 0.])
    >>> staleness_weights(torch.tensor([0, 1, 2, 3]), max_lag=1, mode="weight")
    tensor([1.0000, 1.0000, 0.5000, 0.2500])
    """
    check_ndim("lag", lag, 1)
    if not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 0:
        raise ValueError(f"max_lag: got {max_lag!r}, expected an int >= 0")
    check_choice("mode", mode, STALE_MODES)
    if not 0 < decay <= 1:
        raise ValueError(f"decay: got {decay!r}, expected a value in (0, 1]")
    dtype = lag.dtype if lag.is_floating_point() else torch.float32
    over = (lag.to(acc_dtype(dtype)) - max_lag).clamp(min=0)
    if mode == "drop":
        return (over <= 0).to(dtype)
    return torch.pow(torch.full_like(over, decay), over).to(dtype)


def interpolated_prox_logp(
    behav_logp: torch.Tensor,
    logp: torch.Tensor,
    *,
    behav_version: torch.Tensor,
    prox_version: torch.Tensor | int,
    version: torch.Tensor | int,
) -> torch.Tensor:
    """The proximal log-probs interpolated between the behaviour's and the current ones by version (no forward).

    Reference: AReaL's proximal-policy approximation ("prox-approx", log-linear in the
    policy version): the proximal policy lies between the behaviour policy (version
    ``v_behav``) and the policy being trained (version ``v_theta``), at ``v_prox``::

        alpha_t = (v_prox - v_behav_t) / (v_theta - v_behav_t)      (0 where v_theta == v_behav_t)
        log pi_prox(y_t) ~= log pi_behav(y_t) + alpha_t * (log pi_theta(y_t) - log pi_behav(y_t))

    It is exact at both ends: ``alpha = 1`` when the update trains the proximal weights
    themselves (``v_theta == v_prox``: the first update of a step), ``alpha = 0`` when
    the behaviour is the proximal policy (staleness 0). ``alpha`` is clamped to
    ``[0, 1]``. The result is detached: it anchors the ratio, it is not trained.

    Args:
      behav_logp: ``[B, T]`` the sampler's log-probs (``rollout_logp``).
      logp: ``[B, T]`` the current policy's log-probs (the update's forward).
      behav_version: ``[B]`` (per row) or ``[B, T]`` (per token) version that sampled each token.
      prox_version: the version the step's updates started from (a number or a tensor
        broadcastable to ``behav_version``).
      version: the version being trained now (idem).

    Returns:
      ``[B, T]`` approximate proximal log-probs in ``logp.dtype``, detached.

    >>> behav = torch.tensor([[-2.0, -1.0]]); cur = torch.tensor([[-1.0, -1.0]])
    >>> interpolated_prox_logp(behav, cur, behav_version=torch.tensor([0]), prox_version=1, version=2)
    tensor([[-1.5000, -1.0000]])
    """
    check_same_shape("logp", logp, "behav_logp", behav_logp)
    if behav_version.dim() == 1:
        check_same_shape("behav_version", behav_version, "behav_logp's rows", behav_logp[:, 0])
        behav_version = behav_version[:, None]
    else:
        check_same_shape("behav_version", behav_version, "behav_logp", behav_logp)
    acc = acc_dtype(logp.dtype)
    v_b = behav_version.to(acc)
    v_p = torch.as_tensor(prox_version, device=logp.device).to(acc)
    v_t = torch.as_tensor(version, device=logp.device).to(acc)
    span = v_t - v_b
    alpha = torch.where(span != 0, (v_p - v_b) / torch.where(span != 0, span, 1.0), 0.0).clamp(0.0, 1.0)
    b = behav_logp.detach().to(acc)
    return (b + alpha * (logp.detach().to(acc) - b)).to(logp.dtype)


def decoupled(algo: Algorithm, *, cap: float = 2.0, mode: str = "truncate") -> Algorithm:
    """``algo`` with the decoupled objective: its policy loss weighted by :func:`behaviour_weights`.

    The batch then needs ``rollout_logp`` (the sampler's log-probs) besides ``old_logp``
    (the proximal policy's). Where the two are equal the loss is ``algo``'s exactly.

    >>> from rlcore import algos
    >>> decoupled(algos.grpo(), cap=5.0).behaviour_weights.keywords
    {'cap': 5.0, 'mode': 'truncate'}
    """
    check_positive("cap", cap)
    check_choice("mode", mode, BEHAVIOUR_MODES)
    return algo._replace(behaviour_weights=partial(behaviour_weights, cap=cap, mode=mode))
