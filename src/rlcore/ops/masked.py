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


def _mean_acc(x: torch.Tensor, mask: torch.Tensor, dim: Dim, keepdim: bool) -> tuple[torch.Tensor, torch.Tensor]:
    xm, m = _prepare(x, mask)
    count = _reduce(m, dim, keepdim)
    return _safe_div(_reduce(xm, dim, keepdim), count), count


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, *, keepdim: bool = False) -> torch.Tensor:
    """Mean of ``x`` over the elements where ``mask`` is set; 0 when the mask is empty.

    Formula: ``sum(x * m) / sum(m)``.

    >>> masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1, 1], [0, 0]]), dim=1)
    tensor([2., 0.])
    """
    mean, _ = _mean_acc(x, mask, dim, keepdim)
    return mean.to(x.dtype)


def _var_acc(
    x: torch.Tensor, mask: torch.Tensor, dim: Dim, keepdim: bool, unbiased: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    mean, count = _mean_acc(x, mask, dim, True)
    m = mask.to(mean.dtype)
    dev = torch.where(m != 0, x.to(mean.dtype) - mean, 0.0)
    m2 = _reduce(dev * dev * m, dim, keepdim)
    if not keepdim:
        count = count if dim is None else count.squeeze(dim)
        mean = mean.reshape(()) if dim is None else mean.squeeze(dim)
    den = count - 1 if unbiased else count
    return _safe_div(m2, den) * (den > 0), mean


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, *, unbiased: bool = True, keepdim: bool = False
) -> torch.Tensor:
    """Variance of ``x`` over the masked elements (two-pass, float32 accumulation).

    Unbiased (Bessel-corrected) by default, as in verl and TRL. Fewer than two
    counted elements (one for ``unbiased=False``) give 0 rather than NaN.

    >>> masked_var(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0]))
    tensor(2.)
    """
    var, _ = _var_acc(x, mask, dim, keepdim, unbiased)
    return var.to(x.dtype)


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
    var, mean = _var_acc(values, mask, dim, True, unbiased)
    x = values.to(var.dtype)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask != 0, out, 0.0).to(values.dtype)
