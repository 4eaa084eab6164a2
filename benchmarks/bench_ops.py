"""Segment statistics and the reverse linear scan against the loops they replace.

Run: python benchmarks/bench_ops.py
Prints, per figure, the rlcore median, the baseline median measured in the same run,
and their ratio.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import median_time, report
from rlcore.ops import reverse_linear_scan, segment_mean_std


def bench_segments(batch: int = 16384, group: int = 16) -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(batch, generator=g)
    ids = torch.randperm(batch, generator=g) % (batch // group)
    n = batch // group

    def ours() -> None:
        segment_mean_std(scores, ids, num_segments=n)

    def loop() -> None:
        # The per-group loop peers write: select each group, then mean and std.
        for k in range(n):
            sel = scores[ids == k]
            sel.mean()
            sel.std()

    report(
        f"segment mean+std, B={batch}, groups of {group}",
        median_time(ours, repeats=51),
        median_time(loop, repeats=5),
        target=100,
    )


def bench_scan(batch: int = 64, length: int = 4096) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, length, generator=g)
    c = 0.99 * torch.rand(batch, length, generator=g)

    def loop() -> torch.Tensor:
        out = torch.empty_like(x)
        acc = torch.zeros(batch)
        for t in range(length - 1, -1, -1):
            acc = x[:, t] + c[:, t] * acc
            out[:, t] = acc
        return out

    torch.testing.assert_close(reverse_linear_scan(x, c), loop(), rtol=1e-4, atol=1e-4)
    report(
        f"reverse_linear_scan [{batch}, {length}]",
        median_time(lambda: reverse_linear_scan(x, c), repeats=51),
        median_time(loop, repeats=5),
        target=10,
    )


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_segments()
    bench_scan()
