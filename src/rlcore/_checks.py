"""Shared input checks: every public function validates at entry with these.

Each raises ``ValueError`` naming the argument, what it got and what was expected.
They read shapes and dtypes only (static metadata), so they never sync a device and
they trace cleanly under ``torch.compile``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = [
    "check_choice",
    "check_count",
    "check_counts",
    "check_floating",
    "check_group_ids",
    "check_integer",
    "check_ndim",
    "check_positive",
    "check_same_shape",
    "check_shape",
    "check_tensor",
    "finite_number",
    "finite_weight",
    "host_readable",
    "value_bounds",
]


def _fmt(shape: Iterable[Any]) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def check_tensor(name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: got {type(x).__name__}, expected a torch.Tensor")
    return x


def check_ndim(name: str, x: torch.Tensor, ndim: int | Sequence[int]) -> None:
    check_tensor(name, x)
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if x.dim() not in allowed:
        want = " or ".join(f"{d}-D" for d in allowed)
        raise ValueError(f"{name}: got shape {_fmt(x.shape)} ({x.dim()}-D), expected {want}")


def check_shape(name: str, x: torch.Tensor, shape: Sequence[int | None], *, what: str = "") -> None:
    """``shape`` may hold ``None`` as a wildcard for one dimension."""
    check_tensor(name, x)
    ok = x.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, x.shape))
    if not ok:
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name}: got shape {_fmt(x.shape)}, expected {_fmt(shape)}{extra}")


def check_same_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    check_tensor(name, x)
    if x.shape != ref.shape:
        raise ValueError(f"{name}: got shape {_fmt(x.shape)}, expected {_fmt(ref.shape)} (the shape of {ref_name})")


def check_integer(name: str, x: torch.Tensor) -> None:
    check_tensor(name, x)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"{name}: got dtype {x.dtype}, expected an integer dtype (torch.int64 or torch.int32)")


def check_floating(name: str, x: torch.Tensor) -> None:
    check_tensor(name, x)
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name}: got dtype {x.dtype}, expected a floating-point dtype")


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}: got {value!r}, expected one of {', '.join(repr(a) for a in allowed)}")


def check_positive(name: str, value: float, *, strict: bool = True, finite: bool = False) -> None:
    """``value > 0`` (``>= 0`` with ``strict=False``; and not ``inf`` with ``finite=True``); NaN fails all.

    ``value`` is a real number (not a bool, not a string) or a tensor.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        raise ValueError(f"{name}: got {type(value).__name__} {value!r}, expected a number")
    ok = value > 0 if strict else value >= 0
    if finite:
        ok = ok and value < math.inf
    if not ok:
        want = ("> 0" if strict else ">= 0") + (" and finite" if finite else "")
        raise ValueError(f"{name}: got {value!r}, expected a number {want}")


def finite_number(value: float) -> bool:
    """``value`` is finite; an int past float's range is not (``math.isfinite`` raises on it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def finite_weight(value: Any) -> bool:
    """``value`` is a real number (not a bool) finite in float32: a larger weight makes float32 scores inf (0 nan)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and finite_number(value)
        and abs(value) <= torch.finfo(torch.float32).max
    )


def check_count(name: str, count: Any) -> None:
    """A global count: ``None``, a finite number ``>= 0``, or a 0-d / one-element real tensor.

    A tensor's value is read only when that stalls nothing (a CPU tensor in eager
    mode); elsewhere only its shape and dtype are checked.
    """
    if count is None:
        return
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(f"{name}: got a tensor of shape {_fmt(count.shape)}, expected a scalar")
        if count.dtype == torch.bool or count.dtype.is_complex:
            raise ValueError(f"{name}: got dtype {count.dtype}, expected an integer or floating-point count")
        if host_readable(count):
            value = count.reshape(()).item()  # sync-ok: a CPU tensor in eager mode
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: got {value!r}, expected a finite count >= 0")
        return
    if isinstance(count, bool) or not isinstance(count, (int, float)):
        raise ValueError(f"{name}: got {type(count).__name__}, expected None, a number or a scalar tensor")
    if not (math.isfinite(count) and count >= 0):
        raise ValueError(f"{name}: got {count!r}, expected a finite count >= 0")


def host_readable(x: torch.Tensor) -> bool:
    """True where reading ``x``'s values stalls nothing: a CPU tensor in eager mode (not while compiling)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def value_bounds(x: torch.Tensor) -> tuple[Any, Any] | None:
    """``(min, max)`` of ``x``'s non-NaN values as host numbers, or None when there are none or reading would stall."""
    if not host_readable(x):
        return None
    if x.dtype.is_floating_point:
        x = x[~x.isnan()]
    if x.numel() == 0:
        return None
    low, high = torch.aminmax(x)
    return low.item(), high.item()  # sync-ok: a CPU tensor in eager mode


def check_counts(name: str, counts: torch.Tensor) -> None:
    """Every count ``>= 0`` where :func:`value_bounds` can read them (NaN passes and stays in its own row)."""
    bounds = value_bounds(counts)
    if bounds is not None and bounds[0] < 0:
        raise ValueError(f"{name}: got values in [{bounds[0]}, {bounds[1]}], expected counts >= 0")


def check_group_ids(group_ids: torch.Tensor, num_segments: int) -> None:
    """Every id in ``[0, num_segments)``: read only where that stalls nothing (a CPU tensor in eager mode).

    On an accelerator, or while compiling, the values are not read (an out-of-range id
    then fails inside the scatter kernel); the shape and dtype checks still run.
    """
    bounds = value_bounds(group_ids)
    if bounds is None:
        return
    low, high = bounds
    if low < 0 or high >= num_segments:
        raise ValueError(
            f"group_ids: got ids in [{low}, {high}], expected ids in [0, {num_segments}) "
            f"(num_segments/num_groups is {num_segments}; renumber the groups 0..G-1)"
        )
