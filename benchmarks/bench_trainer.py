"""The trainer's deployments: async disaggregated rollout vs the synchronous loop; co-located memory accounting.

Run: python benchmarks/bench_trainer.py [--steps 400] [--warmup-steps 150] [--repeats 1]

1. Throughput. The main job's task and model (``configs/grpo_tiny.yaml``), trained by
   :func:`rlcore.train.train` -- the real trainer stages -- twice on the same number of
   samples:

   * synchronous: the blocking, staleness-0 pipeline (the synchronous loop), co-located,
     ``trainer.threads=2`` (both cores, as the main job runs);
   * async: ``deploy.mode=disaggregated``, ``deploy.async_infer=true``,
     ``deploy.staleness=1``: one rollout worker process (1 thread) beside the trainer
     (1 thread); rollout of step ``j + 1`` overlaps the update of step ``j``; weights
     reach the worker through the weight-sync path after every update.

   Both skip nothing: the same warm-up, rewards in a worker process, the same seeds.
   Samples per second are counted over the RL steps (the sum of the steps' wall
   times, from the first step's start to the last step's end; warm-up and worker
   start-up excluded). Prints each run's samples/s, the ratio (target >= 1.4x), the
   final rewards (mean of the last 10% of steps; target: within 0.05) and the mean
   policy lag of the async run.

2. Co-located accounting (no allocation: ``meta`` tensors). The 1.1B decoder layout
   (TinyLlama-1.1B shapes, bf16, AdamW state, a 2 GiB KV cache) as the trainer's
   co-located deployment plans it (:func:`rlcore.memory.colocated_plan` over
   :func:`rlcore.dataflow.plan_reshard`): the predicted device peak of the rollout
   phase with the swap plan (training state offloaded, inference weights built
   bucket by bucket) against the same step without it (training state resident while
   the inference weights are built beside it). Target: at most 0.6x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from rlcore.dataflow import decoder_layout, decoder_param_meta, plan_reshard
from rlcore.memory import MemoryPlan, colocated_plan
from rlcore.train import load_config, train

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def run(overrides: list[str]) -> tuple[float, float, float]:
    """samples/s over the RL steps, final reward (last 10% of steps), mean policy lag."""
    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", overrides)
    records = train(cfg).records
    samples = len(records) * cfg.rl.batch_size * cfg.rl.n_samples
    seconds = sum(r["step_time_s"] for r in records)
    k = max(1, len(records) // 10)
    return (
        samples / seconds,
        sum(r["reward"] for r in records[-k:]) / k,
        statistics.mean(r["policy_lag"] for r in records),
    )


def throughput(steps: int, warmup_steps: int, repeats: int) -> None:
    common = [
        f"trainer.steps={steps}",
        f"trainer.warmup_steps={warmup_steps}",
        "trainer.progress=false",
        "trainer.plot=false",
        "trainer.save_every=0",
    ]
    sync_rates, async_rates, sync_rewards, async_rewards, lags = [], [], [], [], []
    for r in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            rate, reward, _ = run([*common, f"trainer.output_dir={out}/sync", "trainer.threads=2"])
            sync_rates.append(rate)
            sync_rewards.append(reward)
            rate, reward, lag = run(
                [
                    *common,
                    f"trainer.output_dir={out}/async",
                    "trainer.threads=1",
                    "deploy.mode=disaggregated",
                    "deploy.async_infer=true",
                    "deploy.staleness=1",
                ]
            )
            async_rates.append(rate)
            async_rewards.append(reward)
            lags.append(lag)
        print(
            f"repeat {r}: synchronous {sync_rates[-1]:8.1f} samples/s, async {async_rates[-1]:8.1f} samples/s",
            flush=True,
        )
    s, a = statistics.median(sync_rates), statistics.median(async_rates)
    rs, ra = statistics.median(sync_rewards), statistics.median(async_rewards)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {steps} RL steps x {32 * 8} samples each")
    print(f"synchronous loop (co-located, blocking, 2 threads)     {s:8.1f} samples/s   final reward {rs:.3f}")
    print(f"async (disaggregated, staleness 1, 1+1 threads)        {a:8.1f} samples/s   final reward {ra:.3f}")
    ok = "met" if a / s >= 1.4 else "NOT met"
    close = "met" if abs(ra - rs) <= 0.05 else "NOT met"
    print(
        f"ratio {a / s:.2f}x (target >= 1.4x: {ok}); final rewards differ by {abs(ra - rs):.3f} "
        f"(target <= 0.05: {close}); mean policy lag {statistics.mean(lags):.2f}"
    )


def accounting() -> None:
    meta = decoder_param_meta(
        layers=22, hidden=2048, intermediate=5632, vocab=32000, kv_hidden=256, dtype=torch.bfloat16
    )
    layout = decoder_layout(meta)
    kv = 2 * GIB
    swap = colocated_plan(plan_reshard(meta, layout, layout, bucket_bytes=256 << 20), kv_cache_bytes=kv)
    # Without the swap plan: the training state stays on the device during the rollout.
    resident = {g: {"train": "device", "rollout": "device"} for g in ("params", "grads", "optimizer")}
    plain = MemoryPlan(swap.groups, {**swap.residency, **resident})
    for name, plan, order in (("with the swap plan", swap, "swap"), ("without it", plain, "naive")):
        t = plan.transition("train", "rollout", order=order)
        print(
            f"co-located 1.1B, rollout phase {name:<20} resident {plan.resident_bytes('rollout') / GIB:7.3f} GiB, "
            f"switch peak {t.peak_bytes / GIB:7.3f} GiB"
        )
    ratio = swap.resident_bytes("rollout") / plain.resident_bytes("rollout")
    print(f"rollout-phase predicted peak ratio {ratio:.2f}x (target <= 0.6x: {'met' if ratio <= 0.6 else 'NOT met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    accounting()
    throughput(args.steps, args.warmup_steps, args.repeats)


if __name__ == "__main__":
    main()
