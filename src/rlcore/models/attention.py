"""Packed causal attention: the sequences of a pack never attend to each other, with no N x N mask.

Tokens are ``[N, heads, head_dim]`` with the sequence boundaries in ``cu_seqlens``
(int32 ``[B + 1]``, the flash-attention varlen convention). A dense ``[N, N]``
block-diagonal mask would cost O(N^2) memory on long packs; instead each backend runs
attention over the segments only:

* CPU: one batched causal SDPA call per distinct sequence length (with torch 2.13,
  FlexAttention has no CPU backward and nested-jagged SDPA has no causal CPU kernel).
* CUDA: flash-attention varlen (``torch.nn.attention.varlen.varlen_attn``) for
  float16 / bfloat16; FlexAttention with a document mask for other dtypes.
* Ascend NPU: torch-npu's fused varlen attention (``npu_fusion_attention``, layout TND).

Attention under an explicit boolean mask (a shared-prompt pack's groups, a prefill's
padded prompts) goes through :func:`attend_masked`: SDPA, except for the few keys per
problem of a small model's batch on the CPU, where :func:`rlcore.ops.masked_attention`'s
three matmuls beat the fused kernel.

The backend follows the tensors' device (``rlcore.device`` names the same three);
torch-npu is imported only through :mod:`rlcore.device`. The CUDA and NPU branches
cannot run on the CPU-only CI and are kept to the library call; the CPU test suite
checks the FlexAttention document mask with a CPU forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F

from rlcore._checks import check_integer, check_ndim, check_tensor, host_readable
from rlcore.device import import_torch_npu
from rlcore.ops.attention import masked_attention

__all__ = [
    "attend_masked",
    "attend_packed",
    "check_cu_seqlens",
    "packed_causal_attention",
]

# The compressed causal mask npu_fusion_attention requires with sparse_mode=3.
_NPU_MASK_SIZE = 2048
# On the CPU, problems of at most this many keys run as materialised-score matmuls
# (rlcore.ops.masked_attention), longer ones through SDPA's fused kernel: the crossover
# measured by benchmarks/bench_small_attention.py lies between 64 and 128 keys.
CPU_SMALL_KEYS = 64


def check_cu_seqlens(cu_seqlens: torch.Tensor, n: int) -> list[int] | None:
    """Validate ``cu_seqlens`` for ``n`` packed tokens; return its values when read.

    Shape and dtype are always checked. The values (start 0, non-decreasing, end at
    ``n``) are read and checked only for CPU tensors in eager mode, where reading
    them stalls nothing; they are then returned as host ints (the CPU kernel needs
    them anyway). Elsewhere returns None.

    >>> check_cu_seqlens(torch.tensor([0, 3, 5], dtype=torch.int32), 5)
    [0, 3, 5]
    """
    check_ndim("cu_seqlens", cu_seqlens, 1)
    check_integer("cu_seqlens", cu_seqlens)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: got shape ({cu_seqlens.shape[0]},), expected [B + 1] with B >= 1")
    if not host_readable(cu_seqlens):
        return None
    bounds = cu_seqlens.tolist()  # sync-ok: a CPU tensor in eager mode
    if bounds[0] != 0 or bounds[-1] != n or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"cu_seqlens: got {bounds if len(bounds) <= 12 else bounds[:6] + ['...'] + bounds[-3:]}, expected "
            f"non-decreasing boundaries from 0 to {n} (the number of packed tokens)"
        )
    return bounds


def attend_masked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=...)`` by the faster kernel.

    ``query`` ``[B, H, T, D]``, ``key`` / ``value`` ``[B, KV, S, D]``, ``mask`` bool
    ``[B or 1, 1 or H, T, S]`` with at least one key per query (the result of a query
    with none depends on the kernel). On the CPU with at most :data:`CPU_SMALL_KEYS` keys:
    :func:`rlcore.ops.masked_attention`; otherwise SDPA.
    """
    if query.device.type == "cpu" and key.shape[2] <= CPU_SMALL_KEYS:
        return masked_attention(query, key, value, mask, scale=scale)
    gqa = query.shape[1] != key.shape[1]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    # Sequences of equal length share one batched causal SDPA call: an RL batch of many
    # short sequences has few distinct lengths, and one call per sequence costs more in
    # dispatch than in arithmetic. One gather puts the tokens in length-group order and
    # one index_copy puts them back, so forward and backward stay O(N); with all lengths
    # distinct the groups are the sequences in order, and both are skipped.
    starts_by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)
    if not starts_by_length:
        return q.new_empty(q.shape)
    groups = list(starts_by_length.items())
    sizes = [length * len(starts) for length, starts in groups]
    order = None
    if len(groups) < sum(len(starts) for _, starts in groups):
        order = torch.cat(
            [(torch.tensor(starts)[:, None] + torch.arange(length)).reshape(-1) for length, starts in groups]
        ).to(q.device)

    def grouped(x: torch.Tensor) -> list[torch.Tensor]:
        # [G, heads, L, D]: SDPA's fused CPU (flash) kernel takes only 4-D inputs; 3-D
        # ones fall back to the math path, ~4x slower with its backward. torch.split, not
        # one slice per group: the backward of G slices would build G full-size zero
        # gradients and add them up, O(G * N) work.
        rows = x if order is None else x.index_select(0, order)
        return [
            part.view(len(starts), length, *x.shape[1:]).transpose(1, 2)
            for part, (length, starts) in zip(rows.split(sizes), groups)
        ]

    outs = torch.cat(
        [
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            .transpose(1, 2)
            .reshape(-1, *q.shape[1:])
            for qs, ks, vs in zip(grouped(q), grouped(k), grouped(v))
        ]
    )
    return outs if order is None else q.new_empty(q.shape).index_copy(0, order, outs)


@functools.cache
def _compiled_flex_attention() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex_document(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    flex: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """FlexAttention with a causal document mask: block-sparse, never a dense ``[N, N]``.

    ``flex`` is the attention call (default: the compiled ``flex_attention``).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    n = q.shape[0]
    doc = torch.searchsorted(cu_seqlens[1:].long(), torch.arange(n, device=q.device), right=True)

    def mask_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return (doc[qi] == doc[ki]) & (qi >= ki)

    block = create_block_mask(mask_mod, None, None, n, n, device=q.device)
    out = (flex or _compiled_flex_attention())(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=block,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def _cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    # CUDA only; not run by the CPU test suite.
    if q.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        cu = cu_seqlens.to(torch.int32)
        # Without return_aux it returns the output alone; torch annotates both forms.
        return cast(
            torch.Tensor,
            varlen_attn(
                q,
                k,
                v,
                cu,
                cu,
                max_seqlen,
                max_seqlen,
                scale=scale,
                window_size=(-1, 0),
                enable_gqa=q.shape[1] != k.shape[1],
            ),
        )
    return _flex_document(q, k, v, cu_seqlens, scale)


def _npu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float) -> torch.Tensor:
    # Ascend NPU only; not run by the CPU test suite.
    torch_npu, reason = import_torch_npu()
    if torch_npu is None:
        raise RuntimeError(f"packed attention on an NPU tensor needs torch-npu: {reason}")
    mask = torch.triu(torch.ones(_NPU_MASK_SIZE, _NPU_MASK_SIZE, dtype=torch.bool, device=q.device), diagonal=1)
    ends = tuple(bounds[1:])
    return torch_npu.npu_fusion_attention(
        q,
        k,
        v,
        q.shape[1],
        "TND",
        atten_mask=mask,
        scale=scale,
        keep_prob=1.0,
        actual_seq_qlen=ends,
        actual_seq_kvlen=ends,
        sparse_mode=3,
    )[0]


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_seqlen: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence (scaled dot-product attention, arXiv:1706.03762).

    For token ``i`` of sequence ``b`` (``cu_seqlens[b] <= i < cu_seqlens[b + 1]``):

        out_i = sum_{cu_seqlens[b] <= j <= i} softmax_j(scale * q_i . k_j) v_j

    Grouped-query attention is supported (``key``/``value`` heads dividing the query
    heads). Never materialises an ``[N, N]`` mask.

    Args:
      query: ``[N, Hq, D]``.
      key: ``[N, Hkv, D]``.
      value: ``[N, Hkv, D]``.
      cu_seqlens: ``[B + 1]`` integer boundaries, from 0 to ``N``.
      max_seqlen: the longest sequence; needed on CUDA (read from ``cu_seqlens`` with
        a sync when omitted).
      scale: softmax scale, ``1 / sqrt(D)`` by default.

    Returns:
      ``[N, Hq, D]`` in ``query.dtype``.

    >>> q = torch.randn(5, 2, 4)
    >>> out = packed_causal_attention(q, q, q, torch.tensor([0, 3, 5], dtype=torch.int32))
    >>> torch.allclose(out[3], q[3])  # the first token of a sequence sees only itself
    True
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_ndim(name, t, 3)
    check_tensor("cu_seqlens", cu_seqlens)
    n, hq, d = query.shape
    if key.shape[0] != n or value.shape != key.shape or key.shape[2] != d or hq % key.shape[1]:
        raise ValueError(
            f"key: got key {tuple(key.shape)} and value {tuple(value.shape)}, expected ({n}, Hkv, {d}) both, "
            f"with Hkv dividing {hq} (the query heads)"
        )
    bounds = check_cu_seqlens(cu_seqlens, n)
    return attend_packed(query, key, value, cu_seqlens, max_seqlen, bounds, d**-0.5 if scale is None else scale)


def attend_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    bounds: list[int] | None,
    scale: float,
) -> torch.Tensor:
    """The backend dispatch of :func:`packed_causal_attention`, without its checks (for per-layer calls)."""
    kind = q.device.type
    if kind == "cuda":
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # sync-ok: documented; pass max_seqlen
        return _cuda(q, k, v, cu_seqlens, max_seqlen, scale)
    if bounds is None:
        bounds = cu_seqlens.tolist()  # sync-ok: the CPU and NPU kernels take host boundaries
    if kind == "npu":
        return _npu(q, k, v, bounds, scale)
    return _per_segment(q, k, v, bounds, scale)
