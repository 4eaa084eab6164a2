"""Loop reference of :mod:`rlcore.algos.replay`: a list of stored rows, walked one at a time."""

from __future__ import annotations

import math

__all__ = ["ReplayBufferRef"]


class ReplayBufferRef:
    """The replay buffer's rules on Python lists: ``rows`` holds ``(priority, uses, id)`` in slot order.

    ``insert`` offers rows ``(priority, keep, id)``; ``serve`` returns the served ids.
    """

    def __init__(self, capacity: int, max_reuse: int):
        self.capacity, self.max_reuse = capacity, max_reuse
        self.rows: list[tuple[float, int, int]] = []

    def insert(self, offered: list[tuple[float, bool, int]]) -> None:
        pool = list(self.rows) + [(p, 0, i) for p, keep, i in offered if keep and math.isfinite(p)]
        ranked = sorted(range(len(pool)), key=lambda j: -pool[j][0])  # sorted() is stable: stored first on ties
        self.rows = [pool[j] for j in ranked[: self.capacity]]

    def serve(self, k: int) -> list[int]:
        eligible = [j for j in range(len(self.rows)) if self.rows[j][1] < self.max_reuse]
        picked = sorted(eligible, key=lambda j: -self.rows[j][0])[:k]
        served = [self.rows[j][2] for j in picked]
        for j in picked:
            p, uses, i = self.rows[j]
            self.rows[j] = (p, uses + 1, i)
        self.rows = [r for r in self.rows if r[1] < self.max_reuse]
        return served
