"""Record the shape of every tensor an operation creates, to prove memory claims in tests.

A peak-memory number on the CPU is noisy and allocator-dependent; which shapes a
function allocates is exact. ``with record_allocations() as shapes:`` runs the body
under a dispatch mode that notes each operator's output shapes (the backward pass
included when it runs inside the block), so a test can assert, for example, that a
chunked kernel never creates a ``[tokens, vocab]`` tensor.

>>> with record_allocations() as shapes:
...     _ = torch.ones(2, 3).sum(0)
>>> (2, 3) in shapes and (3,) in shapes
True
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["record_allocations"]


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Views and in-place results alias an input: they allocate nothing.
        aliases = func._schema.is_mutable or any(a.alias_info is not None for a in func._schema.returns)
        if not aliases:
            self.shapes.extend(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@contextmanager
def record_allocations() -> Iterator[list[tuple[int, ...]]]:
    """Yield a list that fills with the shape of every new tensor created in the block.

    Views and in-place operations (outputs aliasing an input) are not counted.
    """
    recorder = _Recorder()
    with recorder:
        yield recorder.shapes
