"""Loop references for :mod:`rlcore.dataflow.dock` and :mod:`rlcore.dataflow.dispatch`.

:class:`TransferDockRef` is a single-threaded model of the Transfer Dock written as
plain dicts and loops over rows; with ``balance="fifo"`` (deterministic) a dock must
hand out exactly the rows the model does. :func:`balanced_partition_ref` finds the
optimal partition by exhaustive search, for tiny inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = ["TransferDockRef", "balanced_partition_ref"]


class TransferDockRef:
    """The Transfer Dock as dicts: ``cells[(row, column)] = (value, put stamp)``; fifo selection only.

    A cell is put once per iteration (a second put raises) and a consumer may give rows
    it holds back (:meth:`nack`), to be taken again.
    """

    def __init__(self, num_prompts: int, n_samples: int, consumers: Sequence[str]) -> None:
        self.n_samples = n_samples
        self.capacity = num_prompts * n_samples
        self.cells: dict[tuple[int, str], tuple[torch.Tensor, int]] = {}
        self.taken: dict[str, set[int]] = {c: set() for c in consumers}
        self.age = [0] * self.capacity
        self.completed = [True] * self.capacity
        self.stamp = 0

    def put(self, columns: dict[str, list[torch.Tensor]], indexes: Sequence[int]) -> None:
        """Store the cells; ``ValueError`` (storing nothing) if one is already put this iteration."""
        for column in columns:
            if any((i, column) in self.cells for i in indexes):
                raise ValueError(f"indexes: a cell of column {column!r} is already put")
        self.stamp += 1
        for column, rows in columns.items():
            for i, row in zip(indexes, rows):
                self.cells[(i, column)] = (row, self.stamp)

    def _ready_at(self, row: int, columns: Sequence[str]) -> int | None:
        stamps = [self.cells[(row, c)][1] for c in columns if (row, c) in self.cells]
        return max(stamps) if len(stamps) == len(columns) else None

    def get(self, consumer: str, columns: Sequence[str], count: int, *, by_group: bool = True) -> list[int]:
        """The rows a fifo get takes: oldest units first, then earliest ready, then lowest row."""
        size = self.n_samples if by_group else 1
        units = []
        for u in range(self.capacity // size):
            rows = list(range(u * size, (u + 1) * size))
            stamps = [s for s in (self._ready_at(r, columns) for r in rows) if s is not None]
            if len(stamps) < len(rows) or any(r in self.taken[consumer] for r in rows):
                continue
            units.append((-max(self.age[r] for r in rows), max(stamps), u, rows))
        if len(units) * size < count:
            return []
        units.sort()
        picked = [r for unit in units[: count // size] for r in unit[3]]
        self.taken[consumer].update(picked)
        return picked

    def nack(self, consumer: str, indexes: Sequence[int]) -> None:
        """Give rows back to ``consumer``; ``ValueError`` (changing nothing) unless it holds them all."""
        if not set(indexes) <= self.taken[consumer]:
            raise ValueError(f"indexes: rows not taken by {consumer!r}")
        self.taken[consumer].difference_update(indexes)

    def value(self, row: int, column: str) -> torch.Tensor:
        return self.cells[(row, column)][0]

    def set_completed(self, indexes: Sequence[int], completed: Sequence[bool]) -> None:
        for i, c in zip(indexes, completed):
            self.completed[i] = bool(c)

    def reset(self, keep: Sequence[str] = ()) -> None:
        for row, column in list(self.cells):
            if self.completed[row] or column not in keep:
                del self.cells[(row, column)]
        for taken in self.taken.values():
            taken.clear()
        self.age = [a + 1 if not c else 0 for a, c in zip(self.age, self.completed)]
        self.completed = [True] * self.capacity


def balanced_partition_ref(lengths: Sequence[int], k: int) -> int:
    """The smallest achievable maximum part load over all ``k ** len(lengths)`` assignments."""
    best = None
    for assign in itertools.product(range(k), repeat=len(lengths)):
        loads = [0] * k
        for part, n in zip(assign, lengths):
            loads[part] += n
        best = max(loads) if best is None else min(best, max(loads))
    return 0 if best is None else best
