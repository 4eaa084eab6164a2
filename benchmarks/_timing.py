"""Shared timing helper for the benchmark scripts: medians over repeats, printed as ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["alternated_medians", "median_time", "report"]


def median_time(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(name: str, ours: float, baseline: float, *, target: float | None = None) -> str:
    """One line: both medians and the speed-up ratio ``baseline / ours``."""
    ratio = baseline / ours
    goal = f"  (target >= {target:g}x: {'met' if ratio >= target else 'NOT met'})" if target else ""
    line = f"{name:<48} rlcore {ours * 1e3:9.3f} ms   baseline {baseline * 1e3:10.3f} ms   ratio {ratio:8.1f}x{goal}"
    print(line, flush=True)
    return line


def alternated_medians(fns: dict[str, Callable[[], object]], *, repeats: int = 30, warmup: int = 2) -> dict[str, float]:
    """Median wall time in seconds of each ``fn()``, their calls alternated (a load on the machine falls on all)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
