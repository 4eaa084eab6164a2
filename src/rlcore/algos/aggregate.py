"""Loss aggregation: per-token losses to one scalar, exact across micro-batches and ranks.

Peers normalise each micro-batch by its own token or sequence count and then average
the micro-batches (and the data-parallel ranks). When micro-batches hold different
numbers of tokens, that mean of means weights tokens unequally, so the gradient
depends on how the batch happened to be split. Here the normaliser is a global count
passed in (:func:`global_counts` computes it once per step), so the aggregates of the
micro-batches *add up* to the aggregate of the whole batch, whatever the split.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcore._checks import (
    check_choice,
    check_count,
    check_counts,
    check_floating,
    check_ndim,
    check_positive,
    check_same_shape,
    check_tensor,
)
from rlcore.algos.collectives import group_sum
from rlcore.ops import acc_dtype, masked_sum, masked_zero, saturating_cast

__all__ = ["AGGREGATION_MODES", "aggregate", "global_counts"]

AGGREGATION_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

Count = int | float | torch.Tensor


def _safe_den(count: Count, ref: torch.Tensor) -> torch.Tensor:
    den = torch.as_tensor(count, device=ref.device).to(ref.dtype)
    return torch.where(den > 0, den, torch.ones_like(den))


def _row_sums(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked sum of each row: :func:`rlcore.ops.masked_sum` semantics (padding never enters).

    A boolean mask, the common case, takes one zeroing pass (:func:`rlcore.ops.masked_zero`,
    a bitwise and) instead of the four of the general weighted path, forward and backward:
    this is the hot reduction of every training step.
    """
    if mask.dtype == torch.bool:
        return masked_zero(loss, mask).sum(-1)
    return masked_sum(loss, mask, dim=-1)


def _weight(mask: torch.Tensor, acc: torch.dtype, dim: int | None = None) -> torch.Tensor:
    """``mask.sum(dim)`` in ``acc``; a boolean mask is counted (a sum with a dtype first copies it)."""
    if mask.dtype == torch.bool:
        return torch.count_nonzero(mask, dim=dim).to(acc)
    return mask.sum(dim=dim, dtype=acc) if dim is not None else mask.sum(dtype=acc)


def aggregate(
    loss_t: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token-mean",
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar, normalised by (global) counts.

    Modes, with ``m`` the mask, ``N = num_tokens`` and ``S = num_seqs``::

        token-mean               sum_{i,t} m l / N                     (DAPO, arXiv:2503.14476)
        token-sum                sum_{i,t} m l
        seq-mean-token-sum       sum_i (sum_t m l) / S
        seq-mean-token-mean      sum_i (sum_t m l / sum_t m) / S       (GRPO, arXiv:2402.03300)
        seq-mean-token-sum-norm  sum_i (sum_t m l) / (S * horizon)     (Dr. GRPO, arXiv:2503.20783)

    ``N`` defaults to the batch's ``sum(m)`` and ``S`` to its number of sequences with at
    least one counted token (a fully masked sequence, e.g. one rejected by a filter, is
    not an example). Passing the counts of the *whole* batch makes the result additive:
    the sum of ``aggregate`` over the micro-batches (and over data-parallel ranks, with
    counts from :func:`global_counts` over the process group) equals ``aggregate`` of the whole
    batch. Wrappers that *average* gradients across ranks (DDP, FSDP) then need the
    loss multiplied by the world size.

    ``horizon`` defaults to ``T``; pass a constant (the maximum generation length, as
    Dr. GRPO does) so micro-batches padded to different lengths agree. verl's version of
    this mode divides by ``T`` only, without ``S``, so its scale grows with the batch.

    Args:
      loss_t: ``[B, T]`` per-token loss.
      mask: ``[B, T]``, 1 (or a weight ``>= 0``) where a token counts.
      mode: one of :data:`AGGREGATION_MODES`.
      num_tokens: global counted-token total ``N`` (number or scalar tensor).
      num_seqs: global counted-sequence total ``S`` (number or scalar tensor).
      horizon: normaliser of ``"seq-mean-token-sum-norm"`` (> 0).

    Returns:
      A scalar in ``loss_t.dtype`` (float32 accumulation). Zero counts give 0, not NaN.

    >>> loss_t = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> aggregate(loss_t, mask, mode="token-mean")
    tensor(2.5000)
    >>> aggregate(loss_t, mask, mode="seq-mean-token-mean")
    tensor(3.)
    >>> aggregate(loss_t[:1], mask[:1], mode="token-mean", num_tokens=4)
    tensor(1.5000)
    """
    check_floating("loss_t", loss_t)
    check_ndim("loss_t", loss_t, 2)
    check_same_shape("mask", mask, "loss_t", loss_t)
    if mask.dtype != torch.bool:
        check_counts("mask", mask)  # a negative weight would turn counts and sums around
    check_choice("mode", mode, AGGREGATION_MODES)
    check_count("num_tokens", num_tokens)
    check_count("num_seqs", num_seqs)
    if horizon is not None:
        if isinstance(horizon, bool) or not isinstance(horizon, (int, float)):
            raise ValueError(f"horizon: got {type(horizon).__name__}, expected a positive number")
        check_positive("horizon", horizon)
    acc = acc_dtype(loss_t.dtype)
    per_seq = _row_sums(loss_t.to(acc), mask)
    if mode == "token-sum":
        return saturating_cast(per_seq.sum(), loss_t.dtype)
    if mode == "token-mean":
        total = per_seq.sum()
        count = _weight(mask, acc) if num_tokens is None else num_tokens
        return saturating_cast(total / _safe_den(count, total), loss_t.dtype)
    row_weight = _weight(mask, acc, dim=-1)
    if mode == "seq-mean-token-mean":
        # A sum over a count, not ops.masked_mean: its exact-pivot shift buys accuracy
        # for variances, which a plain mean of losses does not need.
        per_seq = per_seq / _safe_den(row_weight, per_seq)
    if num_seqs is None:
        num_seqs = (row_weight != 0).sum()
    total = per_seq.sum()
    den = _safe_den(num_seqs, total)
    if mode == "seq-mean-token-sum-norm":
        # T = 0 (no tokens, so total is 0) must give 0, not 0 / 0.
        den = den * (max(loss_t.shape[-1], 1) if horizon is None else horizon)
    return saturating_cast(total / den, loss_t.dtype)


def global_counts(mask: torch.Tensor, *, process_group: Any = None) -> dict[str, torch.Tensor]:
    """The token and sequence counts of a batch, summed over a process group if one is given.

    Take them from the whole (local) batch *after* filtering and before splitting it
    into micro-batches, and pass them to :func:`aggregate` (or ``Algorithm.loss``) as
    ``**counts``. With ``process_group``, one ``all_reduce`` (sum) of a two-element
    tensor makes them global over the data-parallel ranks.

    Args:
      mask: ``[B, T]`` token mask of the local batch.
      process_group: optional ``torch.distributed`` process group or 1-D ``DeviceMesh``
        (the data-parallel one).

    Returns:
      ``{"num_tokens": N, "num_seqs": S}`` as scalar tensors on ``mask.device``: int64
      for a boolean or integer mask (exact at any size), float for a weighted mask.

    >>> global_counts(torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]]))
    {'num_tokens': tensor(3), 'num_seqs': tensor(2)}
    """
    check_tensor("mask", mask)
    check_ndim("mask", mask, 2)
    if mask.dtype.is_floating_point:
        weights = mask.to(acc_dtype(mask.dtype))
    else:
        weights = (mask != 0).long()
    seqs = (mask != 0).any(dim=-1).sum().to(weights.dtype)
    counts = group_sum(torch.stack([weights.sum(), seqs]), process_group=process_group)
    return {"num_tokens": counts[0], "num_seqs": counts[1]}
