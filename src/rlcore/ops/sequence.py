"""Per-sequence log-probabilities from token log-probs: the masked sum or its length-normalised mean.

A preference loss scores whole responses: it takes per-sequence log-probabilities
``[B]``, never token tensors, so the same loss serves a padded batch, a packed one,
or values precomputed offline. This reduction is shared by the model side
(:func:`rlcore.models.preference_logps`) and the losses.
"""

from __future__ import annotations

import torch

from rlcore._checks import check_choice, check_floating, check_ndim, check_same_shape
from rlcore.ops.masked import masked_mean, masked_sum

__all__ = ["SEQUENCE_REDUCTIONS", "sequence_logps"]

SEQUENCE_REDUCTIONS = ("sum", "mean")


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor, *, reduce: str = "sum") -> torch.Tensor:
    """Per-sequence log-probability from token log-probs: the masked sum, or its length-normalised mean.

    DPO (Rafailov et al., 2023, arXiv:2305.18290) scores a response by
    ``log pi(y|x) = sum_t log pi(y_t | x, y_<t)``; SimPO (Meng et al., 2024,
    arXiv:2405.14734) and ORPO (Hong et al., 2024, arXiv:2403.07691) use the average
    ``(1/|y|) sum_t log pi(y_t | x, y_<t)``, and TRL runs IPO on it too.

    Args:
      logp: ``[B, T]`` token log-probs; positions outside the mask may hold anything,
        ``nan`` included.
      mask: ``[B, T]``, 1 on the response tokens that count (bool or 0/1).
      reduce: ``"sum"`` or ``"mean"`` (length-normalised).

    Returns:
      ``[B]`` in ``logp.dtype`` (float32 accumulation); a row with an empty mask gives 0.

    >>> logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.5, -0.5]])
    >>> mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    >>> sequence_logps(logp, mask)
    tensor([-3.0000, -1.5000])
    >>> sequence_logps(logp, mask, reduce="mean")
    tensor([-1.5000, -0.5000])
    """
    check_choice("reduce", reduce, SEQUENCE_REDUCTIONS)
    check_floating("logp", logp)
    check_ndim("logp", logp, 2)
    check_same_shape("mask", mask, "logp", logp)
    reducer = masked_sum if reduce == "sum" else masked_mean
    return reducer(logp, mask, dim=-1)
