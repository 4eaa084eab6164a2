"""Masked reductions over token tensors: sum, mean, variance, whitening.

The mask is an explicit tensor of the same shape as the values (bool or 0/1 numbers;
fractional weights act as weights). Values at mask 0 never reach the result, even
when they are ``inf`` or ``nan`` (padding). An all-zero mask gives 0, never NaN,
without a host sync. Accumulation is float32 (float64 for float64 inputs); results
come back in the input dtype.
"""

from __future__ import annotations

import torch

from rlcore._checks import check_floating, check_same_shape, check_tensor
from rlcore.ops._accum import acc_dtype

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten"]

Dim = int | tuple[int, ...] | None


def _prepare(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("x", x)
    check_same_shape("mask", mask, "x", x)
    acc = acc_dtype(x.dtype)
    m = mask.to(acc)
    xm = torch.where(m != 0, x.to(acc) * m, 0.0)
    return xm, m


def _reduce(t: torch.Tensor, dim: Dim, keepdim: bool) -> torch.Tensor:
    if dim is None:
        return t.sum()
    return t.sum(dim=dim, keepdim=keepdim)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    # The denominator is replaced where it is 0 (the numerator is 0 there too), so
    # neither the value nor its gradient can become NaN.
    return num / torch.where(den > 0, den, torch.ones_like(den))


def _shifted(
    x: torch.Tensor, mask: torch.Tensor, dim: Dim
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d, m, pivot, count)``: values shifted by a per-slice pivot, the weights, the pivot, the count.

    The pivot is the smallest counted value of the slice (0 where nothing counts).
    Shifting by an element of the data makes the mean of a constant slice exact and
    keeps the two-pass variance accurate for values far from 0 (1e4 + noise in
    float32); statistics do not depend on the shift, so it carries no gradient.
    Reductions keep their dimensions.
    """
    check_tensor("x", x)
    check_same_shape("mask", mask, "x", x)
    acc = acc_dtype(x.dtype)
    m = mask.to(acc)
    xa = x.to(acc)
    if x.numel() == 0:
        # amin has no identity for an empty reduction; the sum's shape is the right one.
        pivot = _reduce(xa.detach(), dim, True)
    else:
        xs = torch.where(m != 0, xa.detach(), torch.inf)
        low = xs.amin() if dim is None else xs.amin(dim=dim, keepdim=True)
        pivot = torch.where(torch.isfinite(low), low, 0.0)
    d = torch.where(m != 0, xa - pivot, 0.0)
    return d, m, pivot, _reduce(m, dim, True)


def _moments(
    x: torch.Tensor, mask: torch.Tensor, dim: Dim, unbiased: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dev, m, mean, var)`` with kept dims; ``dev`` is ``x - mean`` computed without rounding the mean."""
    d, m, pivot, count = _shifted(x, mask, dim)
    mean_d = _safe_div(_reduce(d * m, dim, True), count)
    dev = torch.where(m != 0, d - mean_d, 0.0)
    den = count - 1 if unbiased else count
    var = _safe_div(_reduce(dev * dev * m, dim, True), den) * (den > 0)
    return dev, m, pivot + mean_d, var


def _squeeze(t: torch.Tensor, dim: Dim, keepdim: bool) -> torch.Tensor:
    if keepdim:
        return t
    return t.reshape(()) if dim is None else t.squeeze(dim)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, *, keepdim: bool = False) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set.

    Args:
      x: values, any shape.
      mask: same shape as ``x``; 1 (True) marks an element that counts.
      dim: dimension(s) to reduce; all when ``None``.
      keepdim: keep reduced dimensions as size 1.

    Returns:
      The masked sum, in ``x.dtype``.

    >>> masked_sum(torch.tensor([1.0, 2.0, float("inf")]), torch.tensor([1, 1, 0]))
    tensor(3.)
    """
    xm, _ = _prepare(x, mask)
    return _reduce(xm, dim, keepdim).to(x.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, *, keepdim: bool = False) -> torch.Tensor:
    """Mean of ``x`` over the elements where ``mask`` is set; 0 when the mask is empty.

    Formula: ``sum(x * m) / sum(m)``.

    >>> masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1, 1], [0, 0]]), dim=1)
    tensor([2., 0.])
    """
    d, m, pivot, count = _shifted(x, mask, dim)
    mean = pivot + _safe_div(_reduce(d * m, dim, True), count)
    return _squeeze(mean, dim, keepdim).to(x.dtype)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, *, unbiased: bool = True, keepdim: bool = False
) -> torch.Tensor:
    """Variance of ``x`` over the masked elements (two-pass, float32 accumulation).

    Unbiased (Bessel-corrected) by default, as in verl and TRL. Fewer than two
    counted elements (one for ``unbiased=False``) give 0 rather than NaN.

    >>> masked_var(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0]))
    tensor(2.)
    """
    _, _, _, var = _moments(x, mask, dim, unbiased)
    return _squeeze(var, dim, keepdim).to(x.dtype)


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    dim: Dim = None,
    unbiased: bool = True,
) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit variance over the masked elements.

    Formula: ``(x - mean) / sqrt(var + eps)`` with the unbiased masked variance;
    with ``shift_mean=False`` the mean is added back (scale only). Elements outside
    the mask come back as 0.

    Args:
      values: any shape, floating point.
      mask: same shape; 1 marks an element that counts.
      shift_mean: subtract the mean (True) or only rescale (False).
      eps: added to the variance before the square root.
      dim: dimension(s) the statistics are taken over; all when ``None``.
      unbiased: Bessel-corrected variance.

    >>> masked_whiten(torch.tensor([1.0, 3.0, 9.0]), torch.tensor([1, 1, 0]))
    tensor([-0.7071,  0.7071,  0.0000])
    """
    check_floating("values", values)
    dev, m, mean, var = _moments(values, mask, dim, unbiased)
    # A constant slice with eps=0 has var + eps == 0: its deviations are exactly 0 and
    # stay 0 (not 0 * inf = NaN), in value and gradient.
    v = var + eps
    positive = v > 0
    out = dev * torch.where(positive, torch.rsqrt(torch.where(positive, v, torch.ones_like(v))), 0.0)
    if not shift_mean:
        out = out + mean
    return torch.where(m != 0, out, 0.0).to(values.dtype)
