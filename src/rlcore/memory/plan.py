"""The memory plan: where each state group lives in each phase, and the predicted device peak.

A :class:`MemoryPlan` is declarative: per state group (training params, grads,
optimizer state, inference weights, KV cache, ...) its per-device bytes and, per
phase (``train``, ``rollout``, ``ref``, ...), where it lives: ``"device"``,
``"host"`` or ``"none"`` (not materialised). :meth:`MemoryPlan.transition` turns a
phase change into ordered steps and predicts the device bytes after, and the peak
during, every step.

Two orders are offered. ``"naive"`` is what a framework does when it builds the
inference weights while the training state is still resident and cleans up after.
``"swap"`` (MindSpeed-RL's AllGather-Swap, arXiv:2507.19017) releases first and
streams: (1) offload or free every group leaving the device that nothing is built
from; (2) build each derived group (inference weights from training params) one
bucket at a time, releasing the bucket's source right after it is consumed when the
source leaves the device too; (3) reload or allocate what the new phase needs. The
peak then exceeds the larger of the two phases' resident bytes by at most one
bucket in flight, where the naive order exceeds it by the whole derived group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rlcore._checks import check_choice

__all__ = [
    "ORDERS",
    "RESIDENCIES",
    "MemoryPlan",
    "StateGroup",
    "Step",
    "Transition",
    "colocated_plan",
]

RESIDENCIES = ("device", "host", "none")
ORDERS = ("swap", "naive")


@dataclasses.dataclass(frozen=True)
class StateGroup:
    """One group of state: ``nbytes`` per device when resident.

    A derived group names its ``source`` (the group it is built from on the device)
    and ``chunks``, one ``(built bytes, transient bytes, source bytes consumed)`` per
    transfer bucket; without chunks it is built in one piece.
    """

    name: str
    nbytes: int
    source: str | None = None
    chunks: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise ValueError(f"{self.name}: got nbytes {self.nbytes}, expected >= 0")
        if self.chunks and sum(c[0] for c in self.chunks) != self.nbytes:
            raise ValueError(
                f"{self.name}: chunks build {sum(c[0] for c in self.chunks)} bytes, expected nbytes={self.nbytes}"
            )


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a transition: ``action`` on ``group``; device bytes after it and the peak during it."""

    action: str
    group: str
    device_bytes: int
    peak_bytes: int


@dataclasses.dataclass(frozen=True)
class Transition:
    """The ordered steps from phase ``src`` to ``dst`` and the predicted device peak."""

    src: str
    dst: str
    order: str
    steps: tuple[Step, ...]
    start_bytes: int
    end_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max([self.start_bytes, *(s.peak_bytes for s in self.steps)])

    @property
    def redundancy_bytes(self) -> int:
        """Peak minus the larger of the two phases' resident bytes: the redundant copy."""
        return self.peak_bytes - max(self.start_bytes, self.end_bytes)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """State groups and, per group, its residency in every phase.

    >>> plan = MemoryPlan(
    ...     (StateGroup("params", 100), StateGroup("optimizer", 200), StateGroup("weights", 100, source="params")),
    ...     {"params": {"train": "device", "rollout": "host"},
    ...      "optimizer": {"train": "device", "rollout": "host"},
    ...      "weights": {"train": "none", "rollout": "device"}})
    >>> swap, naive = plan.transition("train", "rollout"), plan.transition("train", "rollout", order="naive")
    >>> swap.peak_bytes, swap.redundancy_bytes, naive.peak_bytes, naive.redundancy_bytes
    (300, 0, 400, 100)
    >>> [(s.action, s.group, s.device_bytes) for s in swap.steps]
    [('offload', 'optimizer', 100), ('build', 'weights', 100)]
    """

    groups: tuple[StateGroup, ...]
    residency: Mapping[str, Mapping[str, str]]

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"groups: got duplicate names {names}, expected unique ones")
        if set(self.residency) != set(names):
            raise ValueError(f"residency: got groups {sorted(self.residency)}, expected {sorted(names)}")
        phases = set(next(iter(self.residency.values()), {}))
        for g in self.groups:
            where = self.residency[g.name]
            if set(where) != phases:
                raise ValueError(f"residency[{g.name!r}]: got phases {sorted(where)}, expected {sorted(phases)}")
            for phase, r in where.items():
                check_choice(f"residency[{g.name!r}][{phase!r}]", r, RESIDENCIES)
            if g.source is not None and g.source not in names:
                raise ValueError(f"{g.name}: got source {g.source!r}, expected one of {names}")

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(next(iter(self.residency.values()), {}))

    def group(self, name: str) -> StateGroup:
        return next(g for g in self.groups if g.name == name)

    def resident_bytes(self, phase: str) -> int:
        """Device bytes of the groups resident in ``phase``."""
        check_choice("phase", phase, self.phases)
        return sum(g.nbytes for g in self.groups if self.residency[g.name][phase] == "device")

    def transition(self, src: str, dst: str, *, order: str = "swap") -> Transition:
        """The steps from phase ``src`` to ``dst`` in ``order`` (``"swap"`` or ``"naive"``), with predicted bytes.

        Raises ``ValueError`` when a group is to be built from a source that is not on
        the device in ``src``.
        """
        check_choice("src", src, self.phases)
        check_choice("dst", dst, self.phases)
        check_choice("order", order, ORDERS)
        moves = {}
        for g in self.groups:
            a, b = self.residency[g.name][src], self.residency[g.name][dst]
            if a == "device" and b != "device":
                moves[g.name] = "offload" if b == "host" else "free"
            elif a != "device" and b == "device":
                if g.source is not None:
                    if self.residency[g.source][src] != "device":
                        raise ValueError(
                            f"{g.name}: built from {g.source!r}, which is {self.residency[g.source][src]!r} in "
                            f"phase {src!r}, expected it on the device"
                        )
                    moves[g.name] = "build"
                else:
                    moves[g.name] = "reload" if a == "host" else "alloc"
        sources = {self.group(n).source for n, m in moves.items() if m == "build"}
        cur = self.resident_bytes(src)
        steps: list[Step] = []

        def release(name: str) -> None:
            nonlocal cur
            cur -= self.group(name).nbytes
            steps.append(Step(moves[name], name, cur, cur + self.group(name).nbytes))

        def grow(name: str) -> None:
            nonlocal cur
            cur += self.group(name).nbytes
            steps.append(Step(moves[name], name, cur, cur))

        def build(name: str, stream: bool) -> None:
            nonlocal cur
            g = self.group(name)
            assert g.source is not None, "only derived groups get a build move"
            peak = cur
            for built, transient, consumed in g.chunks or ((g.nbytes, 0, self.group(g.source).nbytes),):
                peak = max(peak, cur + built + transient)
                cur += built - (consumed if stream else 0)
            if stream:
                moves.pop(g.source)
            steps.append(Step("build", name, cur, peak))

        decreasing = [n for n, m in moves.items() if m in ("offload", "free")]
        increasing = [n for n, m in moves.items() if m in ("reload", "alloc")]
        builds = [n for n, m in moves.items() if m == "build"]
        if order == "swap":
            for n in decreasing:
                if n not in sources:
                    release(n)
            for n in builds:
                build(n, stream=self.group(n).source in moves)
            for n in decreasing:
                if n in moves and n in sources:
                    release(n)
            for n in increasing:
                grow(n)
        else:
            for n in builds:
                build(n, stream=False)
            for n in increasing:
                grow(n)
            for n in decreasing:
                release(n)
        return Transition(src, dst, order, tuple(steps), self.resident_bytes(src), self.resident_bytes(dst))


def colocated_plan(
    reshard_plan: Any,
    *,
    rank: int = 0,
    grad_bytes: int | None = None,
    optimizer_bytes: int | None = None,
    kv_cache_bytes: int = 0,
) -> MemoryPlan:
    """The usual co-located plan of one rank: train on the device, then roll out on the device.

    ``train``: params, grads and optimizer state on the device. ``rollout``: those
    three on the host, the inference weights (built from the params through
    ``reshard_plan``, bucket by bucket) and the KV cache on the device.

    Args:
      reshard_plan: a :class:`~rlcore.dataflow.reshard.ReshardPlan` (training -> inference layout).
      rank: the rank whose bytes are planned (ranks differ under pipeline parallelism).
      grad_bytes: gradient bytes; default as many as the params.
      optimizer_bytes: optimizer state bytes; default Adam's two moments in the params'
        dtype, as ``torch.optim.AdamW`` keeps them (pass more for float32 master weights).
      kv_cache_bytes: what the inference engine allocates for its KV cache.

    Returns:
      A :class:`MemoryPlan` with phases ``train`` and ``rollout``.

    >>> import torch
    >>> from rlcore.dataflow import decoder_layout, plan_reshard
    >>> meta = {"lm_head.weight": torch.empty(64, 32, dtype=torch.bfloat16, device="meta")}
    >>> rplan = plan_reshard(meta, decoder_layout(meta, tp=2), decoder_layout(meta, dp=2))
    >>> plan = colocated_plan(rplan, kv_cache_bytes=1024)
    >>> plan.resident_bytes("train"), plan.resident_bytes("rollout")
    (8192, 5120)
    """
    if not all(callable(getattr(reshard_plan, a, None)) for a in ("src_bytes", "dst_bytes")):
        raise ValueError(f"reshard_plan: got {type(reshard_plan).__name__}, expected a ReshardPlan (plan_reshard)")
    params = reshard_plan.src_bytes(rank)
    chunks = tuple((b.nbytes, b.transient_bytes, reshard_plan.src_bytes(rank, b.names)) for b in reshard_plan.buckets)
    groups = (
        StateGroup("params", params),
        StateGroup("grads", params if grad_bytes is None else grad_bytes),
        StateGroup("optimizer", 2 * params if optimizer_bytes is None else optimizer_bytes),
        StateGroup("inference_weights", reshard_plan.dst_bytes(), source="params", chunks=chunks),
        StateGroup("kv_cache", kv_cache_bytes),
    )
    host = {"train": "device", "rollout": "host"}
    residency = {
        "params": host,
        "grads": host,
        "optimizer": host,
        "inference_weights": {"train": "none", "rollout": "device"},
        "kv_cache": {"train": "none", "rollout": "device"},
    }
    return MemoryPlan(groups, residency)
