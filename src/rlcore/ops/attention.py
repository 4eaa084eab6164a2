"""Masked attention as three batched matmuls, for the small heads where a fused kernel's per-problem cost dominates.

A fused attention kernel (flash attention) walks each (batch, head) problem in blocks
with an online softmax: the right choice when sequences are long, and wasteful when a
problem is a few dozen queries of 16 dimensions, as in a small policy's shared-prompt
forward on a CPU, where its per-problem set-up costs more than the arithmetic.
:func:`masked_attention` computes the same function with the scores materialised:
one matmul per kv head for the scores of all the query heads that share it, a softmax,
and one matmul for the output, with a hand-written backward of the same shape.

The scores are kept keys-major (``[B, KV, S, G * T]``, the key axis second to last), so
the softmax's reductions run across rows of contiguous queries rather than along rows of
a few keys (which on a CPU cost more than the exponentials themselves); the matmuls read
the transposed operands through strides, with no copy. Arithmetic is in float32 for
narrower inputs (:func:`rlcore.ops.acc_dtype`), the result in the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcore._checks import check_floating, check_ndim, check_same_shape
from rlcore.ops.numerics import acc_dtype

__all__ = ["masked_attention"]


def _keys_major_bias(mask: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``[Bm, Hm, T, S]`` bool mask -> additive ``[Bm, 1 | KV, S, 1 | G, T]`` (0 or -inf), broadcast over the keys-major scores."""
    bm, hm, t, s = mask.shape
    if hm == 1:
        keys_major = mask.transpose(-1, -2).unsqueeze(-2)
    else:
        keys_major = mask.reshape(bm, kv_heads, hm // kv_heads, t, s).permute(0, 1, 4, 2, 3)
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(keys_major, zero, float("-inf")).contiguous()


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, t, d = query.shape
        kv, s = key.shape[1], key.shape[2]
        acc = acc_dtype(query.dtype)
        q = (query.to(acc) * scale).reshape(b, kv, (h // kv) * t, d)
        k, v = key.to(acc), value.to(acc)
        scores = torch.matmul(k, q.transpose(-1, -2))  # [B, KV, S, G*T]
        scores.view(b, kv, s, h // kv, t).add_(_keys_major_bias(mask, kv, acc))
        # A query with no key to attend: its column is all -inf, its softmax NaN, its weights 0.
        weights = scores.softmax(-2).nan_to_num_(0.0)
        out = torch.matmul(weights.transpose(-1, -2), v)  # [B, KV, G*T, D]
        return out.view(b, h, t, d).to(query.dtype), weights

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        query, key, value, _, scale = inputs
        ctx.save_for_backward(query, key, value, output[1])
        ctx.scale = scale
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, ...]:
        query, key, value, weights = ctx.saved_tensors
        b, h, t, d = query.shape
        kv = key.shape[1]
        acc = weights.dtype
        q = (query.to(acc) * ctx.scale).reshape(b, kv, (h // kv) * t, d)
        k, v = key.to(acc), value.to(acc)
        g = grad_out.to(acc).reshape(b, kv, (h // kv) * t, d)
        grad_v = torch.matmul(weights, g)  # [B, KV, S, D]
        grad_w = torch.matmul(v, g.transpose(-1, -2))  # [B, KV, S, G*T]
        # Softmax backward: w * (dw - sum_keys(w * dw)), reduced over the key axis.
        grad_s = grad_w.sub_((weights * grad_w).sum(-2, keepdim=True)).mul_(weights)
        grad_q = torch.matmul(grad_s.transpose(-1, -2), k).mul_(ctx.scale)  # [B, KV, G*T, D]
        grad_k = torch.matmul(grad_s, q)  # [B, KV, S, D]
        return (
            grad_q.view(b, h, t, d).to(query.dtype),
            grad_k.to(key.dtype),
            grad_v.to(value.dtype),
            None,
            None,
        )


def masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """``softmax(scale * q k^T, over the allowed keys) v`` per head, with grouped-query heads; differentiable.

    The function of ``F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
    scale=scale, enable_gqa=True)``, except that a query with no allowed key gets zeros
    (and passes no gradient) where SDPA's results vary by kernel.

    Args:
      query: ``[B, H, T, D]`` floating.
      key, value: ``[B, KV, S, D]`` of the query's dtype; ``H`` a multiple of ``KV``
        (query head ``h`` reads kv head ``h // (H / KV)``).
      mask: bool ``[B or 1, 1 or H, T, S]``, True where query ``t`` attends to key ``s``.
      scale: the factor of the dot products (``1 / sqrt(D)`` for standard attention).

    Returns:
      ``[B, H, T, D]`` in the query's dtype.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_floating(name, x)
        check_ndim(name, x, 4)
    check_ndim("mask", mask, 4)
    b, h, t, d = query.shape
    kv, s = key.shape[1], key.shape[2]
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"key, value: got {key.dtype} and {value.dtype}, expected the query's {query.dtype}")
    if key.shape[0] != b or key.shape[3] != d or kv == 0 or h % kv:
        raise ValueError(
            f"key: got shape {tuple(key.shape)}, expected [{b}, KV, S, {d}] with KV dividing the query's {h} heads"
        )
    check_same_shape("value", value, "key", key)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: got dtype {mask.dtype}, expected torch.bool")
    if mask.shape[0] not in (1, b) or mask.shape[1] not in (1, h) or tuple(mask.shape[2:]) != (t, s):
        raise ValueError(f"mask: got shape {tuple(mask.shape)}, expected [{b} or 1, 1 or {h}, {t}, {s}]")
    out, _ = _MaskedAttention.apply(query, key, value, mask, float(scale))
    return out
