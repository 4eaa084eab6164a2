"""Numerical helpers every reduction shares: the accumulation dtype, safe division, power-of-two scaling.

Public so that every layer above ``ops`` uses the same rules instead of its own copy.
"""

from __future__ import annotations

import torch

__all__ = ["acc_dtype", "pow2_scale", "safe_div", "saturating_cast"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions accumulate in: float64 stays float64, every narrower float (and any integer) float32.

    >>> acc_dtype(torch.bfloat16), acc_dtype(torch.float64)
    (torch.float32, torch.float64)
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` where ``den > 0``, else ``num`` (callers pass ``num = 0`` there): never NaN from a zero count.

    The denominator is replaced where it is not positive, so neither the value nor
    its gradient can become NaN or inf on an empty slice.

    >>> safe_div(torch.tensor([3.0, 0.0]), torch.tensor([2.0, 0.0]))
    tensor([1.5000, 0.0000])
    """
    return num / torch.where(den > 0, den, torch.ones_like(den))


def pow2_scale(t: torch.Tensor) -> torch.Tensor:
    """A power of two near ``|t|`` (1 where ``t`` is 0 or not finite), detached.

    Dividing by a power of two is exact, so statistics taken on ``x / scale`` and
    multiplied back agree with the unscaled ones wherever those do not overflow; the
    squares of values up to ``3e38`` then stay finite in float32.

    >>> pow2_scale(torch.tensor([3.0, 0.0, 1e30, float("nan")]))
    tensor([2.0000e+00, 1.0000e+00, 6.3383e+29, 1.0000e+00])
    """
    a = t.detach().abs()
    ok = torch.isfinite(a) & (a > 0)
    return torch.where(ok, torch.exp2(torch.floor(torch.log2(torch.where(ok, a, 1.0)))), 1.0)


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, with finite values beyond ``dtype``'s range clamped to its largest finite value.

    Losses are computed in float32 and returned in the input dtype; in float16 (largest
    finite 65504) a plain cast turns a large but finite loss into ``inf``. NaN and
    ``inf`` inputs stay what they are.

    >>> saturating_cast(torch.tensor([1e6, -1e6, 1.0]), torch.float16).tolist()  # sync-ok: doctest output
    [65504.0, -65504.0, 1.0]
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        # An integer cast wraps around (1e20 -> int32 gave -2**31): there is no saturating one to offer.
        raise ValueError(f"dtype: got {dtype}, expected a floating-point dtype")
    if x.dtype == dtype:
        return x
    big = torch.finfo(dtype).max
    # bfloat16 shares float32's exponent range: only the narrow formats need the clamp.
    if big > 1e30 or torch.finfo(x.dtype).max <= big:
        return x.to(dtype)
    return torch.where(torch.isfinite(x), x.clamp(-big, big), x).to(dtype)
