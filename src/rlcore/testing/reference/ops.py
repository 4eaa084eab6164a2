"""Loop references for :mod:`rlcore.ops` (masked, segment, scan), in exact rational arithmetic.

Statistics are computed with :class:`fractions.Fraction`, so a constant group has a
mean equal to its value and a variance of exactly 0, and a float64 result is the
correctly rounded value of the true statistic.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

__all__ = [
    "discounted_cumsum_ref",
    "masked_mean_ref",
    "masked_sum_ref",
    "masked_var_ref",
    "masked_whiten_ref",
    "masked_zero_ref",
    "reverse_linear_scan_ref",
    "segment_mean_ref",
    "segment_std_ref",
    "segment_sum_ref",
]


def _rows(x: torch.Tensor, mask: torch.Tensor, dim: int | None) -> tuple[list[list[float]], list[list[float]], tuple]:
    """Move ``dim`` last and return rows of values and mask weights, plus the output shape."""
    if dim is None:
        return [x.double().flatten().tolist()], [mask.double().flatten().tolist()], ()
    xd = x.double().movedim(dim, -1)
    md = mask.double().movedim(dim, -1)
    out_shape = tuple(xd.shape[:-1])
    return xd.reshape(-1, xd.shape[-1]).tolist(), md.reshape(-1, md.shape[-1]).tolist(), out_shape


def _stats(xs: list[float], ms: list[float]) -> tuple[Fraction, Fraction, Fraction]:
    """Exact (weighted count, sum, mean) over the counted elements."""
    count = Fraction(0)
    total = Fraction(0)
    for v, m in zip(xs, ms):
        if m != 0:
            count += Fraction(m)
            total += Fraction(v) * Fraction(m)
    mean = total / count if count > 0 else Fraction(0)
    return count, total, mean


def _var(xs: list[float], ms: list[float], unbiased: bool) -> tuple[Fraction, Fraction]:
    count, _, mean = _stats(xs, ms)
    m2 = sum((Fraction(m) * (Fraction(v) - mean) ** 2 for v, m in zip(xs, ms) if m != 0), Fraction(0))
    den = count - 1 if unbiased else count
    return (m2 / den if den > 0 else Fraction(0)), mean


def masked_sum_ref(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Loop reference of :func:`rlcore.ops.masked_sum`, written for clarity."""
    rows, ms, shape = _rows(x, mask, dim)
    return torch.tensor([float(_stats(r, m)[1]) for r, m in zip(rows, ms)], dtype=torch.float64).reshape(shape)


def masked_mean_ref(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Loop reference of :func:`rlcore.ops.masked_mean`, written for clarity."""
    rows, ms, shape = _rows(x, mask, dim)
    return torch.tensor([float(_stats(r, m)[2]) for r, m in zip(rows, ms)], dtype=torch.float64).reshape(shape)


def masked_var_ref(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, *, unbiased: bool = True
) -> torch.Tensor:
    """Loop reference of :func:`rlcore.ops.masked_var`, written for clarity."""
    rows, ms, shape = _rows(x, mask, dim)
    return torch.tensor([float(_var(r, m, unbiased)[0]) for r, m in zip(rows, ms)], dtype=torch.float64).reshape(shape)


def masked_whiten_ref(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8, dim: int | None = None
) -> torch.Tensor:
    """Whitened values (masked-out elements are 0), in float64."""
    xd = x.double().movedim(dim, -1) if dim is not None else x.double().reshape(1, -1)
    md = mask.double().movedim(dim, -1) if dim is not None else mask.double().reshape(1, -1)
    flat_x = xd.reshape(-1, xd.shape[-1]).tolist()
    flat_m = md.reshape(-1, md.shape[-1]).tolist()
    out = []
    for r, m in zip(flat_x, flat_m):
        var, mean = _var(r, m, True)
        inv = 1.0 / math.sqrt(float(var) + eps)
        row = []
        for v, w in zip(r, m):
            if w == 0:
                row.append(0.0)
            else:
                z = (v - float(mean)) * inv
                row.append(z + float(mean) if not shift_mean else z)
        out.append(row)
    res = torch.tensor(out, dtype=torch.float64).reshape(xd.shape)
    return res.movedim(-1, dim) if dim is not None else res.reshape(x.shape)


def _groups(x: torch.Tensor, group_ids: torch.Tensor, num_segments: int | None) -> list[list[list[float]]]:
    n = int(group_ids.max()) + 1 if num_segments is None else num_segments
    flat = x.double().reshape(x.shape[0], -1).tolist()
    groups: list[list[list[float]]] = [[] for _ in range(n)]
    for row, g in zip(flat, group_ids.tolist()):
        groups[g].append(row)
    return groups


def _segment(x: torch.Tensor, group_ids: torch.Tensor, num_segments: int | None, stat) -> torch.Tensor:  # type: ignore[no-untyped-def]
    groups = _groups(x, group_ids, num_segments)
    width = 1
    for s in x.shape[1:]:
        width *= s
    out = []
    for members in groups:
        out.append([float(stat([m[j] for m in members])) for j in range(width)])
    return torch.tensor(out, dtype=torch.float64).reshape(len(groups), *x.shape[1:])


def segment_sum_ref(x: torch.Tensor, group_ids: torch.Tensor, *, num_segments: int | None = None) -> torch.Tensor:
    """Loop reference of :func:`rlcore.ops.segment_sum`, written for clarity."""
    return _segment(x, group_ids, num_segments, lambda v: sum((Fraction(a) for a in v), Fraction(0)))


def segment_mean_ref(x: torch.Tensor, group_ids: torch.Tensor, *, num_segments: int | None = None) -> torch.Tensor:
    """Loop reference of :func:`rlcore.ops.segment_mean`, written for clarity."""
    return _segment(x, group_ids, num_segments, lambda v: _stats(v, [1.0] * len(v))[2])


def segment_std_ref(
    x: torch.Tensor, group_ids: torch.Tensor, *, num_segments: int | None = None, unbiased: bool = True
) -> torch.Tensor:
    """Loop reference of :func:`rlcore.ops.segment_std`, written for clarity."""
    return _segment(x, group_ids, num_segments, lambda v: math.sqrt(float(_var(v, [1.0] * len(v), unbiased)[0])))


def reverse_linear_scan_ref(x: torch.Tensor, factors: torch.Tensor | float) -> torch.Tensor:
    """``y_t = x_t + c_t * y_{t+1}`` one step at a time, in float64."""
    xd = x.double()
    c = torch.as_tensor(factors, dtype=torch.float64).expand(xd.shape)
    rows_x = xd.reshape(-1, xd.shape[-1]).tolist()
    rows_c = c.reshape(-1, c.shape[-1]).tolist()
    out = []
    for rx, rc in zip(rows_x, rows_c):
        acc = 0.0
        row = [0.0] * len(rx)
        for t in range(len(rx) - 1, -1, -1):
            acc = rx[t] + rc[t] * acc
            row[t] = acc
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(xd.shape)


def discounted_cumsum_ref(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """Loop reference of :func:`rlcore.ops.discounted_cumsum`, written for clarity."""
    return reverse_linear_scan_ref(x, gamma)


def masked_zero_ref(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """:func:`rlcore.ops.masked_zero` element by element: ``x`` where ``keep``, ``+0.0`` elsewhere."""
    keep = keep.expand(x.shape)
    out = torch.empty_like(x)
    for i in range(x.numel()):
        idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), x.shape))
        out[idx] = x[idx] if bool(keep[idx]) else 0.0
    return out
