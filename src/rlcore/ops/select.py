"""Zeroing masked-out elements as one bitwise ``and``: ``torch.where(keep, x, 0)`` bit for bit, faster.

Losses zero their padding with ``torch.where`` rather than a multiply by the mask, so a
``nan`` or ``inf`` at a padded position never reaches a value or a gradient. On the CPU
``torch.where`` is a scalar, branching loop: at ``[256, 1024]`` float32 it took 3.5x the
time of the bitwise ``and`` below with a prefix (padding) mask and 14x with a scattered one, and losses
call it several times forward and backward. Clearing the bits of each padded element
instead (the float viewed as an integer of its width, ``and``-ed with all-ones or zeros)
gives the same bits as the ``where`` (``+0.0`` at padding, ``nan`` and ``-0.0`` kept where
the token counts) in a vectorised pass; the bit pattern is made once per mask
(:func:`keep_bits`) and serves every tensor zeroed with it.
"""

from __future__ import annotations

import torch

__all__ = ["keep_bits", "masked_zero", "masked_zero_"]

# The signed integer of each float's width: the view the bitwise ``and`` runs on.
_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def keep_bits(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bit pattern :func:`masked_zero` clears ``dtype`` elements with: all ones where ``keep``, zeros elsewhere.

    Args:
      keep: a boolean tensor, True where an element is kept.
      dtype: the floating dtype of the tensors it will zero.

    Returns:
      ``keep`` as the signed integer of ``dtype``'s width (``-1`` where True, ``0`` where
      False); for a dtype with no such view (none of float64/32/16, bfloat16), ``keep`` itself.

    >>> keep_bits(torch.tensor([True, False]), torch.float32)
    tensor([-1,  0], dtype=torch.int32)
    """
    if keep.dtype != torch.bool:
        raise ValueError(f"keep: got dtype {keep.dtype}, expected torch.bool")
    view = _INT_VIEW.get(dtype)
    if view is None:
        return keep
    return keep.to(view).neg_()


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _checked_bits(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``keep`` as the bits that zero ``x``, checked: a ``ValueError`` naming the argument otherwise."""
    if not x.dtype.is_floating_point:
        raise ValueError(f"x: got dtype {x.dtype}, expected a floating dtype")
    bits = keep_bits(keep, x.dtype) if keep.dtype == torch.bool else keep
    want = _INT_VIEW.get(x.dtype)
    if bits.dtype not in (want, torch.bool):
        raise ValueError(f"keep: got dtype {bits.dtype}, expected torch.bool or keep_bits(..., {x.dtype}) ({want})")
    if not _broadcasts_to(bits.shape, x.shape):
        raise ValueError(f"keep: got shape {tuple(bits.shape)}, expected one broadcastable to x's {tuple(x.shape)}")
    return bits


def _zero(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    if bits.dtype == torch.bool:
        return torch.where(bits, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.bitwise_and(x.view(bits.dtype), bits).view(x.dtype)


class _MaskedZero(torch.autograd.Function):
    """The gradient of a masked zero is the incoming gradient, masked the same way."""

    @staticmethod
    def forward(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _zero(x, bits)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[no-untyped-def,override]
        (bits,) = ctx.saved_tensors
        # Through masked_zero itself (autograd hands a gradient of x's dtype), so that a double
        # backward (create_graph) differentiates it too.
        return masked_zero(g, bits), None


def masked_zero(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``torch.where(keep, x, 0)``, equal bit for bit, as one bitwise ``and`` (see the module's docstring).

    Args:
      x: a floating tensor.
      keep: a boolean tensor broadcastable to ``x``'s shape, or its :func:`keep_bits` for
        ``x.dtype`` (made once, when several tensors are zeroed with one mask).

    Returns:
      A new tensor of ``x``'s shape and dtype: ``x`` where ``keep``, ``+0.0`` elsewhere.
      Differentiable in ``x``: the gradient is the incoming one, zeroed the same way.

    >>> masked_zero(torch.tensor([1.0, float("nan"), -0.0]), torch.tensor([True, False, True]))
    tensor([1., 0., -0.])
    """
    bits = _checked_bits(x, keep)
    if x.requires_grad and torch.is_grad_enabled():
        return _MaskedZero.apply(x, bits)
    return _zero(x, bits)


def masked_zero_(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """:func:`masked_zero` in place, for a buffer of the caller's that needs no gradient; returns ``x``.

    >>> masked_zero_(torch.tensor([1.0, 2.0]), torch.tensor([False, True]))
    tensor([0., 2.])
    """
    bits = _checked_bits(x, keep)
    if bits.dtype == torch.bool:
        return x.copy_(_zero(x, bits))
    x.view(bits.dtype).bitwise_and_(bits)
    return x
