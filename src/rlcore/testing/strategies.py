"""Hypothesis strategies for RL batches: token tensors, masks, groups, logits.

Structure (shapes, lengths, interior mask holes, group sizes) is drawn by hypothesis so
it shrinks to small counter-examples; the bulk values come from a seeded torch
generator (fast at any size) in one of several patterns that exercise the numerics:
plain normals, wide ranges, constant rows, and values with a large common offset.

>>> from hypothesis import given
>>> @given(token_batches(max_batch=3, max_len=5))
... def check(batch):
...     assert batch["values"].shape == batch["mask"].shape
>>> check()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import strategies as st

__all__ = [
    "PATTERNS",
    "float_tensors",
    "group_ids",
    "grouped_scores",
    "logits_and_labels",
    "masks",
    "token_batches",
]

PATTERNS = ("normal", "wide", "constant", "offset", "binary")


def _generate(shape: Sequence[int], pattern: str, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if pattern == "normal":
        return torch.randn(shape, generator=g, dtype=torch.float64) * scale
    if pattern == "wide":
        mag = torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(-6.0, 6.0, generator=g))
        sign = torch.randint(0, 2, shape, generator=g, dtype=torch.float64) * 2 - 1
        return mag * sign * scale / 10
    if pattern == "constant":
        v = torch.randn((), generator=g, dtype=torch.float64) * scale * 10
        return torch.full(shape, float(v), dtype=torch.float64)
    if pattern == "offset":
        return 1e4 + torch.randn(shape, generator=g, dtype=torch.float64) * scale
    if pattern == "binary":
        return torch.randint(0, 2, shape, generator=g, dtype=torch.float64)
    raise ValueError(f"pattern: got {pattern!r}, expected one of {PATTERNS}")


@st.composite
def float_tensors(
    draw: st.DrawFn,
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    patterns: Sequence[str] = PATTERNS,
    scale: float = 1.0,
) -> torch.Tensor:
    """A float tensor of ``shape`` whose values follow one of ``patterns``."""
    pattern = draw(st.sampled_from(tuple(patterns)))
    seed = draw(st.integers(0, 2**31 - 1))
    return _generate(shape, pattern, seed, scale).to(dtype)


@st.composite
def masks(
    draw: st.DrawFn,
    batch: int,
    length: int,
    *,
    interior_zeros: bool = True,
    allow_empty: bool = True,
    dtype: torch.dtype = torch.bool,
) -> torch.Tensor:
    """A ``[batch, length]`` mask: right padding per row, plus (optionally) interior zeros.

    Interior zeros model multi-turn observation tokens inside a response.
    """
    rows = []
    for _ in range(batch):
        n = draw(st.integers(0 if allow_empty else min(1, length), length))
        row = [True] * n + [False] * (length - n)
        if interior_zeros and n > 2:
            holes = draw(st.lists(st.integers(1, n - 2), max_size=max(1, n // 3)))
            for h in holes:
                row[h] = False
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(batch, length).to(dtype)


@st.composite
def token_batches(
    draw: st.DrawFn,
    *,
    min_batch: int = 1,
    max_batch: int = 8,
    min_len: int = 1,
    max_len: int = 32,
    dtype: torch.dtype = torch.float32,
    interior_zeros: bool = True,
    allow_empty_rows: bool = True,
    patterns: Sequence[str] = PATTERNS,
    mask_dtype: torch.dtype = torch.bool,
) -> dict[str, torch.Tensor]:
    """A token batch ``{"values": [B, T], "mask": [B, T]}``, right-padded with interior holes.

    Padded positions hold ``nan`` so that any leak of padding into a result shows.
    """
    b = draw(st.integers(min_batch, max_batch))
    t = draw(st.integers(min_len, max_len))
    mask = draw(masks(b, t, interior_zeros=interior_zeros, allow_empty=allow_empty_rows, dtype=mask_dtype))
    values = draw(float_tensors((b, t), dtype=torch.float64, patterns=patterns))
    values = torch.where(mask.bool(), values, float("nan")).to(dtype)
    return {"values": values, "mask": mask}


@st.composite
def group_ids(
    draw: st.DrawFn,
    *,
    min_groups: int = 1,
    max_groups: int = 8,
    min_size: int = 1,
    max_size: int = 8,
    shuffle: bool = True,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """``[B]`` integer group ids ``0..G-1`` with uneven group sizes, shuffled (non-contiguous)."""
    sizes = draw(st.lists(st.integers(min_size, max_size), min_size=min_groups, max_size=max_groups))
    ids = [g for g, s in enumerate(sizes) for _ in range(s)]
    if shuffle:
        ids = draw(st.permutations(ids))
    return torch.tensor(list(ids), dtype=dtype)


@st.composite
def grouped_scores(
    draw: st.DrawFn,
    *,
    dtype: torch.dtype = torch.float32,
    max_groups: int = 8,
    max_size: int = 8,
    patterns: Sequence[str] = PATTERNS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [B], group_ids [B])``; some groups may be constant (all-equal scores)."""
    ids = draw(group_ids(max_groups=max_groups, max_size=max_size))
    n_groups = int(ids.max()) + 1
    per_group = draw(st.lists(st.sampled_from(tuple(patterns)), min_size=n_groups, max_size=n_groups))
    seed = draw(st.integers(0, 2**31 - 1))
    scores = torch.empty(ids.shape[0], dtype=torch.float64)
    for g, pattern in enumerate(per_group):
        sel = ids == g
        scores[sel] = _generate((int(sel.sum()),), pattern, seed + g, 1.0)
    return scores.to(dtype), ids


@st.composite
def logits_and_labels(
    draw: st.DrawFn,
    *,
    max_tokens: int = 64,
    max_vocab: int = 64,
    dtype: torch.dtype = torch.float32,
    scale: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [N, V], labels [N])`` with labels in ``[0, V)``."""
    n = draw(st.integers(1, max_tokens))
    v = draw(st.integers(2, max_vocab))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    return logits, labels
