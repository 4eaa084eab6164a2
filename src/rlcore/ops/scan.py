"""Reverse linear recurrences over the last dimension: ``y_t = x_t + c_t * y_{t+1}``.

This is the kernel under discounted returns, GAE and REINFORCE++ reward-to-go.
It runs as a blocked parallel scan: the time axis is cut into blocks, each block is
scanned by recursive doubling (O(log block) vectorised steps), the block carries are
scanned the same way, and one fix-up pass joins them. No Python loop over T, no
division by cumulative products (which underflow at long horizons), float32
accumulation for narrower inputs. The backward pass is itself a (forward) linear scan,
written as a custom autograd function so no per-step intermediates are kept.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlcore._checks import check_floating, check_tensor
from rlcore.ops.numerics import acc_dtype

__all__ = ["discounted_cumsum", "reverse_linear_scan"]

_BLOCK = 64


def _doubling(a: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scan each last-dim row; returns ``(y, C)`` with ``C_t = prod_{r >= t} c_r``.

    Step k composes each position's affine map with the one k steps ahead; positions
    within k of the end have nothing ahead (y = 0 there, factor 1) and are copied.
    Two buffers per operand are swapped between steps: on the CPU, fresh large
    allocations cost page faults that would otherwise dominate the run time.
    """
    length = a.shape[-1]
    if length <= 1:
        return a.clone(), c.clone()
    # Step 1 reads the caller's tensors, so both buffers are fresh: inputs are never written.
    a_bufs = (torch.empty_like(a), torch.empty_like(a))
    c_bufs = (torch.empty_like(c), torch.empty_like(c))
    k, i = 1, 0
    while k < length:
        a_dst, c_dst = a_bufs[i], c_bufs[i]
        # In-place updates of buffer views (not out=, which dynamo rejects on views).
        a_dst.copy_(a)
        a_dst[..., :-k].addcmul_(c[..., :-k], a[..., k:])
        c_dst.copy_(c)
        c_dst[..., :-k].mul_(c[..., k:])
        a, c = a_dst, c_dst
        k, i = 2 * k, 1 - i
    return a, c


def _scan(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Blocked reverse scan of full-shape accumulation-dtype tensors."""
    length = x.shape[-1]
    if length == 1:
        return x.clone()  # autograd must not see the input returned as the output
    if length <= _BLOCK:
        return _doubling(x, c)[0]
    nb = -(-length // _BLOCK)
    pad = nb * _BLOCK - length
    xb = F.pad(x, (0, pad)).unflatten(-1, (nb, _BLOCK))
    cb = F.pad(c, (0, pad), value=1.0).unflatten(-1, (nb, _BLOCK))
    y_loc, c_loc = _doubling(xb, cb)
    # y at the start of each block, from the blocks' own affine maps.
    y_start = _scan(y_loc[..., 0].contiguous(), c_loc[..., 0].contiguous())
    carry = F.pad(y_start[..., 1:], (0, 1))
    y = y_loc + c_loc * carry.unsqueeze(-1)
    return y.flatten(-2)[..., :length]


class _ReverseLinearScan(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _scan(x, c)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        _, c = inputs
        ctx.save_for_backward(c, output)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[no-untyped-def,override]
        c, y = ctx.saved_tensors
        # dL/dx_s = g_s + c_{s-1} dL/dx_{s-1}: a forward scan, i.e. a reverse scan of the
        # flipped sequence whose factors are c shifted by one step.
        cf = F.pad(c.flip(-1)[..., 1:], (0, 1))
        gx = _scan(g.flip(-1).contiguous(), cf.contiguous()).flip(-1)
        gc = gx * F.pad(y[..., 1:], (0, 1)) if ctx.needs_input_grad[1] else None
        return gx, gc


def reverse_linear_scan(x: torch.Tensor, factors: torch.Tensor | float) -> torch.Tensor:
    """Solve ``y_t = x_t + c_t * y_{t+1}`` (with ``y_T = 0``) along the last dimension.

    Args:
      x: ``[..., T]`` floating-point inputs.
      factors: ``c``, a tensor broadcastable to ``x`` (per-step factors, e.g.
        ``gamma * lam * mask``) or a Python number.

    Returns:
      ``y`` with the shape and dtype of ``x``. Differentiable in ``x`` and ``factors``.

    >>> reverse_linear_scan(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.5, 0.5, 0.5]))
    tensor([1.7500, 1.5000, 1.0000])
    """
    check_floating("x", x)
    acc = acc_dtype(x.dtype)
    if isinstance(factors, (int, float)):
        if not math.isfinite(factors):
            raise ValueError(f"factors: got {factors!r}, expected a finite number (e.g. gamma) or a tensor")
        c = torch.full(x.shape, float(factors), dtype=acc, device=x.device)
    else:
        check_tensor("factors", factors)
        try:
            shape = torch.broadcast_shapes(factors.shape, x.shape)
        except RuntimeError:
            shape = None
        if shape != x.shape:
            raise ValueError(
                f"factors: got shape {tuple(factors.shape)}, expected a shape broadcastable to "
                f"{tuple(x.shape)} (the shape of x)"
            )
        # expand() routes the factors' gradient back to their broadcast shape.
        c = factors.to(acc).expand(x.shape).contiguous()
    if x.dim() == 0:
        raise ValueError("x: got a 0-d tensor, expected [..., T]")
    if x.shape[-1] == 0:
        return x.clone()
    y = _ReverseLinearScan.apply(x.to(acc).contiguous(), c)
    return y.to(x.dtype)


def discounted_cumsum(x: torch.Tensor, gamma: float | torch.Tensor) -> torch.Tensor:
    """Discounted reward-to-go ``y_t = sum_{s >= t} gamma^(s - t) x_s`` along the last dimension.

    >>> discounted_cumsum(torch.tensor([1.0, 0.0, 2.0]), 0.5)
    tensor([1.5000, 1.0000, 2.0000])
    """
    return reverse_linear_scan(x, gamma)
