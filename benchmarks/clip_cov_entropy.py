"""Clip-Cov against plain GRPO on the main job: the policy's entropy over a run of configs/grpo_tiny.yaml.

Runs the main job unchanged, then with ``rl.policy_loss: clip_cov`` at each
``--fractions`` ``cov_fraction`` (the authors' band ``[1, 5]``; the main job's batches hold
about a thousand tokens, so the authors' 2e-4 cuts one token a step) and with each
``--args`` mapping of ``rl.policy_loss_args`` (by default the README's two settings, the
band widened to ``[1, 1000]``), all from the same seed in this one process, and prints each run's logged ``entropy`` and
``reward``: means over the first 10%, the last 10%, the whole run and each tenth of it.
The curves (a moving mean over 20 steps) go to ``<out>/entropy.png``. With
``trainer.eval_every=100`` each run also prints its greedy accuracy on the task's
validation set every 100 steps (the sampled reward at T 2.5 falls with the entropy kept).

    python benchmarks/clip_cov_entropy.py [key=value ...] [--fractions 0.0002 0.02] [--args MAPPING ...]
    python benchmarks/clip_cov_entropy.py trainer.eval_every=100     # the README's figures
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rlcore.train import load_config, train

ROOT = Path(__file__).resolve().parents[1]
# The covariance band widened above the authors' 5: the sampled wrong tokens of large negative advantage, whose
# push-down sharpens the policy most, become eligible for the cut (README: Recipe options).
WIDE_BAND = ("{cov_fraction: 0.1, cov_high: 1000.0}", "{cov_fraction: 0.02, cov_high: 1000.0}")


def _summary(records: list[dict], key: str) -> dict:
    values = [r[key] for r in records]
    tenth = max(1, len(values) // 10)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    tenths = [round(mean(values[i : i + tenth]), 3) for i in range(0, len(values) - tenth + 1, tenth)]
    return {"first10": mean(values[:tenth]), "last10": mean(values[-tenth:]), "all": mean(values), "tenths": tenths}


def _plot(curves: dict[str, list[dict]], path: Path, window: int = 20) -> None:
    """Entropy and reward of each run against the step, a moving mean over ``window`` steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in curves.items():
        for ax, key in zip(axes, ("entropy", "reward")):
            values = torch.tensor([r[key] for r in records], dtype=torch.float64)
            smooth = values.unfold(0, window, 1).mean(-1) if len(values) >= window else values
            ax.plot(range(len(values) - len(smooth) + 1, len(values) + 1), smooth.numpy(), label=name)
            ax.set_xlabel("step")
            ax.set_ylabel({"entropy": "entropy (nats per token)", "reward": "sampled reward"}[key])
    axes[0].legend(fontsize=7)
    fig.suptitle("configs/grpo_tiny.yaml: plain GRPO against rl.policy_loss clip_cov")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", type=float, nargs="*", default=[])
    parser.add_argument("--args", action="append", default=None, help="a clip_cov rl.policy_loss_args mapping")
    parser.add_argument("--no-grpo", action="store_true", help="leave out the plain GRPO run")
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
    runs: dict[str, list[str]] = {} if args.no_grpo else {"grpo": []}
    runs.update(
        {
            f"clip_cov r={r:g}": ["rl.policy_loss=clip_cov", f"rl.policy_loss_args={{cov_fraction: {r}}}"]
            for r in args.fractions
        }
    )
    mappings = args.args if args.args is not None else list(WIDE_BAND)
    runs.update({f"clip_cov {a}": ["rl.policy_loss=clip_cov", f"rl.policy_loss_args={a}"] for a in mappings})
    curves = {}
    for i, (name, extra) in enumerate(runs.items()):
        cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", [*common, f"trainer.output_dir={args.out}/{i}", *extra])
        records = curves[name] = train(cfg, overwrite=True).records
        line = {"run": name, "entropy": _summary(records, "entropy"), "reward": _summary(records, "reward")}
        greedy = [r["val/pass@1"] for r in records if "val/pass@1" in r]
        if greedy:  # with trainer.eval_every: greedy accuracy on the task's validation set
            line["greedy"] = [round(g, 3) for g in greedy]
        if "cov_frac" in records[-1]:
            line["cov_frac"] = _summary(records, "cov_frac")["all"]
        print(json.dumps(line), flush=True)
    _plot(curves, Path(args.out) / "entropy.png")


if __name__ == "__main__":
    main()
