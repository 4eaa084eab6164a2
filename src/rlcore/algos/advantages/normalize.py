"""Batch whitening of advantages, locally or across data-parallel ranks with one all-reduce.

Each rank summarises its elements as ``(count, pivot, mean - pivot, m2)``, where the
pivot is its smallest counted value (an exact shift, so a constant batch has variance
exactly 0), writes the four numbers into its own row of a ``[world_size, 4]`` tensor of
zeros, and one sum all-reduce hands every rank every row; Chan's parallel combination
then merges them. This costs one collective of ``4 * world_size`` numbers and, unlike
summing ``x`` and ``x^2``, has no catastrophic cancellation when the values sit far from
0. The all-reduce is the differentiable functional collective, so gradients flow
across ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from rlcore._checks import check_counts, check_floating, check_positive, check_same_shape
from rlcore.algos.collectives import resolve_process_group
from rlcore.ops import masked_whiten, pivot_shift, safe_div

__all__ = ["batch_moments", "batch_normalize"]


def batch_moments(
    x: torch.Tensor, weights: torch.Tensor, *, process_group: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dev, count, mean, m2)`` over the weighted elements of ``x``, across ranks when a group is given.

    Each rank shifts its values by its own exact pivot (:func:`rlcore.ops.pivot_shift`);
    ``dev`` is ``x - mean`` for every element (0 where the weight is 0), computed from
    the shifted values so that the mean is never rounded on its own; ``count``,
    ``mean`` and ``m2`` (sum of weighted squared deviations) are scalars. Across ranks
    it is one all-reduce of a ``[world_size, 4]`` table and Chan et al.'s parallel
    merge. Everything is in float64 (the values are upcast first): the squares of a
    float32 spread cannot overflow, and merging far-apart rank means loses nothing.

    Args:
      x: values, any shape, floating point.
      weights: same shape; nonzero marks an element that counts (weights ``>= 0``: a
        negative one is a ``ValueError`` where it can be read without a sync).
      process_group: a process group or 1-D ``DeviceMesh``; ``None`` keeps it local.

    Returns:
      ``(dev, count, mean, m2)`` in float64, ``dev`` of ``x``'s shape.

    >>> dev, count, mean, m2 = batch_moments(torch.tensor([1.0, 3.0, 9.0]), torch.tensor([1, 1, 0]))
    >>> dev.tolist(), float(count), float(mean), float(m2)  # sync-ok: doctest output
    ([-1.0, 1.0, 0.0], 2.0, 2.0, 2.0)
    """
    check_floating("x", x)
    check_same_shape("weights", weights, "x", x)
    check_counts("weights", weights)
    d, w, pivot, count = pivot_shift(x.to(torch.float64), weights, None)
    on = w != 0
    mean_d = safe_div((d * w).sum(), count)
    if process_group is None:
        dev = torch.where(on, d - mean_d, 0.0)
        return dev, count, pivot + mean_d, (dev * dev * w).sum()
    pg, world, rank = resolve_process_group(process_group)
    dev_local = torch.where(on, d - mean_d, 0.0)
    local = torch.stack([count, pivot, mean_d, (dev_local * dev_local * w).sum()])
    slot = F.one_hot(torch.tensor(rank, device=x.device), world).to(local.dtype)
    table = funcol.all_reduce(slot[:, None] * local[None, :], "sum", pg)
    counts, pivots, means_d, m2s = table.unbind(-1)
    total = counts.sum()
    # Chan et al.'s merge, with every mean kept as (pivot, small offset) and offsets
    # taken against one reference rank: differences of nearby pivots are exact, so a
    # mean near 1e4 is never rounded at its own scale, and identical data on every
    # rank merges to deviations of exactly 0.
    r0 = torch.argmax((counts > 0).to(torch.int32))
    off = (pivots - pivots[r0]) + (means_d - means_d[r0])
    mean_off = safe_div((counts * off).sum(), total)
    m2 = m2s.sum() + (counts * (off - mean_off) ** 2).sum()
    rel = (pivots[r0] - pivot) + means_d[r0] + mean_off
    dev = torch.where(on, d - rel, 0.0)
    mean = pivots[r0] + means_d[r0] + mean_off
    return dev, total, mean, m2


def batch_normalize(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    unbiased: bool = True,
    process_group: Any = None,
) -> torch.Tensor:
    """Whiten ``x`` over the whole batch, and over all data-parallel ranks when a group is given.

    Reference: the advantage whitening of PPO implementations (Huang et al., "The 37
    implementation details of PPO", 2022) and REINFORCE++ (Hu, arXiv 2501.03262),
    whose global normalisation spans the data-parallel batch.

    Formula: ``(x - mean) / sqrt(var + eps)``, ``mean`` and ``var`` (unbiased) taken over
    every element with nonzero mask on every rank of ``process_group``. With
    ``shift_mean=False`` the mean is added back. Locally it equals
    :func:`rlcore.ops.masked_whiten`. Across ranks it issues exactly one all-reduce
    (of ``4 * world_size`` numbers); peers that whiten per rank give each rank its own
    scale, which makes the update depend on how samples were sharded.

    Args:
      x: ``[...]`` floating-point values (sequence scores ``[B]`` or tokens ``[B, T]``).
      mask: same shape as ``x``; 1 marks an element that counts (fractional values act
        as weights). Always explicit: for sequence-level values without padding pass
        ``torch.ones_like(x, dtype=torch.bool)``.
      shift_mean: subtract the mean (True) or only rescale (False).
      eps: added to the variance before the square root.
      unbiased: Bessel-corrected variance (as verl and TRL).
      process_group: a ``torch.distributed`` process group or 1-D ``DeviceMesh`` to
        take the statistics over; ``None`` keeps them local (no collective).

    Returns:
      ``x`` whitened, in ``x.dtype``; 0 where the mask is 0.

    >>> batch_normalize(torch.tensor([1.0, 3.0, 5.0]), torch.ones(3, dtype=torch.bool))
    tensor([-1.,  0.,  1.])
    """
    check_floating("x", x)
    check_positive("eps", eps, strict=False, finite=True)
    check_same_shape("mask", mask, "x", x)
    if mask.dtype != torch.bool:
        check_counts("mask", mask)
    if process_group is None:
        return masked_whiten(x, mask, shift_mean=shift_mean, eps=eps, unbiased=unbiased)
    dev, count, mean, m2 = batch_moments(x, mask, process_group=process_group)
    den = count - 1 if unbiased else count
    var = safe_div(m2, den) * (den > 0)
    # With eps = 0 a constant batch has var 0; its deviations are exactly 0, so any
    # finite factor gives 0 (rsqrt(0) would make 0 * inf = nan).
    total = var + eps
    out = dev * torch.where(total > 0, torch.rsqrt(torch.where(total > 0, total, 1.0)), 0.0)
    if not shift_mean:
        out = out + mean
    return torch.where(mask != 0, out, 0.0).to(x.dtype)
