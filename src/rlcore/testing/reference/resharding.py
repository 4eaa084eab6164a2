"""Loop references for the memory layer: swap round trips, per-rank shards, transition peaks."""

from __future__ import annotations

from typing import Any

import torch

from rlcore.pytree import tree_map

__all__ = ["local_shard_ref", "swap_roundtrip_ref"]


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
