"""The column schema's cost: one put's check, and the main job's step time with the checks on and off.

Run: python benchmarks/bench_columns.py [--steps 30] [--repeats 3]

1. One put's check (:meth:`rlcore.dataflow.Schema.check_put`) of the rollout stage's
   columns (``responses``, ``mask``, ``version``, ``policy_version``) at the main job's
   shape, against a dock put of the same columns: the check is a dtype and a rank
   comparison per column, no pass over the data.
2. The main job (``configs/grpo_tiny.yaml``, no warm-up, ``--steps`` steps) trained with
   the trainer's schema checks, and with :meth:`rlcore.dataflow.StageGraph.check_put`
   made a no-op, alternating ``--repeats`` times: the median step time (``step_time_s``
   of the step records, the first step left out) of each, and their ratio (target: 1.00
   within noise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from _timing import median_time
from rlcore.dataflow import StageGraph, TransferDock
from rlcore.train import COLUMNS, load_config, train

ROOT = Path(__file__).resolve().parents[1]


def put_cost() -> None:
    rows, width = 256, 5
    columns = {
        "responses": torch.ones(rows, width, dtype=torch.int64),
        "mask": torch.ones(rows, width),
        "version": torch.zeros(rows, dtype=torch.int64),
        "policy_version": torch.zeros(rows, dtype=torch.int64),
    }
    check = median_time(lambda: COLUMNS.check_put("stage 'rollout'", columns), repeats=2001, warmup=100)

    def put() -> None:
        TransferDock(rows // 8, 8).put(columns, range(rows))

    dock_put = median_time(put, repeats=201, warmup=10)
    print(
        f"one put's check: {check * 1e6:.2f} us; the dock put it precedes: {dock_put * 1e6:.1f} us "
        f"({check / dock_put:.1%} of it)",
        flush=True,
    )


def step_times(steps: int, checked: bool) -> list[float]:
    out = tempfile.mkdtemp(prefix="bench_columns-")
    overrides = [f"trainer.steps={steps}", "trainer.warmup_steps=0", "trainer.save_every=0", "trainer.plot=false"]
    overrides += ["trainer.progress=false", f"trainer.output_dir={out}"]
    real = StageGraph.check_put
    if not checked:
        StageGraph.check_put = lambda self, writer, columns: None  # type: ignore[method-assign]
    try:
        records = train(load_config(ROOT / "configs" / "grpo_tiny.yaml", overrides)).records
    finally:
        StageGraph.check_put = real  # type: ignore[method-assign]
    return [r["step_time_s"] for r in records[1:]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    put_cost()
    on: list[float] = []
    off: list[float] = []
    for i in range(args.repeats):
        off_i, on_i = step_times(args.steps, checked=False), step_times(args.steps, checked=True)
        print(
            f"repeat {i}: unchecked {statistics.median(off_i) * 1e3:.1f} ms, checked {statistics.median(on_i) * 1e3:.1f} ms"
        )
        off, on = off + off_i, on + on_i
    a, b = statistics.median(on), statistics.median(off)
    print(
        f"main job step, median of {len(on)} steps: checked {a * 1e3:.1f} ms, unchecked {b * 1e3:.1f} ms, ratio {a / b:.3f}"
    )


if __name__ == "__main__":
    main()
