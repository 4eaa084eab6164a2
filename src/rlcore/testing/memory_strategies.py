"""Hypothesis strategies for the memory and resharding layers: tensor pytrees and model shapes.

>>> from hypothesis import given, settings
>>> @settings(max_examples=3)
... @given(tensor_trees())
... def check(tree):
...     assert isinstance(tree, dict)
>>> check()
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

__all__ = ["SWAP_DTYPES", "tensor_trees"]

SWAP_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g).to(dtype)


@st.composite
def tensor_trees(draw: st.DrawFn, *, max_leaves: int = 6, dtypes: tuple[torch.dtype, ...] = SWAP_DTYPES) -> dict:
    """A nested dict of tensors of mixed dtypes, with empty tensors, strided views and tied leaves.

    Views are taken of a tensor that is also in the tree, and a tied leaf is the same
    object as an earlier one, so a swap must move each storage exactly once.
    """
    n = draw(st.integers(1, max_leaves))
    tree: dict = {"nested": {}}
    made: list[torch.Tensor] = []
    for i in range(n):
        kind = draw(st.sampled_from(("plain", "view", "tied") if made else ("plain",)))
        if kind == "plain":
            shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
            leaf = _values(shape, draw(st.sampled_from(dtypes)), draw(st.integers(0, 2**31 - 1)))
            made.append(leaf)
        else:
            base = made[draw(st.integers(0, len(made) - 1))]
            if kind == "view" and base.dim() >= 1:
                leaf = base.transpose(0, -1)[..., ::2]
            else:
                leaf = base
        (tree if i % 2 else tree["nested"])[f"t{i}"] = leaf
    return tree
