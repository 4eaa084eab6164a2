"""The time a checkpoint save holds training up: background (DCP async_save) vs synchronous, same state.

Run: python benchmarks/bench_checkpoint.py [--hidden 2048] [--layers 22] [--repeats 3] [--tokens 16]

The state is a Llama-shaped stack of linear layers with AdamW moments (weights and two
moments per parameter, float32), about 1.1B parameters at the defaults (the issue's
accounting model; lower ``--layers`` for what the machine's memory allows).

Each repeat is one training step after a save at a step boundary: the save call, then
the phases before the optimiser step (``--tokens`` decode-like forwards of 8 rows through
every layer: the rollout, scoring and the update's forward all read the weights and
change nothing), then ``optimizer.step()``.

* rlcore: :func:`rlcore.train.checkpoint.save_checkpoint_async` with
  ``stage_in_background`` (what the trainer does when no phase switch moves the state):
  the call returns at once, the copy to host memory runs during the phases, and the
  optimiser step waits for it (the trainer's step pre-hook). The stall is the call plus
  that wait.
* the co-located step, where the phase switch to the rollout moves the training state
  (the memory plan's swap: the parameters and the optimiser state offloaded to host
  memory, reloaded for the update; ``rlcore.memory.offload`` / ``reload``): the save
  takes its copy from the swap's own host copies
  (:class:`rlcore.train.swap_staging.SwapStaging`, what the trainer does there): the call
  copies nothing, the offload serves it, and the optimiser step's fence finds it taken.
  The stall is the call plus the fence's wait; the swap's seconds are printed with the
  save served and without (the save adds no copy to the swap).
* the same co-located step with the save staging inside the call
  (``stage_in_background=False``, before the swap copy): the stall is the call (the
  copy of the whole state).
* baseline: :func:`rlcore.train.save_checkpoint`, the same state written and committed
  before it returns.

Prints the phases' seconds with the copy running beside them and without (what the copy
slows them down by is not in the stall: on the CPU it shares the cores and the memory
bandwidth), the median stall of each and the ratios (the issue's target: the stall at most
10% of the synchronous save, a ratio >= 10x). Every save goes to the
same folder, as the trainer's do, and the writes and commits are waited for outside the
timing.
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
from rlcore.memory import offload, reload
from rlcore.pytree import tree_leaves
from rlcore.train import save_checkpoint
from rlcore.train.checkpoint import save_checkpoint_async
from rlcore.train.swap_staging import SwapStaging


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


def phases(model: torch.nn.Module, hidden: int, tokens: int) -> float:
    """The step's work before its optimiser step: ``tokens`` forwards of 8 rows through every layer; seconds."""
    start = time.perf_counter()
    x = torch.randn(8, hidden)
    with torch.no_grad():
        for _ in range(tokens):
            for layer in model:
                layer(x)
    return time.perf_counter() - start


def step(out: str, saved: dict, i: int, hidden: int, tokens: int, background: bool) -> tuple[float, float]:
    """One save at a step boundary and the next step: the seconds it stalled training, and the phases' seconds."""
    model, opt = saved["policy"]
    start = time.perf_counter()
    pending = save_checkpoint_async(out, {**saved, "step": i}, stage_in_background=background)
    stall = time.perf_counter() - start
    work = phases(model, hidden, tokens)
    start = time.perf_counter()
    pending.staged.result()  # the optimiser step's wait
    stall += time.perf_counter() - start
    opt.step()
    pending.result()
    return stall, work


def moved(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """What the co-located phase switch offloads for the rollout: the parameters and the optimiser state."""
    return {"params": dict(model.named_parameters()), "optimizer": list(opt.state.values())}


def colocated_step(
    out: str, saved: dict, i: int, hidden: int, tokens: int, swap_copy: bool
) -> tuple[float, float, float]:
    """A save, then the co-located step: the swap out and back, the phases, the optimiser step.

    The save's copy is the swap's (``swap_copy``) or taken inside the call. Returns the
    seconds the save stalled training, the phases' seconds and the swap's seconds.
    """
    model, opt = saved["policy"]
    staging = SwapStaging(lambda: [t for t in tree_leaves(moved(model, opt)) if isinstance(t, torch.Tensor)])
    start = time.perf_counter()
    pending = save_checkpoint_async(out, {**saved, "step": i}, staging=staging if swap_copy else None)
    stall = time.perf_counter() - start
    start = time.perf_counter()
    handle = offload(moved(model, opt))  # the switch to the rollout phase
    staging.offloaded([handle])
    reload(handle)  # the switch back to training (the rollout runs on weights built from the swap)
    swap = time.perf_counter() - start
    work = phases(model, hidden, tokens)
    start = time.perf_counter()
    staging.fence()  # the optimiser step's pre-hook
    pending.staged.result()
    stall += time.perf_counter() - start
    opt.step()
    pending.result()
    return stall, work, swap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="decode-like forwards before the optimiser step")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    saved = state(args.hidden, args.layers)
    params = sum(p.numel() for p in saved["policy"][0].parameters())
    print(f"{params / 1e9:.2f}B parameters, {3 * 4 * params / 2**30:.1f} GiB with the AdamW moments", flush=True)
    with tempfile.TemporaryDirectory() as out:
        behind, swapped, inside, syncs, work, alone = [], [], [], [], [], []
        swaps, swaps_alone = [], []
        for i in range(args.repeats + 1):  # the first of each is a warm-up
            stall, seconds = step(out, saved, i, args.hidden, args.tokens, background=True)
            served, _, swap = colocated_step(out, saved, i, args.hidden, args.tokens, swap_copy=True)
            in_call, quiet, swap_alone = colocated_step(out, saved, i, args.hidden, args.tokens, swap_copy=False)
            start = time.perf_counter()
            save_checkpoint(out, {**saved, "step": i})
            sync = time.perf_counter() - start
            if i:
                behind.append(stall)
                swapped.append(served)
                inside.append(in_call)
                syncs.append(sync)
                work.append(seconds)
                alone.append(quiet)
                swaps.append(swap)
                swaps_alone.append(swap_alone)
        print(
            f"phases before the optimiser step: {statistics.median(work):.2f} s beside the copy, "
            f"{statistics.median(alone):.2f} s without (medians)",
            flush=True,
        )
        print(
            f"co-located swap out and back: {statistics.median(swaps):.2f} s serving the save, "
            f"{statistics.median(swaps_alone):.2f} s without (medians)",
            flush=True,
        )
        sync = statistics.median(syncs)
        report("save stall: copy in the background vs sync", statistics.median(behind), sync, target=10)
        report("save stall: co-located, the swap's copy vs sync", statistics.median(swapped), sync, target=10)
        report("save stall: co-located, copy in the call vs sync", statistics.median(inside), sync, target=10)


if __name__ == "__main__":
    main()
