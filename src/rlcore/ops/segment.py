"""Segment (group) reductions over the leading dimension, vectorised with scatter / index_add.

Groups are given by an integer ``group_ids`` tensor ``[B]``; they need not be
contiguous or of equal size. Every result has one row per segment,
``[num_segments, *x.shape[1:]]``; empty segments give 0.

Exactness: statistics accumulate in float64 (float32, bfloat16 and float16 sums of a
group are then exact; float64 input is first shifted by its group's minimum, an exact
pivot), so a group whose values are all equal has a mean equal to that value and a
std of exactly 0 in any dtype — peers that take ``E[x^2] - E[x]^2`` or an unshifted
float32 mean return spurious stds of 1e-7..1e-3 there and turn them into advantages
of size ~1. The two-pass variance stays accurate for groups far from 0, and squares
of float32 spreads up to ``3e38`` cannot overflow (in float32 they overflow beyond
``1.8e19``, which turned the std into inf and the advantages into 0).

Non-finite values: a NaN or inf in a group makes that group's mean and std NaN (and
its members' centred values), never another group's, and never a silent 0.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch

from rlcore._checks import check_floating, check_group_ids, check_integer, check_ndim, check_tensor, host_readable
from rlcore.ops.numerics import acc_dtype, safe_div

__all__ = [
    "segment_centred",
    "segment_count",
    "segment_mean",
    "segment_mean_std",
    "segment_std",
    "segment_sum",
    "segment_zscore",
]


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
        low, high = int(group_ids.min()), int(group_ids.max())  # sync-ok: documented default
        if low < 0:
            raise ValueError(f"group_ids: got ids in [{low}, {high}], expected non-negative ids")
        return high + 1
    if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 0:
        raise ValueError(f"num_segments: got {num_segments!r}, expected a non-negative int")
    check_group_ids(group_ids, num_segments)
    return num_segments


def _sum(x: torch.Tensor, group_ids: torch.Tensor, n: int) -> torch.Tensor:
    if group_ids.dtype not in (torch.int32, torch.int64):  # scatter takes no narrower index (uint8, int16)
        group_ids = group_ids.long()
    out = x.new_zeros((n, *x.shape[1:]))
    if x.dim() == 1:
        # scatter_add: about 1.5x faster than index_add over one dimension on CPU.
        return out.scatter_add(0, group_ids, x)
    return out.index_add(0, group_ids, x)


def _count(group_ids: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    ones = torch.ones(group_ids.shape, dtype=dtype, device=group_ids.device)
    return _sum(ones, group_ids, n)


def _gather(t: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    # index_select, not t[group_ids]: advanced indexing is several times slower.
    return t.index_select(0, group_ids)


def _moments(
    x: torch.Tensor, group_ids: torch.Tensor, n: int, need_m2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(count, mean, dev, m2)``: per segment, and ``dev = x - mean`` per sample, in float64.

    float64 accumulation makes the sums of a constant group of narrower floats exact
    (``k * v`` is exact for ``k < 2^29``), so its mean is the value and its deviations
    are exactly 0 without any shift, and squares of float32 spreads cannot overflow.
    float64 input is first shifted by its group's smallest member (an exact pivot) for
    the same guarantees. A non-finite value makes its own group's statistics NaN and
    no other group's.
    """
    xa = x.to(torch.float64)
    idx = group_ids.long()
    if x.dtype == torch.float64:
        # The pivot is detached: the statistics are exact functions of x whatever the shift.
        index = idx.view(-1, *([1] * (x.dim() - 1))).expand_as(xa)
        pivot = xa.detach().new_zeros((n, *x.shape[1:]))
        pivot = pivot.scatter_reduce(0, index, xa.detach(), "amin", include_self=False)
        xa = xa - _gather(pivot, idx)
    else:
        pivot = None
    count = _count(idx, n, xa.dtype).view(n, *([1] * (x.dim() - 1)))
    mean = _sum(xa, idx, n) / count  # 0 / 0 only in empty segments, which no sample gathers
    dev = xa - _gather(mean, idx)
    mean = torch.where(count > 0, mean, 0.0)
    m2 = _sum(dev * dev, idx, n) if need_m2 else None
    return count, mean if pivot is None else mean + pivot, dev, m2


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
    _, mean, _, _ = _moments(x, group_ids, n, need_m2=False)
    return _out(mean, x)


def _std_from(count: torch.Tensor, m2: torch.Tensor, unbiased: bool) -> torch.Tensor:
    den = count - 1 if unbiased else count
    var = safe_div(m2, den) * (den > 0)
    positive = var > 0
    # sqrt is evaluated only where var > 0, so its gradient cannot be inf/NaN at 0;
    # elsewhere var * 0 is 0, or NaN for a group holding NaN or inf (never a silent 0).
    return torch.where(positive, torch.where(positive, var, torch.ones_like(var)).sqrt(), var * 0)


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
    count, _, _, m2 = _moments(x, group_ids, n, need_m2=True)
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
    count, mean, _, m2 = _moments(x, group_ids, n, need_m2=True)
    assert m2 is not None
    return _out(mean, x), _out(_std_from(count, m2, unbiased), x)


@overload
def segment_centred(
    x: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    num_segments: int | None = ...,
    with_std: Literal[False] = False,
    unbiased: bool = ...,
) -> torch.Tensor: ...


@overload
def segment_centred(
    x: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    num_segments: int | None = ...,
    with_std: Literal[True],
    unbiased: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def segment_centred(
    x: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    num_segments: int | None = None,
    with_std: bool = False,
    unbiased: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Each sample minus its segment's mean (and, with ``with_std``, its segment's std), in one pass.

    The shared core of group-baseline advantages (GRPO, RLOO, GPG, OPO): the deviation
    is taken in float64 before rounding to ``x.dtype``, so a constant group gives
    exactly 0 and ``1e4 + noise`` keeps its resolution.

    Args:
      x: ``[B, ...]`` values.
      group_ids: ``[B]`` integer segment ids.
      num_segments: as in :func:`segment_sum`.
      with_std: also return each sample's segment std (as :func:`segment_std`).
      unbiased: Bessel-corrected std.

    Returns:
      ``centred [B, ...]`` in ``x.dtype``, or ``(centred, std)`` with ``std [B, ...]``
      gathered per sample.

    >>> segment_centred(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]), with_std=True)
    (tensor([-1.,  1.,  0.]), tensor([1.4142, 1.4142, 0.0000]))
    """
    n = _check(x, group_ids, num_segments)
    count, _, dev, m2 = _moments(x, group_ids, n, need_m2=with_std)
    if not with_std:
        return _out(dev, x)
    assert m2 is not None
    if x.requires_grad:
        std = _std_from(count, m2, unbiased)
    else:
        # Without a gradient to protect, fewer passes: sqrt(0) = 0 for constant groups
        # and for groups too small for the estimator (m2 = 0 there), NaN stays NaN.
        std = (m2 / (count - 1 if unbiased else count).clamp(min=1)).sqrt()
    return _out(dev, x), _out(_gather(std, group_ids.long()), x)


def _check_layout(x: torch.Tensor, group_ids: torch.Tensor | None, group_size: int) -> int:
    """Validate a declared contiguous layout; return the number of groups ``B / group_size``."""
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x: got a 0-D tensor, expected [B, ...]")
    b = x.shape[0]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or b % group_size:
        raise ValueError(f"group_size: got {group_size!r}, expected a positive int dividing the batch size {b}")
    if group_ids is None:
        return b // group_size
    check_ndim("group_ids", group_ids, 1)
    check_integer("group_ids", group_ids)
    if group_ids.shape[0] != b:
        raise ValueError(f"group_ids: got shape {tuple(group_ids.shape)}, expected ({b},) (the leading dimension of x)")
    # Read only where that stalls nothing (a CPU tensor in eager mode), as the id range check.
    if b and host_readable(group_ids):
        # Each row's smallest and largest id must be its row number: one reduction with a
        # [G] result (no [B] temporary, and no integer division over B, several times slower).
        low, high = torch.aminmax(group_ids.view(-1, group_size), dim=1)
        rows = torch.arange(b // group_size, device=group_ids.device, dtype=group_ids.dtype)
        if not (torch.equal(low, rows) and torch.equal(high, rows)):  # sync-ok: a CPU tensor in eager mode
            raise ValueError(
                f"group_ids: got ids that are not the contiguous layout declared by group_size={group_size}, "
                f"expected group_ids[i] == i // {group_size}"
            )
    return b // group_size


def segment_zscore(
    x: torch.Tensor,
    group_ids: torch.Tensor | None,
    *,
    num_segments: int | None = None,
    group_size: int | None = None,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> torch.Tensor:
    """Each sample's z-score in its segment, ``(x - mean) / (std + eps)``: the GRPO advantage.

    Same statistics as :func:`segment_centred` with ``with_std=True`` (two passes in
    float64, so a constant group, or a group too small for the estimator, gives
    exactly 0 and spreads up to ``3e38`` do not overflow; a non-finite value makes its
    own segment NaN and no other), with the scale applied per segment before one
    gather. ``eps = 0`` divides by the std where it is positive and gives 0 elsewhere.

    Args:
      x: ``[B, ...]`` values.
      group_ids: ``[B]`` integer segment ids; may be ``None`` when ``group_size`` is given.
      num_segments: as in :func:`segment_sum`.
      group_size: declares the layout ``group_ids[i] == i // group_size`` (contiguous
        groups of equal size, as ``n_samples`` responses per prompt are stored); the
        statistics are then a reshape and row reductions. Given ids are checked
        against it on CPU tensors in eager mode and trusted elsewhere (no host sync).
      eps: added to the std (>= 0).
      unbiased: Bessel-corrected std.

    Returns:
      ``[B, ...]`` in ``x.dtype``.

    >>> segment_zscore(torch.tensor([1.0, 3.0, 5.0, 5.0]), torch.tensor([0, 0, 1, 1]), eps=0.0)
    tensor([-0.7071,  0.7071,  0.0000,  0.0000])
    >>> segment_zscore(torch.tensor([1.0, 3.0, 5.0, 5.0]), None, group_size=2, eps=0.0)
    tensor([-0.7071,  0.7071,  0.0000,  0.0000])
    """
    if group_size is not None:
        n = _check_layout(x, group_ids, group_size)
        if num_segments is not None and num_segments != n:
            raise ValueError(f"num_segments: got {num_segments!r}, expected None or {n} (B / group_size)")
    elif group_ids is None:
        raise ValueError("group_ids: got None, expected a [B] integer tensor (or declare the layout with group_size)")
    else:
        n = _check(x, group_ids, num_segments)
    check_floating("x", x)
    if not eps >= 0.0 or eps == float("inf"):
        raise ValueError(f"eps: got {eps!r}, expected a finite number >= 0")
    if group_size is not None and (x.requires_grad or x.dtype == torch.float64):
        group_ids = torch.arange(x.shape[0], device=x.device) // group_size
    if x.requires_grad or x.dtype == torch.float64:
        # The general path: a safe sqrt gradient, and the exact pivot float64 input needs.
        assert group_ids is not None
        count, _, dev, m2 = _moments(x, group_ids, n, need_m2=True)
        assert m2 is not None
        std = _std_from(count, m2, unbiased)
        scale = 1.0 / (std + eps) if eps > 0 else torch.where(std > 0, 1.0 / torch.where(std > 0, std, 1.0), 0.0)
        return _out(dev * _gather(scale, group_ids.long()), x)
    # No gradient, float32 or narrower: float64 sums are exact for a constant group.
    xa = x.to(torch.float64)
    if group_size is not None:
        rows = xa.view(n, group_size, *x.shape[1:])
        # In place: xa is this function's own copy. A constant row's float64 sum k * v is exact.
        dev = rows.sub_(rows.mean(1, keepdim=True))
        den = group_size - 1 if unbiased else group_size
        # sqrt(sum dev^2) in one reduction; float64 squares cannot overflow.
        std = torch.linalg.vector_norm(dev, dim=1, keepdim=True).mul_(1.0 / math.sqrt(max(den, 1)))
        return dev.mul_(_inverse_scale(std, eps)).view(x.shape).to(x.dtype)
    assert group_ids is not None
    idx = group_ids.long()
    count = _count(idx, n, xa.dtype).view(n, *([1] * (x.dim() - 1)))
    # In place (xa is this function's own copy); 0 / 0 only in empty segments, never gathered.
    dev = xa.sub_(_gather(_sum(xa, idx, n).div_(count), idx))
    m2 = _sum(torch.mul(dev, dev), idx, n)
    # sqrt(0) = 0 for constant groups and groups too small for the estimator.
    std = m2.div_((count - 1 if unbiased else count).clamp_(min=1)).sqrt_()
    return dev.mul_(_gather(_inverse_scale(std, eps), idx)).to(x.dtype)


def _inverse_scale(std: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / (std + eps)``; with ``eps = 0``, ``1 / std`` where positive and 0 elsewhere (NaN stays NaN)."""
    if eps > 0:
        return std.add_(eps).reciprocal_()
    return torch.where(std > 0, std.reciprocal(), torch.where(std == 0, 0.0, std))
