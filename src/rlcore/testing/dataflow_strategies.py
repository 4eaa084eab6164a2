"""Hypothesis strategies for the dataflow layer: token lengths, dock programs, thread interleavings.

>>> from hypothesis import given
>>> @given(token_lengths(max_size=5))
... def check(lengths):
...     assert lengths.dtype == torch.int64 and bool((lengths >= 0).all())
>>> check()
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

__all__ = ["dock_interleavings", "dock_programs", "token_lengths"]


@st.composite
def token_lengths(draw: st.DrawFn, *, min_size: int = 0, max_size: int = 40, max_len: int = 4096) -> torch.Tensor:
    """A ``[B]`` int64 tensor of per-sample token counts in ``[0, max_len]``."""
    values = draw(st.lists(st.integers(0, max_len), min_size=min_size, max_size=max_size))
    return torch.tensor(values, dtype=torch.int64)


def dock_programs(*, rows: int = 12, n_samples: int = 3, max_ops: int = 25) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    """Op sequences over a dock of ``rows`` rows with columns ``a``, ``b`` and consumers ``c0``, ``c1``.

    Ops: ``("put", column, rows)``, ``("get", consumer, columns, units, by_group)`` (``units``
    groups of ``n_samples`` rows, or single rows), ``("nack", consumer, rows)``,
    ``("incomplete", rows)`` and ``("reset", keep)``; puts to cells already put and
    nacks of rows not held are part of the programs (both must raise). Replay them on a dock and on
    :class:`rlcore.testing.reference.TransferDockRef`.
    """
    row_lists = lambda size: st.lists(st.integers(0, rows - 1), min_size=1, max_size=size, unique=True)  # noqa: E731
    op = st.one_of(
        st.tuples(st.just("put"), st.sampled_from(["a", "b"]), row_lists(6)),
        st.tuples(
            st.just("get"),
            st.sampled_from(["c0", "c1"]),
            st.sampled_from([("a",), ("a", "b")]),
            st.integers(1, 3),
            st.booleans(),
        ),
        st.tuples(st.just("nack"), st.sampled_from(["c0", "c1"]), row_lists(3)),
        st.tuples(st.just("incomplete"), row_lists(4)),
        st.tuples(st.just("reset"), st.sampled_from([(), ("a",)])),
    )
    return st.lists(op, min_size=1, max_size=max_ops)


@st.composite
def dock_interleavings(draw: st.DrawFn, *, max_prompts: int = 6, max_samples: int = 3) -> dict[str, Any]:
    """A dock shape, the chunks producers put (a random order of all rows), and thread counts.

    Keys: ``num_prompts``, ``n_samples``, ``chunks`` (lists of rows covering the table once),
    ``producers``, ``threads_per_consumer``, ``units`` (groups or rows per get),
    ``by_group``, ``balance`` and ``seed``.
    """
    num_prompts = draw(st.integers(1, max_prompts))
    n_samples = draw(st.integers(1, max_samples))
    capacity = num_prompts * n_samples
    order = draw(st.permutations(range(capacity)))
    cuts = sorted(draw(st.lists(st.integers(1, max(capacity - 1, 1)), max_size=4, unique=True)))
    chunks = [order[a:b] for a, b in zip([0, *cuts], [*cuts, capacity]) if order[a:b]]
    return {
        "num_prompts": num_prompts,
        "n_samples": n_samples,
        "chunks": chunks,
        "producers": draw(st.integers(1, 3)),
        "threads_per_consumer": draw(st.integers(1, 3)),
        "units": draw(st.integers(1, 2)),
        "by_group": draw(st.booleans()),
        "balance": draw(st.sampled_from(["random", "fifo", "tokens"])),
        "seed": draw(st.integers(0, 2**16)),
    }
