"""Weight sync: the one path from the training layout to an inference engine, bucket by bucket.

MindSpeed-RL's resharding flow (Feng et al., arXiv:2507.19017): after an update the
trainer's parameters are moved into the inference layout through a
:func:`~rlcore.dataflow.plan_reshard` plan, one flat bucket at a time, and handed to
the engine -- an engine in the same process (:func:`load_into` copies the buckets into
its module) or a rollout worker in another process (the buckets are the message;
:func:`unpack_weights` turns them back into named tensors there). Every sync is timed
and its bytes counted (:attr:`WeightSync.records`).

Under ``torch.distributed`` each bucket is filled by the collective
:func:`~rlcore.dataflow.reshard_bucket`; in a single process whose two layouts are both
world size 1 the plan moves nothing and each bucket is a copy of the parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from rlcore.dataflow.layout import Layout, decoder_layout, param_meta
from rlcore.dataflow.reshard import ReshardPlan, allocate_buckets, bucket_views, plan_reshard, reshard_bucket

__all__ = ["SyncRecord", "WeightPacket", "WeightSync", "load_into", "unpack_weights"]


class WeightPacket(NamedTuple):
    """Inference weights as flat buckets: ``buffers[i]`` holds ``names[i]`` with ``shapes[i]``, in order."""

    version: int
    buffers: tuple[torch.Tensor, ...]
    names: tuple[tuple[str, ...], ...]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class SyncRecord(NamedTuple):
    """One sync: the weights version, seconds from the first bucket to the receiver's return, bytes moved."""

    version: int
    seconds: float
    nbytes: int


def unpack_weights(packet: WeightPacket) -> dict[str, torch.Tensor]:
    """Name -> tensor views of a :class:`WeightPacket`'s buckets (no copy).

    >>> p = WeightPacket(0, (torch.arange(6.0),), (("a", "b"),), (((2, 2), (2,)),))
    >>> {k: v.tolist() for k, v in unpack_weights(p).items()}
    {'a': [[0.0, 1.0], [2.0, 3.0]], 'b': [4.0, 5.0]}
    """
    out: dict[str, torch.Tensor] = {}
    for buf, names, shapes in zip(packet.buffers, packet.names, packet.shapes):
        offset = 0
        for name, shape in zip(names, shapes):
            numel = 1
            for s in shape:
                numel *= s
            out[name] = buf[offset : offset + numel].view(shape)
            offset += numel
    return out


def load_into(module: torch.nn.Module) -> Callable[[WeightPacket], None]:
    """A receiver copying a packet into ``module``'s parameters of the same names (the in-process engine).

    >>> m = torch.nn.Linear(2, 1, bias=False)
    >>> sync = WeightSync({"weight": torch.ones(1, 2)})
    >>> _ = sync.sync(0, load_into(m))
    >>> m.weight.tolist()
    [[1.0, 1.0]]
    """
    params = dict(module.named_parameters())

    def receive(packet: WeightPacket) -> None:
        weights = unpack_weights(packet)
        missing = sorted(set(params) - set(weights))
        if missing:
            raise ValueError(f"packet: got no weights for {missing}, expected every parameter of the engine")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(weights[name])

    return receive


class WeightSync:
    """Move ``params`` (training layout) into the inference layout, bucketed, and hand them to a receiver.

    Args:
      params: name -> this rank's training tensor (read at every :meth:`sync`, so
        in-place optimiser updates are seen).
      src_layout, dst_layout: training and inference :class:`~rlcore.dataflow.Layout`;
        default both :func:`~rlcore.dataflow.decoder_layout` of ``params`` (world size 1).
      bucket_bytes: the bound on one bucket (see :func:`~rlcore.dataflow.plan_reshard`).
      mesh: the training layout's device mesh, needed when the layouts span ranks.

    Attributes:
      plan: the :class:`~rlcore.dataflow.ReshardPlan`.
      records: a :class:`SyncRecord` per sync.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        src_layout: Layout | None = None,
        dst_layout: Layout | None = None,
        bucket_bytes: int = 64 << 20,
        mesh: Any = None,
    ) -> None:
        if not params:
            raise ValueError("params: got no tensors, expected name -> tensor of the training layout")
        self.params = dict(params)
        meta = param_meta(self.params)
        src = src_layout if src_layout is not None else decoder_layout(meta)
        dst = dst_layout if dst_layout is not None else src
        self.plan: ReshardPlan = plan_reshard(meta, src, dst, bucket_bytes=bucket_bytes)
        self.mesh = mesh
        self.local = src.world_size == 1 and dst.world_size == 1
        if not self.local and mesh is None:
            raise ValueError(
                f"mesh: got None for layouts over {src.world_size} ranks, expected the training layout's device mesh"
            )
        device = next(iter(self.params.values())).device
        self.buffers = allocate_buckets(self.plan, device)
        self.records: list[SyncRecord] = []

    def gather(self) -> WeightPacket:
        """Fill the buckets with the current parameters in the inference layout (collective when distributed)."""
        with torch.no_grad():
            for i, buf in enumerate(self.buffers):
                if self.local:
                    for name, view in bucket_views(self.plan, i, buf).items():
                        view.copy_(self.params[name])
                else:
                    reshard_bucket(self.params, self.plan, i, mesh=self.mesh, out=buf)
        names = tuple(b.names for b in self.plan.buckets)
        shapes = tuple(tuple(self.plan.params[n].dst_shape for n in b.names) for b in self.plan.buckets)
        return WeightPacket(-1, tuple(self.buffers), names, shapes)

    def sync(self, version: int, receiver: Callable[[WeightPacket], Any]) -> SyncRecord:
        """Gather the weights as ``version`` and call ``receiver(packet)``; returns (and records) the timing."""
        t0 = time.perf_counter()
        packet = self.gather()._replace(version=version)
        receiver(packet)
        record = SyncRecord(version, time.perf_counter() - t0, packet.nbytes)
        self.records.append(record)
        return record
