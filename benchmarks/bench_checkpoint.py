"""The time a checkpoint save holds training up: background (DCP async_save) vs synchronous, same state.

Run: python benchmarks/bench_checkpoint.py [--hidden 2048] [--layers 22] [--repeats 3]

The state is a Llama-shaped stack of linear layers with AdamW moments (weights and two
moments per parameter, float32), about 1.1B parameters at the defaults (the issue's
accounting model; lower ``--layers`` for what the machine's memory allows).

* rlcore: :func:`rlcore.train.checkpoint.save_checkpoint_async`: the stall is the call
  (staging the tensors to host memory, the data file, the folder); the write and the
  commit run in the background and are waited for outside the timing.
* baseline: :func:`rlcore.train.save_checkpoint`, the same state written and committed
  before it returns.

Prints the median stall of each and the ratio (the issue's target: the stall at most 10%
of the synchronous save, a ratio >= 10x). Each save goes to the same folder, as the
trainer's do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import report
from rlcore.train import save_checkpoint
from rlcore.train.checkpoint import save_checkpoint_async


def state(hidden: int, layers: int) -> dict:
    """A model of ``layers`` blocks (attention 4 h^2, MLP 8 h^2 parameters) and its AdamW after one step."""
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden, bias=False), torch.nn.Linear(hidden, 8 * hidden, bias=False)]
    model = torch.nn.Sequential(*blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return {"policy": (model, opt), "step": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    saved = state(args.hidden, args.layers)
    params = sum(p.numel() for p in saved["policy"][0].parameters())
    print(f"{params / 1e9:.2f}B parameters, {3 * 4 * params / 2**30:.1f} GiB with the AdamW moments", flush=True)
    with tempfile.TemporaryDirectory() as out:
        stalls, syncs = [], []
        for i in range(args.repeats + 1):  # the first of each is a warm-up
            start = time.perf_counter()
            pending = save_checkpoint_async(out, {**saved, "step": i})
            stall = time.perf_counter() - start
            pending.result()
            start = time.perf_counter()
            save_checkpoint(out, {**saved, "step": i})
            sync = time.perf_counter() - start
            if i:
                stalls.append(stall)
                syncs.append(sync)
        report("save stall: async_save vs synchronous", statistics.median(stalls), statistics.median(syncs), target=10)


if __name__ == "__main__":
    main()
