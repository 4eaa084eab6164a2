"""Ring attention over a context-parallel group: key/value blocks rotate, softmaxes merge by log-sum-exp.

Liu et al., "Ring Attention with Blockwise Transformers for Near-Infinite Context",
arXiv:2310.01889. Each rank holds the queries, keys and values of its two chunks of
the packed row (:class:`rlcore.models.SequenceShards`, the load-balanced split). In
``cp`` steps every rank attends its queries to the key/value block it holds, then
passes the block to the next rank of the ring (sending the next block while the
current one is computed); partial results ``(o_s, lse_s)`` merge exactly as an
online softmax (Milakov & Gimelshein, arXiv:1805.02867)::

    lse = log(sum_s exp(lse_s)),    o = sum_s exp(lse_s - lse) o_s

The backward runs the same ring: each step recomputes a block's probabilities from
the final ``lse`` (``P = exp(S - lse)``, ``dS = P (dP - rowsum(dO * O))``), adds to
the local ``dq`` and to the block's ``dk, dv``, which travel with the block and are
home after ``cp`` steps. Packed sequences never attend to each other: a block pair
is causal attention within each sequence piece (same chunk) or full attention of
the one sequence spanning both chunks (an earlier chunk); no mask is built.

On the CPU each block runs the fused flash kernel (no score matrix); elsewhere a
plain block kernel whose ``[heads, q, k]`` scores are bounded by the chunk size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlcore._checks import check_positive
from rlcore._process_group import as_process_group
from rlcore.models.sequence_shards import SequenceShards

__all__ = ["ring_attention"]


def _ring_exchange(tensors: list[torch.Tensor], group: Any) -> tuple[list[torch.Tensor], list[Any]]:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's; returns (buffers, requests)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    return bufs, dist.batch_isend_irecv(ops)


def _wait(reqs: list[Any]) -> None:
    for r in reqs:
        r.wait()


def _heads_first(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[L, H, D]`` -> ``[1, H * rep, L, D]`` (key/value heads repeated for grouped-query attention)."""
    x = x.transpose(0, 1)
    if rep > 1:
        x = x.repeat_interleave(rep, dim=0)
    return x.unsqueeze(0)


def _causal_mask(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril()


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, rep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [Lq, Hq, D] float32, lse [Hq, Lq] float32)`` of one block."""
    q4, k4, v4 = _heads_first(q, 1), _heads_first(k, rep), _heads_first(v, rep)
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, causal, scale=scale)
        return o[0].transpose(0, 1).float(), lse[0].float()
    s = (q4[0].float() @ k4[0].float().transpose(1, 2)) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(s.shape[1], s.shape[2], s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.exp(s - lse[..., None]) @ v4[0].float()
    return o.transpose(0, 1), lse


def _block_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    rep: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [Lq, Hq, D], dk [Lk, Hkv, D], dv)`` in float32, from the final ``o`` and ``lse`` of the rows."""
    q4, k4, v4 = _heads_first(q, 1), _heads_first(k, rep), _heads_first(v, rep)
    do4, o4 = _heads_first(do, 1), _heads_first(o, 1)
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do4, q4, k4, v4, o4, lse[None].contiguous(), 0.0, causal, scale=scale
        )
        dq, dk, dv = dq[0].float(), dk[0].float(), dv[0].float()
    else:
        qf, kf, vf, dof, of = (t[0].float() for t in (q4, k4, v4, do4, o4))
        s = (qf @ kf.transpose(1, 2)) * scale
        if causal:
            s = s.masked_fill(~_causal_mask(s.shape[1], s.shape[2], s.device), float("-inf"))
        p = torch.exp(s - lse[..., None])
        dv = p.transpose(1, 2) @ dof
        dp = dof @ vf.transpose(1, 2)
        ds = p * (dp - (dof * of).sum(-1, keepdim=True))
        dq = (ds @ kf) * scale
        dk = (ds.transpose(1, 2) @ qf) * scale
    if rep > 1:
        dk = dk.unflatten(0, (-1, rep)).sum(1)
        dv = dv.unflatten(0, (-1, rep)).sum(1)
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


def _merge_(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l_new: torch.Tensor, lo: int, hi: int) -> None:
    """Fold a block's ``(o, l_new)`` for rows ``[lo, hi)`` into the running ``(out, lse)``, in place."""
    old = lse[:, lo:hi]
    merged = torch.logaddexp(old, l_new)
    a = torch.exp(old - merged).transpose(0, 1)[..., None]
    b = torch.exp(l_new - merged).transpose(0, 1)[..., None]
    out[lo:hi] = out[lo:hi] * a + o * b
    lse[:, lo:hi] = merged


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shards: SequenceShards, group: Any, scale: float
    ) -> torch.Tensor:
        world, rank = shards.world, shards.rank
        rep = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(world):
            reqs: list[Any] = []
            if step < world - 1:
                nxt, reqs = _ring_exchange(kv, group)
            for q_lo, q_hi, k_lo, k_hi, causal in shards.tasks((rank - step) % world):
                o, l_new = _block_forward(q[q_lo:q_hi], kv[0][k_lo:k_hi], kv[1][k_lo:k_hi], causal, scale, rep)
                _merge_(out, lse, o, l_new, q_lo, q_hi)
            _wait(reqs)
            if step < world - 1:
                kv = nxt
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.shards, ctx.group, ctx.scale = shards, group, scale
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        shards, group, scale = ctx.shards, ctx.group, ctx.scale
        world, rank = shards.world, shards.rank
        rep = q.shape[1] // k.shape[1]
        dout = dout.to(q.dtype).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
        for step in range(world):
            kv_reqs: list[Any] = []
            if step < world - 1:
                kv_next, kv_reqs = _ring_exchange(kv, group)
            for q_lo, q_hi, k_lo, k_hi, causal in shards.tasks((rank - step) % world):
                dq_t, dk_t, dv_t = _block_backward(
                    dout[q_lo:q_hi],
                    q[q_lo:q_hi],
                    kv[0][k_lo:k_hi],
                    kv[1][k_lo:k_hi],
                    out[q_lo:q_hi],
                    lse[:, q_lo:q_hi],
                    causal,
                    scale,
                    rep,
                )
                dq[q_lo:q_hi] += dq_t
                dkv[0][k_lo:k_hi] += dk_t
                dkv[1][k_lo:k_hi] += dv_t
            # The block's gradient follows the block; after `world` hops it is home.
            _wait(kv_reqs)
            if world > 1:
                dkv_next, dkv_reqs = _ring_exchange(dkv, group)
                _wait(dkv_reqs)
                dkv = dkv_next
            if step < world - 1:
                kv = kv_next
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shards: SequenceShards,
    group: Any,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within packed sequences, the row split over a context-parallel group (ring attention).

    Liu et al., arXiv:2310.01889, with the load-balanced (zig-zag) split. Every rank of
    ``group`` calls it with its own shard, in the same order of layers; the result
    equals rank's rows of :func:`rlcore.models.packed_causal_attention` over the whole
    padded row, and the backward sends the key/value gradients back around the ring.

    Args:
      query: ``[2L, Hq, D]``, this rank's tokens (``L = shards.chunk``).
      key: ``[2L, Hkv, D]`` (``Hkv`` dividing ``Hq``).
      value: ``[2L, Hkv, D]``.
      shards: the split plan from :func:`rlcore.models.plan_sequence_shards`.
      group: the context-parallel ``ProcessGroup`` (or 1-D ``DeviceMesh``) of
        ``shards.world`` ranks, this rank being ``shards.rank``.
      scale: softmax scale, a finite number > 0; ``1 / sqrt(D)`` by default.

    Returns:
      ``[2L, Hq, D]`` in ``query.dtype``.
    """
    if scale is not None:
        check_positive("scale", scale, finite=True)
    pg = as_process_group("group", group)
    shards.check_local(query, key, value, world=dist.get_world_size(pg), rank=dist.get_rank(pg))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out: torch.Tensor = _RingAttention.apply(query, key, value, shards, pg, scale)
    return out
