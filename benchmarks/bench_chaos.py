"""The chaos benchmark of issue 29: the main job, disaggregated, its rollout worker SIGKILLed every 10 steps.

Run: python benchmarks/bench_chaos.py [--backend local|ray|both] [--steps 400] [--every 10] [--reward-at 55]

The main job (``configs/grpo_tiny.yaml``: its model, task, warm-up and 400 GRPO steps) runs
with ``deploy.mode: disaggregated`` (a worker process, or a Ray actor with ``--backend ray``)
and one reward worker, ``trainer.max_worker_restarts`` high enough for every kill. While
step ``s`` is scored (:class:`rlcore.testing.chaos.ChaosReward`, in the reward worker) the
rollout worker is SIGKILLed when ``s + 1`` is a multiple of ``--every``, and the reward
worker kills itself once, at ``--reward-at``. The baseline is the undisturbed run with the same
seed and deployment. Prints, per backend: the restarts against the kills, whether every
row of every step was generated and trained exactly once (the dock's row ids in
:attr:`rlcore.train.Run.tasks`), the final rewards (mean of the last 10% of steps) and their
gap (the issue's bound: 0.03; the blocking pipeline makes the two runs equal), whether the
final weights are equal, and the wall time of each run and their ratio (what the restarts cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from rlcore.testing.chaos import ChaosReward
from rlcore.train import load_config, make_task, train
from rlcore.train.prompts import task_options

ROOT = Path(__file__).resolve().parents[1]


def config(out: Path, backend: str, steps: int) -> object:
    return load_config(
        ROOT / "configs" / "grpo_tiny.yaml",
        [
            f"trainer.steps={steps}",
            f"trainer.output_dir={out}",
            "trainer.progress=false",
            "trainer.plot=false",
            "trainer.export=false",
            "trainer.save_every=0",
            "trainer.reward_workers=1",
            f"trainer.max_worker_restarts={steps}",
            "deploy.mode=disaggregated",
            f"deploy.backend={backend}",
        ],
    )


def final_reward(records: list[dict]) -> float:
    return statistics.fmean(r["reward"] for r in records[-max(1, len(records) // 10) :])


def exactly_once(run: object, steps: int, rows: int) -> bool:
    for stage in ("rollout", "update"):
        for j in range(steps):
            got = torch.cat([t.rows for t in run.tasks if t.stage == stage and t.iteration == j])
            if sorted(got.tolist()) != list(range(rows)):
                return False
    return True


def bench(backend: str, steps: int, every: int, reward_at: int, tmp: Path) -> None:
    cfg = config(tmp / f"{backend}-chaos", backend, steps)
    marks = tmp / f"{backend}-marks"
    marks.mkdir()
    reward = make_task(cfg.data.task, **task_options(cfg)).reward
    chaos = ChaosReward(reward, marks, every=every, reward_at=reward_at, ray=backend == "ray", last=steps - 1)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # each restart's warning; counted below
        disturbed = train(cfg, reward=chaos)
    t1 = time.perf_counter()
    kills = chaos.kills()
    last = disturbed.records[-1]
    restarts = (int(last["worker_restarts"]), int(last["reward_worker_restarts"]))
    rows = cfg.rl.batch_size * cfg.rl.n_samples
    a = final_reward(disturbed.records)
    # The disturbed run's own figures first: the undisturbed run takes as long again.
    print(f"backend {backend}: {steps} steps, rollout worker killed every {every} steps, reward worker once")
    print(f"  kills (rollout, reward)     {kills}")
    print(f"  restarts (rollout, reward)  {restarts}   equal to the kills: {restarts == kills}")
    print(f"  every row generated and trained exactly once: {exactly_once(disturbed, steps, rows)}")
    print(f"  final reward  chaos {a:.4f}   (wall time {t1 - t0:.1f} s)", flush=True)
    undisturbed = train(config(tmp / f"{backend}-quiet", backend, steps))
    t2 = time.perf_counter()
    b = final_reward(undisturbed.records)
    same = all(
        torch.equal(x, y)
        for x, y in zip(disturbed.policy.state_dict().values(), undisturbed.policy.state_dict().values())
    )
    print(
        f"  final reward  chaos {a:.4f}   undisturbed {b:.4f}   gap {abs(a - b):.4f} (bound 0.03: {abs(a - b) <= 0.03})"
    )
    print(f"  final weights equal: {same}")
    print(
        f"  wall time  chaos {t1 - t0:.1f} s   undisturbed {t2 - t1:.1f} s   ratio {(t1 - t0) / (t2 - t1):.2f}x",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["local", "ray", "both"], default="both")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--reward-at", type=int, default=55)
    args = parser.parse_args()
    backends = ["local", "ray"] if args.backend == "both" else [args.backend]
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            bench(backend, args.steps, args.every, args.reward_at, Path(tmp))
    return None


if __name__ == "__main__":
    sys.exit(main())
