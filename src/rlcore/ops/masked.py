"""Masked reductions over token tensors: sum, mean, variance, whitening.

The mask is an explicit tensor of the same shape as the values (bool or 0/1 numbers;
fractional weights act as weights). Values at mask 0 never reach the result, even
when they are ``inf`` or ``nan`` (padding). An all-zero mask gives 0, never NaN,
without a host sync. Accumulation is float32 (float64 for float64 inputs); results
come back in the input dtype.
"""

from __future__ import annotations

import torch

from rlcore._checks import check_floating, check_positive, check_same_shape, check_tensor
from rlcore.ops.numerics import acc_dtype, pow2_scale, safe_div

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten", "pivot_shift"]

Dim = int | tuple[int, ...] | None


def _check_dim(x: torch.Tensor, dim: Dim) -> None:
    dims = () if dim is None else (dim,) if isinstance(dim, int) else dim
    if not isinstance(dims, tuple) or not all(isinstance(d, int) and -x.dim() <= d < max(x.dim(), 1) for d in dims):
        raise ValueError(f"dim: got {dim!r}, expected dimensions of a {x.dim()}-D x (None, an int or a tuple of ints)")


def _prepare(x: torch.Tensor, mask: torch.Tensor, dim: Dim) -> tuple[torch.Tensor, torch.Tensor]:
    # Integer values would come back truncated (a float32 mean cast to int64) or rounded (sums beyond 2**24).
    check_floating("x", x)
    _check_dim(x, dim)
    check_same_shape("mask", mask, "x", x)
    acc = acc_dtype(x.dtype)
    m = mask.to(acc)
    xm = torch.where(m != 0, x.to(acc) * m, 0.0)
    return xm, m


def _reduce(t: torch.Tensor, dim: Dim, keepdim: bool) -> torch.Tensor:
    if dim is None:
        return t.sum()
    return t.sum(dim=dim, keepdim=keepdim)


def pivot_shift(
    x: torch.Tensor, mask: torch.Tensor, dim: Dim = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values shifted by each slice's smallest counted value (an exact pivot), with the weights and counts.

    The shift the masked statistics share: subtracting an element of the data makes
    the mean of a constant slice exact and keeps the two-pass variance accurate for
    values far from 0 (``1e4 + noise`` in float32). Statistics do not depend on the
    shift, so the pivot carries no gradient. Reductions keep their dimensions.

    Args:
      x: values, any shape.
      mask: same shape; nonzero marks an element that counts (fractional values weigh).
      dim: dimension(s) of a slice; all when ``None``.

    Returns:
      ``(d, m, pivot, count)`` in the accumulation dtype: ``d = x - pivot`` where the
      mask is set and 0 elsewhere, ``m`` the mask as weights, ``pivot`` (0 where
      nothing counts) and ``count = sum(m)`` with kept dimensions.

    >>> d, m, pivot, count = pivot_shift(torch.tensor([5.0, 3.0, -9.0]), torch.tensor([1, 1, 0]))
    >>> d, pivot, count
    (tensor([2., 0., 0.]), tensor(3.), tensor(2.))
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dev, m, mean, var_s, scale)`` with kept dims; ``var = var_s * scale**2``.

    ``dev`` is ``x - mean`` computed without rounding the mean. The squares are taken
    of ``dev / scale``, with ``scale`` a power of two near the slice's mean deviation
    from its pivot, so a spread beyond ``sqrt(float32 max) ~ 1.8e19`` does not
    overflow (it used to turn the variance into inf and the whitened values into 0).
    """
    d, m, pivot, count = pivot_shift(x, mask, dim)
    mean_d = safe_div(_reduce(d * m, dim, True), count)
    dev = torch.where(m != 0, d - mean_d, 0.0)
    scale = pow2_scale(mean_d)
    dev_s = dev / scale
    den = count - 1 if unbiased else count
    var_s = safe_div(_reduce(dev_s * dev_s * m, dim, True), den) * (den > 0)
    return dev, m, pivot + mean_d, var_s, scale


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
    xm, _ = _prepare(x, mask, dim)
    return _reduce(xm, dim, keepdim).to(x.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, *, keepdim: bool = False) -> torch.Tensor:
    """Mean of ``x`` over the elements where ``mask`` is set; 0 when the mask is empty.

    Formula: ``sum(x * m) / sum(m)``.

    >>> masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1, 1], [0, 0]]), dim=1)
    tensor([2., 0.])
    """
    check_floating("x", x)
    _check_dim(x, dim)
    d, m, pivot, count = pivot_shift(x, mask, dim)
    mean = pivot + safe_div(_reduce(d * m, dim, True), count)
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
    check_floating("x", x)
    _check_dim(x, dim)
    _, _, _, var_s, scale = _moments(x, mask, dim, unbiased)
    return _squeeze(var_s * scale * scale, dim, keepdim).to(x.dtype)


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
    check_positive("eps", eps, strict=False, finite=True)
    _check_dim(values, dim)
    dev, m, mean, var_s, scale = _moments(values, mask, dim, unbiased)
    # In units of scale: (dev / scale) / sqrt(var / scale^2 + eps / scale^2). A constant
    # slice with eps=0 has var + eps == 0: its deviations are exactly 0 and stay 0 (not
    # 0 * inf = NaN), in value and gradient.
    v = var_s + eps / (scale * scale)
    positive = v > 0
    out = (dev / scale) * torch.where(positive, torch.rsqrt(torch.where(positive, v, torch.ones_like(v))), 0.0)
    if not shift_mean:
        out = out + mean
    return torch.where(m != 0, out, 0.0).to(values.dtype)
