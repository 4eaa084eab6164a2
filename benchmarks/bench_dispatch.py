"""Sample-flow dispatch: max/mean token load over 8 ranks, balanced partition vs contiguous split.

Run: python benchmarks/bench_dispatch.py
1,024 sequences with heavy-tailed (log-normal, clamped to [16, 16384]) prompt+response
lengths, split over 8 data-parallel ranks. Prints, over several seeds, the median of
max(rank load) / mean(rank load) for Karmarkar-Karp and LPT (target <= 1.02), for the
contiguous equal-count split that a plain DistributedSampler gives, and the same with
GRPO groups of 8 kept whole; plus the median time of one partition.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import median_time
from rlcore.dataflow import balanced_partition

BATCH, RANKS, GROUP, SEEDS = 1024, 8, 8, 7


def heavy_tailed(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.empty(BATCH).log_normal_(6.5, 1.0, generator=g).clamp(16, 16384).to(torch.int64)


def imbalance(parts: list[torch.Tensor], lengths: torch.Tensor) -> float:
    loads = [int(lengths[p].sum()) for p in parts]
    return max(loads) / (sum(loads) / len(loads))


def main() -> None:
    torch.set_num_threads(1)
    group_ids = torch.arange(BATCH) // GROUP
    contiguous = list(torch.arange(BATCH).tensor_split(RANKS))
    rows = {
        "contiguous split (baseline)": lambda x: imbalance(contiguous, x),
        "balanced, Karmarkar-Karp": lambda x: imbalance(balanced_partition(x, RANKS), x),
        "balanced, LPT": lambda x: imbalance(balanced_partition(x, RANKS, method="lpt"), x),
        "balanced KK, equal counts": lambda x: imbalance(balanced_partition(x, RANKS, equal_size=True), x),
        f"balanced KK, groups of {GROUP} whole": lambda x: imbalance(
            balanced_partition(x, RANKS, group_ids=group_ids), x
        ),
    }
    data = [heavy_tailed(seed) for seed in range(SEEDS)]
    print(f"{BATCH} sequences, {RANKS} ranks, median over {SEEDS} seeds of max/mean token load")
    baseline = statistics.median(rows["contiguous split (baseline)"](x) for x in data)
    for name, fn in rows.items():
        value = statistics.median(fn(x) for x in data)
        goal = (
            ""
            if "baseline" in name
            else f"   {baseline / value:5.2f}x better than contiguous   (target <= 1.02: {'met' if value <= 1.02 else 'NOT met'})"
        )
        print(f"  {name:<34} max/mean {value:7.4f}{goal}", flush=True)
    for method in ("kk", "lpt"):
        seconds = median_time(lambda: balanced_partition(data[0], RANKS, method=method), repeats=7)
        print(f"  time of one partition ({method}): {seconds * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
