"""Ulysses attention: all-to-all from sequence shards to head shards, full attention, and back.

Jacobs et al., "DeepSpeed Ulysses", arXiv:2309.14509. Each rank of a context-
parallel group of ``cp`` ranks holds ``2L`` tokens of the packed row with all heads
(:class:`rlcore.models.SequenceShards`). One all-to-all per tensor turns that into
the whole row with ``H / cp`` heads; packed causal attention
(:func:`rlcore.models.packed_causal_attention`, any backend) runs on it; one
all-to-all turns the output back. Query *and* key/value heads must divide by
``cp``. The all-to-all is its own adjoint, so the backward is the reverse
all-to-all of the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlcore._checks import check_positive
from rlcore._process_group import as_process_group
from rlcore.models.attention import packed_causal_attention
from rlcore.models.sequence_shards import SequenceShards

__all__ = ["ulysses_attention"]


class _AllToAll(torch.autograd.Function):
    """Block ``i`` of dim 0 goes to rank ``i``; block ``j`` of the result came from rank ``j``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _to_heads(x: torch.Tensor, shards: SequenceShards, group: Any) -> torch.Tensor:
    """``[2L, H, D]`` on every rank -> ``[P, H / cp, D]``, the whole row in order, this rank's heads."""
    world = shards.world
    blocks = x.unflatten(1, (world, -1)).transpose(0, 1)  # [cp, 2L, H / cp, D]: block i for rank i
    got = _AllToAll.apply(blocks, group).flatten(0, 1)  # rank-major rows
    return got.index_select(0, shards.natural_order.to(x.device))


def _to_tokens(x: torch.Tensor, shards: SequenceShards, group: Any) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: ``[P, H / cp, D]`` -> ``[2L, H, D]``."""
    world = shards.world
    rows = x.index_select(0, shards.gathered_positions.to(x.device)).unflatten(0, (world, -1))
    got = _AllToAll.apply(rows, group)  # [cp, 2L, H / cp, D]: head block j from rank j
    return got.transpose(0, 1).flatten(1, 2)


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shards: SequenceShards,
    group: Any,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within packed sequences, the row split over a context-parallel group (Ulysses).

    DeepSpeed Ulysses (arXiv:2309.14509): all-to-all to head shards, attention over
    the whole row, all-to-all back. Every rank of ``group`` calls it with its shard;
    the result equals this rank's rows of :func:`rlcore.models.packed_causal_attention`
    over the whole padded row.

    Args:
      query: ``[2L, Hq, D]``, this rank's tokens (``L = shards.chunk``).
      key: ``[2L, Hkv, D]``; ``Hq`` and ``Hkv`` must both divide by ``shards.world``.
      value: ``[2L, Hkv, D]``.
      shards: the split plan from :func:`rlcore.models.plan_sequence_shards`.
      group: the context-parallel ``ProcessGroup`` (or 1-D ``DeviceMesh``).
      scale: softmax scale, a finite number > 0; ``1 / sqrt(D)`` by default.

    Returns:
      ``[2L, Hq, D]`` in ``query.dtype``.
    """
    if scale is not None:
        check_positive("scale", scale, finite=True)
    pg = as_process_group("group", group)
    shards.check_local(query, key, value, world=dist.get_world_size(pg), rank=dist.get_rank(pg))
    world = shards.world
    if query.shape[1] % world or key.shape[1] % world:
        raise ValueError(
            f"query: got {query.shape[1]} query heads and {key.shape[1]} key/value heads, expected both divisible "
            f"by the context-parallel size {world} (Ulysses splits heads over the group; use cp_mode='ring')"
        )
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (_to_heads(t, shards, pg) for t in (query, key, value))
    cu = shards.cu_seqlens.to(q.device)
    out = packed_causal_attention(q, k, v, cu, max_seqlen=shards.max_seqlen, scale=scale)
    return _to_tokens(out, shards, pg)
