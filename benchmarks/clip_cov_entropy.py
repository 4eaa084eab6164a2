"""Clip-Cov against plain GRPO on the main job: the policy's entropy over a run of configs/grpo_tiny.yaml.

Runs the main job unchanged, then with ``rl.policy_loss: clip_cov`` at the authors'
``cov_fraction`` (2e-4) and at a larger one (the main job's batches hold about a thousand
tokens, so 2e-4 cuts one token a step), all from the same seed in this one process, and
prints each run's logged ``entropy`` and ``reward``: means over the first 10%, the last
10% and the whole run.

    python benchmarks/clip_cov_entropy.py [key=value ...] [--fractions 0.0002 0.02]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rlcore.train import load_config, train

ROOT = Path(__file__).resolve().parents[1]


def _summary(records: list[dict], key: str) -> dict[str, float]:
    values = [r[key] for r in records]
    tenth = max(1, len(values) // 10)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"first10": mean(values[:tenth]), "last10": mean(values[-tenth:]), "all": mean(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", type=float, nargs="*", default=[2e-4, 0.02])
    parser.add_argument("--out", default="outputs/clip_cov_entropy")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one runs best on a shared machine)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common = [
        "trainer.progress=false",
        "trainer.plot=false",
        "trainer.save_every=0",
        f"trainer.threads={args.threads}",
        *args.overrides,
    ]
    runs = {"grpo": []}
    runs.update(
        {
            f"clip_cov r={r:g}": ["rl.policy_loss=clip_cov", f"rl.policy_loss_args={{cov_fraction: {r}}}"]
            for r in args.fractions
        }
    )
    for i, (name, extra) in enumerate(runs.items()):
        cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", [*common, f"trainer.output_dir={args.out}/{i}", *extra])
        records = train(cfg, overwrite=True).records
        line = {"run": name, "entropy": _summary(records, "entropy"), "reward": _summary(records, "reward")}
        if "cov_frac" in records[-1]:
            line["cov_frac"] = _summary(records, "cov_frac")["all"]
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
