"""Loop references for the memory layer: swap round trips, per-rank shards, transition peaks."""

from __future__ import annotations

from typing import Any

import torch

from rlcore.pytree import tree_map

__all__ = ["local_shard_ref", "swap_roundtrip_ref", "transition_peak_ref", "unshard_ref"]


def swap_roundtrip_ref(tree: Any) -> Any:
    """What ``reload(offload(tree))`` must hold: an element-by-element copy of every tensor leaf."""

    def copy(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        out = torch.empty(x.shape, dtype=x.dtype)
        for i, v in enumerate(x.reshape(-1)):
            out.view(-1)[i] = v
        return out

    return tree_map(copy, tree)


def local_shard_ref(full: torch.Tensor, layout: Any, name: str, rank: int) -> torch.Tensor | None:
    """The shard of ``full`` that ``rank`` holds under ``layout`` (``None`` off its pipeline stage).

    Built index by index: along each split tensor dim, the ``c``-th of ``n`` equal
    chunks is the indices ``[c * size / n, (c + 1) * size / n)``.
    """
    if not layout.holds(name, rank):
        return None
    p, coords = layout.placements[name], layout.coords(rank)
    out = full
    for mesh_dim in ("tp", "ep"):
        tdim = getattr(p, mesh_dim)
        if tdim is None:
            continue
        n, c = getattr(layout, mesh_dim), coords[mesh_dim]
        size = full.shape[tdim] // n
        index = []
        for i in range(full.shape[tdim]):
            if c * size <= i < (c + 1) * size:
                index.append(i)
        out = out.index_select(tdim, torch.tensor(index, dtype=torch.long))
    return out.clone()


def transition_peak_ref(plan: Any, src: str, dst: str) -> int:
    """The lowest device peak over every order of whole-group moves from phase ``src`` to ``dst``.

    Tries each permutation of the groups that change residency; a group built from a
    source must be built, chunk after chunk, while the whole source is still on the
    device (no streaming). Exponential: for plans of a handful of groups.
    """
    import itertools

    deltas, builds = {}, {}
    for g in plan.groups:
        a, b = plan.residency[g.name][src], plan.residency[g.name][dst]
        if (a == "device") != (b == "device"):
            deltas[g.name] = g.nbytes if b == "device" else -g.nbytes
            if b == "device" and g.source is not None:
                builds[g.name] = g
    start = sum(g.nbytes for g in plan.groups if plan.residency[g.name][src] == "device")
    best = None
    for perm in itertools.permutations(deltas):
        cur, peak, gone, ok = start, start, set(), True
        for name in perm:
            if name in builds:
                g = builds[name]
                if g.source in gone:
                    ok = False
                    break
                running = cur
                for built, transient, _ in g.chunks or ((g.nbytes, 0, 0),):
                    peak = max(peak, running + built + transient)
                    running += built
            cur += deltas[name]
            peak = max(peak, cur)
            if deltas[name] < 0:
                gone.add(name)
        if ok:
            best = peak if best is None else min(best, peak)
    return start if best is None else best


def unshard_ref(shards: dict[int, torch.Tensor], layout: Any, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The full tensor ``name`` put back together from ``rank -> shard`` under ``layout``.

    Every holding rank writes its shard at its chunk offsets; replicas must agree.
    """
    out: torch.Tensor | None = None
    seen: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
    for rank, shard in shards.items():
        if not layout.holds(name, rank):
            continue
        if out is None:
            out = torch.empty(shape, dtype=shard.dtype)
        index = [slice(None)] * len(shape)
        for tdim, (c, n) in layout.local_index(name, rank).items():
            size = shape[tdim] // n
            index[tdim] = slice(c * size, (c + 1) * size)
        key = tuple((i.start, i.stop) for i in index)
        if key in seen and not torch.equal(seen[key], shard):
            raise AssertionError(f"{name}: replicas of chunk {key} differ (rank {rank})")
        seen[key] = shard
        out[tuple(index)].copy_(shard)
    if out is None:
        raise AssertionError(f"{name}: no rank in {sorted(shards)} holds it")
    return out
