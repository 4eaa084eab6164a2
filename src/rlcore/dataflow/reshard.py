"""The resharding flow: move weights from the training layout to the inference layout.

:func:`plan_reshard` decides, from two :class:`~rlcore.dataflow.layout.Layout` values
and the parameter shapes alone, which collective moves each parameter, and packs the
parameters into dtype buckets of bounded size. :func:`reshard` (or
:func:`reshard_bucket`, one bucket at a time) runs the plan on a real process group.
The collectives, in the order they apply to one parameter:

1. ``broadcast`` over ``pp``: a training pipeline stage sends its layers to the
   other stages, since inference keeps every layer on every rank;
2. per split mesh dimension (``tp``, or ``ep`` for stacked experts), from ``s`` to
   ``d`` shards:

   * ``split`` -- every rank already holds its new shard (``s = 1``, or the new
     shard is inside the old one on the same rank): a local slice, no traffic;
   * ``all_gather`` -- fewer shards (``s`` a multiple of ``d``): ``Shard -> Replicate``
     by ``DTensor.redistribute`` over the training group, then the local slice;
   * ``all_to_all`` -- as many or more shards, on other ranks (``d`` a multiple of ``s``):
     ``all_to_all_single`` over the training group, each rank sending every peer
     exactly the slice of its shard that the peer needs, and nothing else.

The seed system's AllGather-Swap all-gathers in both directions; the all-to-all
moves ``1/s`` of that volume when inference shards more finely than training (e.g.
expert parallel 2 -> 4).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from typing import Any

import torch

from rlcore._checks import check_positive
from rlcore.dataflow.layout import Layout

__all__ = [
    "Bucket",
    "Move",
    "ParamMove",
    "ReshardPlan",
    "allocate_buckets",
    "bucket_views",
    "check_reshard_params",
    "plan_fingerprint",
    "plan_reshard",
    "reshard",
    "reshard_bucket",
]

_SPLIT_DIMS = ("ep", "tp")


@dataclasses.dataclass(frozen=True)
class Move:
    """One step of one parameter: ``collective`` over mesh dim ``mesh_dim`` (``src_size -> dst_size`` shards)."""

    collective: str
    mesh_dim: str
    tensor_dim: int | None
    src_size: int
    dst_size: int


@dataclasses.dataclass(frozen=True)
class ParamMove:
    """How one parameter moves, with its per-rank byte counts."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    src_shape: tuple[int, ...]
    dst_shape: tuple[int, ...]
    moves: tuple[Move, ...]
    dst_bytes: int
    transient_bytes: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Parameters of one dtype moved together: ``nbytes`` of inference weights, at most ``transient_bytes`` in flight."""

    dtype: torch.dtype
    names: tuple[str, ...]
    nbytes: int
    transient_bytes: int


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """What :func:`plan_reshard` returns: the two layouts, a :class:`ParamMove` per parameter, the buckets."""

    src: Layout
    dst: Layout
    params: Mapping[str, ParamMove]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int

    def dst_bytes(self) -> int:
        """Bytes of inference weights per rank."""
        return sum(b.nbytes for b in self.buckets)

    def src_bytes(self, rank: int, names: Any = None) -> int:
        """Bytes of training weights ``rank`` holds (of ``names``, default all)."""
        names = self.params if names is None else names
        return sum(
            math.prod(self.params[n].src_shape) * self.params[n].dtype.itemsize
            for n in names
            if self.src.holds(n, rank)
        )


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _local_everywhere(src: Layout, dst: Layout, dim: str, k: int) -> bool:
    """Whether every rank's new shard lies inside the old shard it already holds."""
    return all(dst.coords(r)[dim] // k == src.coords(r)[dim] for r in range(src.world_size))


def _moves(name: str, shape: tuple[int, ...], dtype: torch.dtype, src: Layout, dst: Layout) -> ParamMove:
    sp = src.placements[name]
    src_shape, dst_shape = src.local_shape(name, shape), dst.local_shape(name, shape)
    moves, transient = [], 0
    if src.pp > 1:
        moves.append(Move("broadcast", "pp", None, src.pp, 1))
        transient += _nbytes(src_shape, dtype)
    for dim in _SPLIT_DIMS:
        tdim = getattr(sp, dim)
        if tdim is None:
            continue
        s, d = getattr(src, dim), getattr(dst, dim)
        if s == 1 or (d % s == 0 and _local_everywhere(src, dst, dim, d // s)):
            kind = "split"
        elif d % s == 0:
            kind = "all_to_all"
            transient += _nbytes(src_shape, dtype) + _nbytes(dst_shape, dtype)
        else:
            kind = "all_gather"
            transient += _nbytes(src_shape, dtype) * s
        moves.append(Move(kind, dim, tdim, s, d))
    return ParamMove(name, shape, dtype, src_shape, dst_shape, tuple(moves), _nbytes(dst_shape, dtype), transient)


def _check_pair(param_meta: Mapping[str, Any], src: Layout, dst: Layout) -> None:
    if src.world_size != dst.world_size:
        raise ValueError(
            f"dst_layout: got world size {dst.world_size} ({dst.describe()}), expected {src.world_size}, "
            f"the world size of src_layout ({src.describe()})"
        )
    if dst.pp != 1:
        raise ValueError(f"dst_layout: got pp={dst.pp}, expected pp=1 (inference holds every layer on every rank)")
    for dim in _SPLIT_DIMS:
        s, d = getattr(src, dim), getattr(dst, dim)
        if s % d and d % s:
            raise ValueError(f"{dim}: got {s} in src_layout and {d} in dst_layout, expected one to divide the other")
    src.validate(param_meta, what="src_layout")
    dst.validate(param_meta, what="dst_layout")
    for name in param_meta:
        a, b = src.placements[name], dst.placements[name]
        if (a.tp, a.ep) != (b.tp, b.ep):
            raise ValueError(
                f"dst_layout: parameter {name!r} is split as (tp={b.tp}, ep={b.ep}), expected the split dims of "
                f"src_layout (tp={a.tp}, ep={a.ep}); only the mesh sizes may change"
            )


def plan_reshard(
    param_meta: Mapping[str, Any], src_layout: Layout, dst_layout: Layout, *, bucket_bytes: int = 256 << 20
) -> ReshardPlan:
    """Plan the move of every parameter from ``src_layout`` (training) to ``dst_layout`` (inference).

    Reference: MindSpeed-RL's resharding flow and AllGather-Swap (Feng et al.,
    arXiv:2507.19017). Per parameter, ``broadcast`` over pipeline stages, then per
    split mesh dim ``split`` / ``all_gather`` / ``all_to_all`` (module docstring).
    Parameters are packed in order into buckets of one dtype with
    ``sum(inference bytes) + max(transient bytes) <= bucket_bytes``, so a bucket in
    flight never holds more than ``bucket_bytes`` beyond the weights themselves.

    Args:
      param_meta: parameter name -> anything with ``.shape`` and ``.dtype`` (full,
        unsharded shapes; ``meta`` tensors allocate nothing).
      src_layout: the training layout.
      dst_layout: the inference layout, over the same world size, with ``pp = 1``;
        its ``tp`` and ``ep`` must divide or be multiples of the training ones.
      bucket_bytes: the bound on one bucket, per rank.

    Returns:
      A :class:`ReshardPlan`.

    Raises:
      ValueError: different world sizes, sizes that do not divide, a placement on a
        dim the tensor lacks, a bucket smaller than one parameter's needs.

    >>> from rlcore.dataflow.layout import decoder_layout
    >>> meta = {"model.layers.0.mlp.up_proj.weight": torch.empty(8, 4, device="meta")}
    >>> plan = plan_reshard(meta, decoder_layout(meta, tp=2), decoder_layout(meta, dp=2))
    >>> plan.params["model.layers.0.mlp.up_proj.weight"].moves[0].collective
    'all_gather'
    """
    check_positive("bucket_bytes", bucket_bytes)
    _check_pair(param_meta, src_layout, dst_layout)
    params = {
        n: _moves(n, tuple(int(s) for s in m.shape), m.dtype, src_layout, dst_layout) for n, m in param_meta.items()
    }
    buckets: list[Bucket] = []
    cur: list[ParamMove] = []

    def close() -> None:
        if cur:
            buckets.append(
                Bucket(
                    cur[0].dtype,
                    tuple(p.name for p in cur),
                    sum(p.dst_bytes for p in cur),
                    max(p.transient_bytes for p in cur),
                )
            )
            cur.clear()

    for p in params.values():
        need = p.dst_bytes + p.transient_bytes
        if need > bucket_bytes:
            raise ValueError(
                f"bucket_bytes: got {bucket_bytes}, expected at least {need}: parameter {p.name!r} "
                f"(shape {p.shape}, {p.dtype}) needs {p.dst_bytes} bytes of inference weights and "
                f"{p.transient_bytes} in flight"
            )
        if cur and (
            cur[0].dtype != p.dtype
            or sum(q.dst_bytes for q in cur) + p.dst_bytes + max(p.transient_bytes, *(q.transient_bytes for q in cur))
            > bucket_bytes
        ):
            close()
        cur.append(p)
    close()
    return ReshardPlan(src_layout, dst_layout, params, tuple(buckets), bucket_bytes)


def allocate_buckets(plan: ReshardPlan, device: torch.device | str) -> list[torch.Tensor]:
    """One flat, uninitialised tensor per bucket, sized from the inference layout.

    >>> from rlcore.dataflow.layout import Layout, Placement
    >>> lay = Layout({"w": Placement()})
    >>> meta = {"w": torch.empty(3, 2, device="meta")}
    >>> [b.shape for b in allocate_buckets(plan_reshard(meta, lay, lay), "cpu")]
    [torch.Size([6])]
    """
    return [
        torch.empty(sum(math.prod(plan.params[n].dst_shape) for n in b.names), dtype=b.dtype, device=device)
        for b in plan.buckets
    ]


def bucket_views(plan: ReshardPlan, index: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inference weights of bucket ``index``: views of ``buffer`` in their shard shapes."""
    bucket = plan.buckets[index]
    want = sum(math.prod(plan.params[n].dst_shape) for n in bucket.names)
    if buffer.dim() != 1 or buffer.numel() != want or buffer.dtype != bucket.dtype:
        raise ValueError(
            f"buffer: got shape {tuple(buffer.shape)} {buffer.dtype}, "
            f"expected ({want},) {bucket.dtype} for bucket {index}"
        )
    views, offset = {}, 0
    for n in bucket.names:
        shape = plan.params[n].dst_shape
        views[n] = buffer[offset : offset + math.prod(shape)].view(shape)
        offset += math.prod(shape)
    return views


def _gather(x: torch.Tensor, mesh: Any, tdim: int) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dt = DTensor.from_local(x, device_mesh=mesh, placements=[Shard(tdim)], run_check=False)
    return dt.redistribute(mesh, [Replicate()]).to_local()


def _all_to_all(x: torch.Tensor, mesh: Any, move: Move, plan: ReshardPlan, rank: int) -> torch.Tensor:
    import torch.distributed as dist

    dim, tdim, k = move.mesh_dim, move.tensor_dim, move.dst_size // move.src_size
    assert tdim is not None, "only a broadcast has no tensor dim"
    group = mesh.get_group()
    members = dist.get_process_group_ranks(group)
    mine = plan.src.coords(rank)[dim]
    want = plan.dst.coords(rank)[dim]
    piece = x.shape[tdim] // k
    pieces, send_sizes, recv_sizes = [], [], []
    for peer in members:
        target = plan.dst.coords(peer)[dim]
        if target // k == mine:
            pieces.append(x.narrow(tdim, (target % k) * piece, piece).reshape(-1))
            send_sizes.append(pieces[-1].numel())
        else:
            send_sizes.append(0)
        recv_sizes.append(x.numel() // k if plan.src.coords(peer)[dim] == want // k else 0)
    shape = list(x.shape)
    shape[tdim] = piece
    out = x.new_empty(x.numel() // k)
    send = torch.cat(pieces) if pieces else x.new_empty(0)
    dist.all_to_all_single(out, send, recv_sizes, send_sizes, group=group)
    return out.view(shape)


def check_reshard_params(params: Mapping[str, torch.Tensor], plan: ReshardPlan, rank: int, names: Any) -> None:
    """Reject a mismatch before any collective starts, so bad input moves nothing."""
    for name in names:
        pm = plan.params[name]
        held = plan.src.holds(name, rank)
        if held != (name in params):
            want = "holds" if held else "does not hold"
            raise ValueError(f"params: rank {rank} {want} {name!r} in src_layout, expected params to match")
        if held:
            x = params[name]
            if tuple(x.shape) != pm.src_shape or x.dtype != pm.dtype:
                raise ValueError(
                    f"params[{name!r}]: got shape {tuple(x.shape)} {x.dtype}, expected {pm.src_shape} {pm.dtype}"
                )


def plan_fingerprint(plan: ReshardPlan) -> int:
    """A 63-bit digest of everything in ``plan`` that decides the collectives: equal plans, equal digests.

    Covers both layouts (mesh sizes and every placement), each parameter's shapes,
    dtype and moves, the buckets and ``bucket_bytes``.

    >>> from rlcore.dataflow.layout import Layout, Placement
    >>> lay = Layout({"w": Placement()})
    >>> meta = {"w": torch.empty(3, 2, device="meta")}
    >>> plan_fingerprint(plan_reshard(meta, lay, lay)) == plan_fingerprint(plan_reshard(meta, lay, lay))
    True
    """
    if not isinstance(plan, ReshardPlan):
        raise ValueError(f"plan: got {type(plan).__name__}, expected a ReshardPlan from plan_reshard")
    parts = [plan.src.describe(), plan.dst.describe(), str(plan.bucket_bytes)]
    for layout in (plan.src, plan.dst):
        parts += [f"{n}:{p!r}" for n, p in sorted(layout.placements.items())]
    parts += [repr(pm) for pm in plan.params.values()]
    parts += [repr(b) for b in plan.buckets]
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _agree(plan: ReshardPlan, index: int, device: torch.device, local: Exception | None) -> None:
    """Every rank compares plan fingerprint, bucket and input checks before any weight moves.

    One all-gather of three int64 per rank over the default group (the mesh spans it).
    Raises on every rank, the same way, if the ranks disagree or any rejected its input.
    """
    import torch.distributed as dist

    mine = torch.tensor([plan_fingerprint(plan), index, local is None], dtype=torch.int64, device=device)
    seen = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, mine)
    table = torch.stack(seen).cpu().tolist()  # sync-ok: three ints per rank, once per call
    prints = [row[0] for row in table]
    odd = next((r for r, fp in enumerate(prints) if fp != prints[0]), None)
    if odd is not None:
        raise ValueError(
            f"plan: the ranks disagree on the resharding plan (rank {odd} differs from rank 0; fingerprints "
            f"{prints[odd]:#x} and {prints[0]:#x}), expected every rank to call with the same plan_reshard "
            "result (same layouts, parameter shapes and dtypes, bucket_bytes); nothing was moved"
        )
    buckets = [row[1] for row in table]
    odd = next((r for r, i in enumerate(buckets) if i != buckets[0]), None)
    if odd is not None:
        raise ValueError(
            f"index: the ranks disagree on the bucket (rank {odd} runs bucket {buckets[odd]}, rank 0 bucket "
            f"{buckets[0]}), expected every rank to run the same bucket; nothing was moved"
        )
    if local is not None:
        raise local
    bad = [r for r, row in enumerate(table) if not row[2]]
    if bad:
        raise ValueError(f"params: rank(s) {bad} rejected their input (see their error); nothing was moved")


def _device(params: Mapping[str, torch.Tensor], out: Any) -> torch.device:
    # Where the agreement's few integers travel: the device the collectives use.
    if isinstance(out, torch.Tensor):
        return out.device
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
        return out[0].device
    first = next(iter(params.values()), None) if isinstance(params, Mapping) else None
    return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")


def _check_plan(plan: Any) -> None:
    if not isinstance(plan, ReshardPlan):
        raise ValueError(f"plan: got {type(plan).__name__}, expected a ReshardPlan from plan_reshard")


def reshard_bucket(
    params: Mapping[str, torch.Tensor], plan: ReshardPlan, index: int, *, mesh: Any, out: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Run bucket ``index`` of ``plan``: write this rank's inference shards into ``out``.

    Collective: every rank of the mesh calls it with the same ``index``.

    Args:
      params: this rank's training shards, name -> tensor of the training shard shape;
        only the parameters of this rank's pipeline stage.
      plan: from :func:`plan_reshard`.
      index: which bucket.
      mesh: ``plan.src.device_mesh(device_type)``, built once and reused.
      out: the bucket's flat buffer (from :func:`allocate_buckets`).

    Returns:
      name -> inference shard (a view of ``out``) for the parameters of the bucket.

    Raises:
      ValueError: on every rank, before any weight moves, when the ranks hold
        different plans (compared by :func:`plan_fingerprint`) or ask for different
        buckets, or when any rank's ``params`` / ``out`` do not match the plan.
    """
    _check_plan(plan)
    views, rank = _checked_bucket(params, plan, index, out)
    # Moving weights is not part of any graph: nn.Parameter sources must not record it.
    with torch.no_grad():
        _fill(views, params, plan, rank, mesh)
    return views


def _checked_bucket(
    params: Mapping[str, torch.Tensor], plan: ReshardPlan, index: int, out: Any
) -> tuple[dict[str, torch.Tensor], int]:
    """Check this rank's input, then agree with the other ranks; the bucket's views and this rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    local: Exception | None = None
    views: dict[str, torch.Tensor] = {}
    try:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(plan.buckets):
            raise ValueError(f"index: got {index!r}, expected a bucket number in [0, {len(plan.buckets)})")
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"out: got {type(out).__name__}, expected the bucket's flat buffer (allocate_buckets)")
        views = bucket_views(plan, index, out)
        check_reshard_params(params, plan, rank, views)
    except ValueError as err:
        local = err
    _agree(plan, index if isinstance(index, int) else -1, _device(params, out), local)
    return views, rank


def _send_buffer(x: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor:
    """``x`` contiguous, and a copy when it is the training parameter itself.

    The backend may hold a collective's input for a moment after the call returns
    (gloo's worker thread, NCCL's watchdog); the AllGather-Swap frees the parameter's
    storage right after its bucket, and :func:`rlcore.memory.offload` refuses a storage
    that anything else still holds. A later move's ``x`` is already a fresh buffer, and
    ``all_to_all`` sends a concatenated copy.
    """
    return x.clone(memory_format=torch.contiguous_format) if x is param else x.contiguous()


def _fill(
    views: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor], plan: ReshardPlan, rank: int, mesh: Any
) -> None:
    import torch.distributed as dist

    for name, view in views.items():
        pm = plan.params[name]
        x = param = params.get(name)
        for move in pm.moves:
            if move.collective == "broadcast":
                buf = _send_buffer(x, param) if x is not None else view.new_empty(pm.src_shape)
                dist.broadcast(buf, group=mesh["pp"].get_group(), group_src=plan.src.placements[name].stage)
                x = buf
                continue
            # A rank that does not hold the parameter receives it by the broadcast, always the first move.
            assert x is not None and move.tensor_dim is not None, "only a broadcast has no tensor dim"
            if move.collective == "all_gather":
                full = _gather(_send_buffer(x, param), mesh[move.mesh_dim], move.tensor_dim)
                c = plan.dst.coords(rank)[move.mesh_dim]
                x = full.chunk(move.dst_size, dim=move.tensor_dim)[c]
            elif move.collective == "all_to_all":
                x = _all_to_all(x.contiguous(), mesh[move.mesh_dim], move, plan, rank)
            else:
                c = plan.dst.coords(rank)[move.mesh_dim]
                k = move.dst_size // move.src_size
                x = x.chunk(k, dim=move.tensor_dim)[c % k]
        assert x is not None, "a rank holds or receives every parameter of its buckets"
        view.copy_(x)


def reshard(
    params: Mapping[str, torch.Tensor], plan: ReshardPlan, *, mesh: Any, out: list[torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Run every bucket of ``plan``: this rank's inference weights, name -> tensor.

    Collective over the mesh. ``out`` (default: :func:`allocate_buckets` on the
    device of ``params``) receives the weights; the returned tensors are its views.
    Every parameter is checked before the first collective, and the ranks first
    agree (one small all-gather) that they hold the same plan (:func:`plan_fingerprint`)
    and that every rank's input is valid: otherwise every rank raises ``ValueError``
    and nothing moves. See :func:`reshard_bucket` for the arguments.

    >>> import torch.distributed as dist
    >>> from rlcore.dataflow.layout import decoder_layout
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> w = {"model.layers.0.mlp.down_proj.weight": torch.arange(6.0).reshape(2, 3)}
    >>> lay = decoder_layout(w)
    >>> plan = plan_reshard(w, lay, lay)
    >>> reshard(w, plan, mesh=lay.device_mesh("cpu"))["model.layers.0.mlp.down_proj.weight"]
    tensor([[0., 1., 2.],
            [3., 4., 5.]])
    >>> dist.destroy_process_group()
    """
    import torch.distributed as dist

    _check_plan(plan)
    rank = dist.get_rank()
    local: Exception | None = None
    try:
        if not isinstance(params, Mapping):
            raise ValueError(f"params: got {type(params).__name__}, expected a dict of name -> tensor")
        if out is None:
            device = next(iter(params.values())).device if params else torch.device("cpu")
            out = allocate_buckets(plan, device)
        if not isinstance(out, (list, tuple)) or len(out) != len(plan.buckets):
            got = f"{len(out)} buffers" if isinstance(out, (list, tuple)) else type(out).__name__
            raise ValueError(f"out: got {got}, expected {len(plan.buckets)} (one per bucket)")
        for i, buf in enumerate(out):
            if not isinstance(buf, torch.Tensor):
                raise ValueError(f"out[{i}]: got {type(buf).__name__}, expected a flat tensor (allocate_buckets)")
            bucket_views(plan, i, buf)
        check_reshard_params(params, plan, rank, plan.params)
    except ValueError as err:
        local = err
    # One agreement for the whole plan; the buckets then run without further checks.
    _agree(plan, -1, _device(params, out), local)
    assert out is not None, "out is allocated or checked above"
    weights: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, buf in enumerate(out):
            views = bucket_views(plan, i, buf)
            _fill(views, params, plan, rank, mesh)
            weights.update(views)
    return weights
