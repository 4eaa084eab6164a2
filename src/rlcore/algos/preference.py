"""The pieces the preference losses share; :func:`rlcore.ops.sequence_logps` is re-exported here.

A preference loss scores whole responses: it takes per-sequence log-probabilities
``[B]`` (from :func:`rlcore.ops.sequence_logps` or
:func:`rlcore.models.preference_logps`), never token tensors, so the same loss serves
a padded batch, a packed one, or values precomputed offline.
"""

from __future__ import annotations

import torch

from rlcore._checks import check_floating, check_ndim, check_same_shape
from rlcore.ops import SEQUENCE_REDUCTIONS, sequence_logps

__all__ = ["sequence_logps"]

REDUCTIONS = SEQUENCE_REDUCTIONS

# Beyond exp(_EXP_CAP) the exponential is continued linearly: see capped_exp.
_EXP_CAP = 20.0


def check_sequences(**tensors: torch.Tensor) -> None:
    """Every tensor must be floating point with the shape ``[B]`` of the first one."""
    items = list(tensors.items())
    first_name, first = items[0]
    check_floating(first_name, first)
    check_ndim(first_name, first, 1)
    for name, x in items[1:]:
        check_floating(name, x)
        check_same_shape(name, x, first_name, first)


def check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"label_smoothing: got {label_smoothing!r}, expected a number in [0, 0.5) "
            "(the probability that a preference label is flipped)"
        )


def capped_exp(t: torch.Tensor) -> torch.Tensor:
    """``exp(t)``, continued linearly (value and slope matched) beyond ``t = 20``.

    The f-divergence scores and DiscoPOP contain ``exp`` of a log-ratio, which
    overflows at the log-ratios a diverging policy reaches. TRL clamps the exponent at
    ``log(finfo.max)``: the clamped value still overflows once divided by alpha or
    multiplied by beta, and the clamp zeroes the gradient. The linear continuation
    keeps both finite (squares included, for IPO and SPPO) and keeps the gradient's
    sign; below the cap it is exactly ``exp``.
    """
    return torch.exp(t.clamp(max=_EXP_CAP)) * (1.0 + (t - _EXP_CAP).clamp(min=0.0))


def smoothed_logistic(x: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-(1 - eps) log sigmoid(x) - eps log sigmoid(-x)``, in the overflow-free softplus form."""
    loss = torch.nn.functional.softplus(-x)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * torch.nn.functional.softplus(x)
    return loss


def pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, dtype: torch.dtype) -> dict:
    """Detached per-pair implicit rewards, their margin and whether the pair is ranked right."""
    chosen_rewards = chosen_rewards.detach()
    rejected_rewards = rejected_rewards.detach()
    margins = chosen_rewards - rejected_rewards
    return {
        "chosen_rewards": chosen_rewards.to(dtype),
        "rejected_rewards": rejected_rewards.to(dtype),
        "margins": margins.to(dtype),
        "accuracies": (margins > 0).to(dtype),
    }
