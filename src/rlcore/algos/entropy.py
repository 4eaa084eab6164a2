"""Entropy control by an adaptive bonus: an ``(init, update)`` controller that steers the policy's entropy to a target."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from rlcore._checks import check_positive

__all__ = ["EntropyController", "EntropyControllerState", "adaptive_entropy_controller"]


class EntropyControllerState(NamedTuple):
    """State of an entropy controller (float32 scalar tensors).

    Fields:
      alpha: the running coefficient ``alpha_k``.
      entropy_coef: the bonus coefficient for the next batch: ``alpha_k`` while the last
        measured entropy was below the target, 0 otherwise.
    """

    alpha: torch.Tensor
    entropy_coef: torch.Tensor


class EntropyController(NamedTuple):
    """An entropy controller as a pair of pure functions: ``init(device=None) -> state`` and
    ``update(entropy, state) -> state`` (rlcore's ``(init, update)`` convention, as
    :class:`rlcore.algos.KLController`)."""

    init: Callable[..., EntropyControllerState]
    update: Callable[..., EntropyControllerState]


def adaptive_entropy_controller(
    *, target: float = 0.2, delta: float = 1e-4, init_coef: float = 0.0, max_coef: float | None = 0.005
) -> EntropyController:
    """An entropy bonus whose coefficient rises while entropy is below a target and falls above it.

    Reference: He et al. 2025, "Skywork Open Reasoner 1 Technical Report", arXiv
    2505.22312 (adaptive entropy control); defaults from its training scripts: target
    0.2, step 1e-4, coefficient in ``[0, 0.005]``, starting at 0.
    Where Clip-Cov and KL-Cov (:func:`rlcore.algos.clip_cov_loss`) act on the tokens that
    drive entropy down, this acts on the loss's entropy bonus as a whole.

    Formula, with ``H_k`` the measured mean token entropy of batch ``k``::

        alpha_{k+1} = clip(alpha_k + delta, 0, max_coef)   if H_k < target
                      clip(alpha_k - delta, 0, max_coef)   otherwise
        coef_{k+1}  = alpha_{k+1} * [H_k < target]

    so the bonus is on only while the entropy is below its target, with a coefficient
    that grows the longer it stays there. A non-finite ``H_k`` is skipped (no host sync).

    The coefficient enters a recipe as its ``entropy_coef``, a number:
    ``algo._replace(entropy_coef=float(state.entropy_coef))`` once per step (the batch
    then needs ``entropy``, e.g. from ``rlcore.ops.logprobs_from_logits(...,
    with_entropy=True)``; the ``entropy`` metric of ``Algorithm.loss`` is ``H_k``).

    Args:
      target: the entropy to hold (> 0), in nats per token.
      delta: the step of ``alpha`` per update (> 0).
      init_coef: ``alpha_0`` (>= 0).
      max_coef: an upper bound on ``alpha`` (>= ``init_coef``), or ``None``.

    Returns:
      An :class:`EntropyController` whose state is :class:`EntropyControllerState`.

    >>> ctrl = adaptive_entropy_controller(target=0.5, delta=0.01, max_coef=None)
    >>> state = ctrl.update(torch.tensor(0.3), ctrl.update(torch.tensor(0.2), ctrl.init()))
    >>> state.alpha, state.entropy_coef
    (tensor(0.0200), tensor(0.0200))
    >>> ctrl.update(torch.tensor(0.9), state).entropy_coef
    tensor(0.)
    """
    check_positive("target", target, finite=True)
    check_positive("delta", delta, finite=True)
    check_positive("init_coef", init_coef, strict=False, finite=True)
    if max_coef is not None:
        check_positive("max_coef", max_coef, finite=True)
        if init_coef > max_coef:
            raise ValueError(f"max_coef: got {max_coef!r} with init_coef={init_coef!r}, expected max_coef >= init_coef")

    def init(device: torch.device | str | None = None) -> EntropyControllerState:
        alpha = torch.tensor(init_coef, dtype=torch.float32, device=device)
        return EntropyControllerState(alpha, alpha.clone())

    def update(entropy: Any, state: EntropyControllerState) -> EntropyControllerState:
        if not isinstance(state, EntropyControllerState):
            raise ValueError(
                f"state: got {type(state).__name__}, expected an EntropyControllerState (from the controller's init)"
            )
        if isinstance(entropy, torch.Tensor):
            if entropy.numel() != 1:
                raise ValueError(
                    f"entropy: got a tensor of shape {tuple(entropy.shape)}, expected a scalar (the batch's mean entropy)"
                )
        elif isinstance(entropy, bool) or not isinstance(entropy, (int, float)):
            raise ValueError(f"entropy: got {type(entropy).__name__} {entropy!r}, expected a number or a scalar tensor")
        alpha = state.alpha
        h = torch.as_tensor(entropy, dtype=alpha.dtype, device=alpha.device).detach().reshape(())
        below = h < target
        new = torch.clamp(torch.where(below, alpha + delta, alpha - delta), min=0.0, max=max_coef)
        ok = torch.isfinite(h)
        new_alpha = torch.where(ok, new, alpha)
        new_coef = torch.where(ok, torch.where(below, new_alpha, 0.0), state.entropy_coef)
        return EntropyControllerState(new_alpha, new_coef)

    return EntropyController(init, update)
