"""Loop references for the memory layer: swap round trips, per-rank shards, transition peaks."""

from __future__ import annotations

from typing import Any

import torch

from rlcore.pytree import tree_map

__all__ = ["swap_roundtrip_ref"]


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
