"""Segment (group) reductions over the leading dimension, vectorised with scatter / index_add.

Groups are given by an integer ``group_ids`` tensor ``[B]``; they need not be
contiguous or of equal size. Every result has one row per segment,
``[num_segments, *x.shape[1:]]``; empty segments give 0.

Exactness: each group is shifted by its own minimum (an exact pivot) before the sums
are taken, so a group whose values are all equal has a mean equal to that value and a
std of exactly 0 in any dtype — peers that take ``E[x^2] - E[x]^2`` or an unshifted
float32 mean return spurious stds of 1e-7..1e-3 there and turn them into advantages
of size ~1. The pivot also keeps the two-pass variance accurate for groups far from 0.
"""

from __future__ import annotations

import torch

from rlcore._checks import check_integer, check_ndim, check_tensor
from rlcore.ops._accum import acc_dtype

__all__ = ["segment_count", "segment_mean", "segment_mean_std", "segment_std", "segment_sum"]


def _check(x: torch.Tensor, group_ids: torch.Tensor, num_segments: int | None) -> int:
    check_tensor("x", x)
    check_ndim("group_ids", group_ids, 1)
    check_integer("group_ids", group_ids)
    if x.dim() == 0 or x.shape[0] != group_ids.shape[0]:
        raise ValueError(
            f"group_ids: got shape {tuple(group_ids.shape)}, expected ({x.shape[0] if x.dim() else '?'},) "
            f"(the leading dimension of x, shape {tuple(x.shape)})"
        )
    if num_segments is None:
        if group_ids.numel() == 0:
            return 0
        return int(group_ids.max()) + 1  # sync-ok: documented default; pass num_segments to avoid it
    if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 0:
        raise ValueError(f"num_segments: got {num_segments!r}, expected a non-negative int")
    return num_segments


def _index(group_ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    idx = group_ids.long()
    return idx.view(-1, *([1] * (like.dim() - 1))).expand_as(like)


def _sum(x: torch.Tensor, group_ids: torch.Tensor, n: int) -> torch.Tensor:
    out = x.new_zeros((n, *x.shape[1:]))
    return out.index_add(0, group_ids, x)


def _count(group_ids: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    ones = torch.ones(group_ids.shape, dtype=dtype, device=group_ids.device)
    return _sum(ones, group_ids, n)


def _moments(
    x: torch.Tensor, group_ids: torch.Tensor, n: int, need_m2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(count, mean, m2)`` per segment in the accumulation dtype, with an exact per-group pivot."""
    xa = x.to(acc_dtype(x.dtype))
    # The pivot is detached: mean and variance are exact functions of x whatever the
    # shift, so no gradient belongs to it.
    pivot = xa.detach().new_zeros((n, *x.shape[1:]))
    pivot = pivot.scatter_reduce(0, _index(group_ids, xa), xa.detach(), "amin", include_self=False)
    d = xa - pivot[group_ids]
    count = _count(group_ids, n, xa.dtype).view(n, *([1] * (x.dim() - 1)))
    safe = torch.where(count > 0, count, torch.ones_like(count))
    mean_d = _sum(d, group_ids, n) / safe
    mean = pivot + mean_d
    if not need_m2:
        return count, mean, None
    dev = d - mean_d[group_ids]
    return count, mean, _sum(dev * dev, group_ids, n)


def segment_count(group_ids: torch.Tensor, *, num_segments: int | None = None) -> torch.Tensor:
    """Number of samples in each segment, ``[num_segments]`` int64.

    >>> segment_count(torch.tensor([0, 2, 0]))
    tensor([2, 0, 1])
    """
    n = _check(group_ids, group_ids, num_segments)
    return _count(group_ids, n, torch.int64)


def segment_sum(x: torch.Tensor, group_ids: torch.Tensor, *, num_segments: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over each segment.

    Args:
      x: ``[B, ...]`` values.
      group_ids: ``[B]`` integer segment of each sample, in ``[0, num_segments)``.
      num_segments: number of segments; defaults to ``group_ids.max() + 1``, which reads
        one value back from the device (pass it to stay sync-free).

    Returns:
      ``[num_segments, ...]`` in ``x.dtype`` (float32 accumulation for narrower floats).

    >>> segment_sum(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1, 0, 1]))
    tensor([2., 5.])
    """
    n = _check(x, group_ids, num_segments)
    if not x.dtype.is_floating_point:
        return _sum(x, group_ids, n)
    return _sum(x.to(acc_dtype(x.dtype)), group_ids, n).to(x.dtype)


def segment_mean(x: torch.Tensor, group_ids: torch.Tensor, *, num_segments: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over each segment; 0 for an empty segment.

    A segment whose values are all equal gets exactly that value.

    >>> segment_mean(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1, 0, 1]))
    tensor([2.0000, 2.5000])
    """
    n = _check(x, group_ids, num_segments)
    _, mean, _ = _moments(x, group_ids, n, need_m2=False)
    return _out(mean, x)


def _std_from(count: torch.Tensor, m2: torch.Tensor, unbiased: bool) -> torch.Tensor:
    den = count - 1 if unbiased else count
    var = m2 / torch.where(den > 0, den, torch.ones_like(den)) * (den > 0)
    positive = var > 0
    # sqrt is evaluated only where var > 0, so its gradient cannot be inf/NaN at 0.
    return torch.where(positive, torch.where(positive, var, torch.ones_like(var)).sqrt(), torch.zeros_like(var))


def _out(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.to(x.dtype) if x.dtype.is_floating_point else t


def segment_std(
    x: torch.Tensor, group_ids: torch.Tensor, *, num_segments: int | None = None, unbiased: bool = True
) -> torch.Tensor:
    """Standard deviation of ``x`` over each segment.

    Formula: ``sqrt(sum_i (x_i - mean)^2 / (n - 1))`` (``n`` without Bessel's correction
    when ``unbiased=False``). A segment of all-equal values has std exactly 0; a
    segment too small for the estimator (one sample when unbiased, or empty) gets 0.
    The gradient is 0 where the std is 0.

    Args:
      x: ``[B, ...]`` values.
      group_ids: ``[B]`` integer segment ids.
      num_segments: as in :func:`segment_sum`.
      unbiased: Bessel-corrected (True, as torch.std) or population std.

    Returns:
      ``[num_segments, ...]`` in ``x.dtype``.

    >>> segment_std(torch.tensor([1.0, 3.0, 100.7, 100.7]), torch.tensor([0, 0, 1, 1]))
    tensor([1.4142, 0.0000])
    """
    n = _check(x, group_ids, num_segments)
    count, _, m2 = _moments(x, group_ids, n, need_m2=True)
    assert m2 is not None
    return _out(_std_from(count, m2, unbiased), x)


def segment_mean_std(
    x: torch.Tensor, group_ids: torch.Tensor, *, num_segments: int | None = None, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segment_mean, segment_std)`` from one pass over the data (shared pivot and sums).

    >>> segment_mean_std(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]))
    (tensor([2., 5.]), tensor([1.4142, 0.0000]))
    """
    n = _check(x, group_ids, num_segments)
    count, mean, m2 = _moments(x, group_ids, n, need_m2=True)
    assert m2 is not None
    return _out(mean, x), _out(_std_from(count, m2, unbiased), x)
