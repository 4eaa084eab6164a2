"""KL regularisation: per-token KL estimators, KL folded into rewards, and KL-coefficient controllers.

The controllers follow optax: a controller is a ``NamedTuple`` of two pure functions,
``init(device=None) -> state`` and ``update(kl, state, *, n_steps) -> state``, over an
explicit state pytree (:class:`KLControllerState`), so they run inside a compiled step
and checkpoint as plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from rlcore._checks import check_choice, check_count, check_floating, check_ndim, check_positive, check_same_shape
from rlcore.ops import acc_dtype, masked_mean, masked_sum

__all__ = [
    "KL_ESTIMATORS",
    "KLController",
    "KLControllerState",
    "adaptive_kl_controller",
    "fixed_kl_controller",
    "kl_in_reward",
    "kl_penalty",
]

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")

# The stability clamps of verl's and TRL's "low_var_kl" (k3): the log-ratio is clamped
# before exp, the estimate after.
_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def _estimate(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    # k3 in terms of r = ref_logp - logp: exp(r) - r - 1.
    r = torch.clamp(-log_ratio, min=-_K3_LOG_RATIO_CLAMP, max=_K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.expm1(r) - r, min=-_K3_VALUE_CLAMP, max=_K3_VALUE_CLAMP)


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, *, estimator: str = "k1", straight_through: bool = False
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from the log-probs of the sampled tokens.

    Reference: Schulman, "Approximating KL Divergence" (2020, k1/k2/k3); Tang & Munos,
    "On a few pitfalls in KL divergence gradient estimation for RL", arXiv 2506.09477.

    With ``d = logp - ref_logp``::

        k1  = d                       (unbiased, high variance, can be negative)
        abs = |d|
        k2  = d^2 / 2                 (low variance, biased)
        k3  = exp(-d) + d - 1         (unbiased, >= 0; verl's "low_var_kl")

    k3 clamps ``-d`` to ``[-20, 20]`` before ``exp`` and its value to ``[-10, 10]``, as
    verl and TRL do. As a *loss*, only k2 has the right gradient: ``d * grad logp`` is
    the on-policy estimate of ``grad KL(pi || pi_ref)``; k1's gradient is 0 in
    expectation and k3's estimates the gradient of the *forward* KL. With
    ``straight_through=True`` the value stays the chosen estimator's (for logging and
    rewards) while the gradient is k2's (verl's ``"k3+"``). Computed in float32.

    Args:
      logp: ``[...]`` log-probs of the sampled tokens under the policy.
      ref_logp: same shape, under the reference policy.
      estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
      straight_through: use k2's gradient under the estimator's value.

    Returns:
      The per-token estimate, shape and dtype of ``logp``; elementwise, so positions
      outside the mask hold whatever the inputs hold there.

    >>> kl_penalty(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]), estimator="k3")
    tensor([0.3679, 0.7183])
    """
    check_floating("logp", logp)
    check_floating("ref_logp", ref_logp)
    check_same_shape("ref_logp", ref_logp, "logp", logp)
    check_choice("estimator", estimator, KL_ESTIMATORS)
    acc = acc_dtype(logp.dtype)
    d = logp.to(acc) - ref_logp.to(acc)
    value = _estimate(d, estimator)
    if straight_through:
        surrogate = 0.5 * d.square()
        value = surrogate - surrogate.detach() + value.detach()
    return value.to(logp.dtype)


def kl_in_reward(
    rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float | torch.Tensor,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Fold a KL penalty into the token rewards: ``r_t - kl_coef * KL_t`` on the counted tokens.

    Reference: Ziegler et al., "Fine-Tuning Language Models from Human Preferences",
    arXiv 1909.08593 (the per-token KL reward of RLHF); Ouyang et al., arXiv 2203.02155.

    The KL is computed without gradient (it is part of the reward, a constant to the
    policy gradient). ``kl_coef`` may be a tensor, e.g. the state of a KL controller.

    Args:
      rewards: ``[B, T]`` token rewards (e.g. the score on the last token).
      logp: ``[B, T]`` log-probs of the sampled tokens under the rollout policy.
      ref_logp: ``[B, T]`` log-probs under the reference policy.
      mask: ``[B, T]``; 1 marks a generated token.
      kl_coef: the coefficient ``beta`` (>= 0).
      estimator: as in :func:`kl_penalty`.

    Returns:
      ``(rewards, metrics)``: the shaped rewards in ``rewards.dtype`` (0 where the mask
      is 0) and detached metrics: ``"kl"``, the sequence KL (sum over tokens, mean over
      sequences; the quantity Ziegler et al.'s adaptive controller targets) and
      ``"kl_per_token"``, the mean over all counted tokens (verl feeds this one to its
      controller).

    >>> r, m = kl_in_reward(torch.tensor([[0.0, 1.0]]), torch.tensor([[-1.0, -1.0]]),
    ...                     torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2), kl_coef=0.1)
    >>> r, m["kl"]
    (tensor([[-0.0500,  1.0000]]), tensor(0.5000))
    """
    check_ndim("rewards", rewards, 2)
    check_floating("rewards", rewards)
    check_same_shape("logp", logp, "rewards", rewards)
    check_same_shape("mask", mask, "rewards", rewards)
    if isinstance(kl_coef, torch.Tensor):
        if kl_coef.numel() != 1:  # never a silent broadcast over samples or tokens
            raise ValueError(f"kl_coef: got a tensor of shape {tuple(kl_coef.shape)}, expected a scalar")
        kl_coef = kl_coef.reshape(())
    else:
        check_positive("kl_coef", kl_coef, strict=False, finite=True)
    kl = kl_penalty(logp.detach(), ref_logp.detach(), estimator=estimator).to(acc_dtype(rewards.dtype))
    on = mask != 0
    shaped = torch.where(on, rewards.to(kl.dtype) - kl_coef * kl, 0.0)
    seq_kl = masked_sum(kl, on, dim=-1)
    has_tokens = on.any(dim=-1)
    metrics = {
        "kl": masked_mean(seq_kl, has_tokens).detach(),
        "kl_per_token": masked_mean(kl, on).detach(),
    }
    return shaped.to(rewards.dtype), metrics


class KLControllerState(NamedTuple):
    """State of a KL controller: the current coefficient ``beta`` (float32 scalar tensor)."""

    kl_coef: torch.Tensor


class KLController(NamedTuple):
    """A KL controller as a pair of pure functions (optax style).

    ``init(device=None) -> KLControllerState`` and
    ``update(kl, state, *, n_steps) -> KLControllerState``, where ``kl`` is the measured
    KL of the latest batch and ``n_steps`` the number of samples it held. The
    convention of every ``(init, update)`` pair in rlcore (shared with
    :class:`rlcore.algos.RewardNormalizer`): ``init(device=None) -> state``;
    ``update(data..., state, *, options)`` takes the data tensors, then the state,
    positionally and every option by keyword, and returns the new state, or
    ``(output, state)`` when the transform has an output. Pass an instance as an
    ``Algorithm``'s ``kl_coef`` to put it in the loss.
    """

    init: Callable[..., KLControllerState]
    update: Callable[..., KLControllerState]


def _init(value: float) -> Callable[..., KLControllerState]:
    def init(device: torch.device | str | None = None) -> KLControllerState:
        return KLControllerState(torch.tensor(value, dtype=torch.float32, device=device))

    return init


def _check_update(kl: Any, state: Any) -> torch.Tensor:
    """The checks of a controller's ``update``: a scalar KL and a :class:`KLControllerState`; returns its coefficient."""
    if not isinstance(state, KLControllerState):
        raise ValueError(
            f"state: got {type(state).__name__}, expected a KLControllerState (from the controller's init)"
        )
    if isinstance(kl, torch.Tensor):
        if kl.numel() != 1:
            raise ValueError(f"kl: got a tensor of shape {tuple(kl.shape)}, expected a scalar (the batch's mean KL)")
    elif isinstance(kl, bool) or not isinstance(kl, (int, float)):
        raise ValueError(f"kl: got {type(kl).__name__} {kl!r}, expected a number or a scalar tensor")
    return state.kl_coef


def fixed_kl_controller(*, kl_coef: float) -> KLController:
    """A constant KL coefficient: ``update`` returns the state unchanged.

    Reference: Ziegler et al., arXiv 1909.08593 (the fixed-beta baseline of the
    adaptive controller). Formula: ``beta_{k+1} = beta_k = kl_coef``.

    Args:
      kl_coef: the coefficient ``beta`` (>= 0).

    Returns:
      A :class:`KLController` whose state is :class:`KLControllerState`.

    >>> ctrl = fixed_kl_controller(kl_coef=0.05)
    >>> ctrl.update(torch.tensor(3.0), ctrl.init(), n_steps=8).kl_coef
    tensor(0.0500)
    """
    check_positive("kl_coef", kl_coef, strict=False, finite=True)

    def update(kl: torch.Tensor | float, state: KLControllerState, *, n_steps: int | torch.Tensor) -> KLControllerState:
        _check_update(kl, state)
        return state

    return KLController(_init(kl_coef), update)


def adaptive_kl_controller(*, init_kl_coef: float = 0.2, target: float = 6.0, horizon: float = 10000.0) -> KLController:
    """Adaptive KL coefficient that steers the measured KL towards a target.

    Reference: Ziegler et al., "Fine-Tuning Language Models from Human Preferences",
    arXiv 1909.08593, section 2.2 (defaults from its code: beta 0.2, target 6 nats of
    sequence KL, horizon 10000 samples).

    Formula: ``e = clip(KL / target - 1, -0.2, 0.2)``,
    ``beta <- beta * (1 + e * min(n_steps / horizon, 1))``: one update corrects by at most
    one horizon's worth, so ``beta`` never turns negative. A non-finite ``KL`` leaves
    ``beta`` unchanged (the observation is skipped, without a host sync).

    Args:
      init_kl_coef: the starting ``beta`` (>= 0).
      target: the KL to aim for (> 0), in the units of the ``kl`` passed to ``update``
        (the defaults assume the sequence KL, ``kl_in_reward``'s ``"kl"`` metric).
      horizon: number of samples over which the error is corrected (> 0).

    Returns:
      A :class:`KLController` whose state is :class:`KLControllerState`.

    >>> ctrl = adaptive_kl_controller(init_kl_coef=0.1, target=1.0, horizon=100)
    >>> ctrl.update(torch.tensor(2.0), ctrl.init(), n_steps=50).kl_coef
    tensor(0.1100)
    """
    check_positive("init_kl_coef", init_kl_coef, strict=False, finite=True)
    check_positive("target", target)
    check_positive("horizon", horizon)

    def update(kl: torch.Tensor | float, state: KLControllerState, *, n_steps: int | torch.Tensor) -> KLControllerState:
        check_count("n_steps", n_steps)
        coef = _check_update(kl, state)
        kl_t = torch.as_tensor(kl, dtype=coef.dtype, device=coef.device).detach().reshape(())
        steps = torch.as_tensor(n_steps, dtype=coef.dtype, device=coef.device)
        error = torch.clamp(kl_t / target - 1.0, min=-0.2, max=0.2)
        # A non-finite KL observation (or step count) is skipped, never absorbed: one
        # NaN would otherwise make every later coefficient NaN. One update corrects by at
        # most one horizon's worth: past it, 1 - 0.2 * n_steps / horizon turns negative
        # (a coefficient that rewards diverging from the reference).
        new = coef * (1.0 + error * torch.clamp(steps / horizon, max=1.0))
        return KLControllerState(torch.where(torch.isfinite(kl_t) & torch.isfinite(steps), new, coef))

    return KLController(_init(init_kl_coef), update)
