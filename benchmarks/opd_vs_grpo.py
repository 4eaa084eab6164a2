"""On-policy distillation (configs/opd_tiny.yaml) against GRPO from the same initialisation.

Trains the teacher (configs/opd_teacher_tiny.yaml) unless its directory exists, then runs
the student twice from the same warmed-up initialisation (same seed, same warm-up): with
``rl.algo: opd`` (the teacher's reverse KL) and with ``rl.algo: grpo`` (the task reward, at
the main job's sampling temperature and learning rate). Each is one uninterrupted run that validates every ``--every`` steps
(``trainer.eval_every`` on the task's fixed validation set, ``data.val_size`` prompts):
``val/pass@1`` is the student's greedy accuracy. It prints both curves and the first step
at which each reaches ``--fraction`` of the teacher's greedy accuracy on the same prompts.
Everything runs in this one process, on the CPU; nothing is downloaded.

    python benchmarks/opd_vs_grpo.py [--steps 1000] [--every 50] [key=value ...]

Extra ``key=value`` overrides apply to both students (e.g. ``trainer.warmup_steps=60``), ``--opd key=value``
to the distilled one only (e.g. its sampling temperature), ``--grpo key=value`` to GRPO's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from rlcore.models import load_causal_lm
from rlcore.train import Validator, load_config, task_options, train
from rlcore.train.prompts import TaskPrompts

ROOT = Path(__file__).resolve().parents[1]


def greedy_accuracy(model: torch.nn.Module, cfg) -> float:
    """``val/pass@1`` of ``model`` on the validation set of ``cfg`` (its task, ``data.val_size``, seed)."""
    source = TaskPrompts(cfg, task_options(cfg))
    return Validator(cfg, source.val, source.tokenizer, source.reward)(model, 0)["val/pass@1"]


def curve(path: Path, overrides: list[str], steps: int, every: int) -> list[dict]:
    """Greedy accuracy, mean sampled reward and KL of one student every ``every`` steps, from one run."""
    cfg = load_config(path, [*overrides, f"trainer.steps={steps}", f"trainer.eval_every={every}"])
    t0 = time.perf_counter()
    records = train(cfg, overwrite=True).records
    seconds = time.perf_counter() - t0
    points = []
    for end in range(every, steps + 1, every):
        window = records[end - every : end]
        point = {
            "step": end,
            "greedy": window[-1]["val/pass@1"],
            "reward": sum(r["reward"] for r in window) / len(window),
            "kl": sum(r["kl"] for r in window) / len(window) if all("kl" in r for r in window) else None,
        }
        print(json.dumps(point), flush=True)
        points.append(point)
    print(json.dumps({"seconds": seconds}), flush=True)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--val-size", type=int, default=512)
    parser.add_argument("--fraction", type=float, default=0.9)
    parser.add_argument("--out", default="outputs/opd_vs_grpo")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one runs best on a shared machine)")
    parser.add_argument("--opd", action="append", default=[], metavar="KEY=VALUE", help="an override of the opd run")
    parser.add_argument("--grpo", action="append", default=[], metavar="KEY=VALUE", help="an override of GRPO's run")
    parser.add_argument("--runs", nargs="+", default=["opd", "grpo"], choices=["opd", "grpo"])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet = ["trainer.progress=false", "trainer.plot=false", f"trainer.threads={args.threads}"]
    teacher_cfg = load_config(
        ROOT / "configs" / "opd_teacher_tiny.yaml", [*quiet, f"trainer.output_dir={args.out}/teacher"]
    )
    teacher_dir = os.path.join(teacher_cfg.trainer.output_dir, "hf")
    if not os.path.isdir(teacher_dir):
        train(teacher_cfg, overwrite=True)
    common = [
        *quiet,
        "trainer.reward_workers=0",
        "trainer.save_every=0",
        f"data.val_size={args.val_size}",
        f"model.teacher={teacher_dir}",
    ]
    student = ROOT / "configs" / "opd_tiny.yaml"
    main_job = load_config(ROOT / "configs" / "grpo_tiny.yaml")
    target = greedy_accuracy(
        load_causal_lm(teacher_dir, dtype="fp32"), load_config(student, [*common, "trainer.eval_every=1"])
    )
    print(json.dumps({"teacher_greedy": target}), flush=True)
    runs = {
        "opd": [*common, f"trainer.output_dir={args.out}/opd", *args.overrides, *args.opd],
        "grpo": [
            *common,
            f"trainer.output_dir={args.out}/grpo",
            "rl.algo=grpo",
            "rl.beta=0.0",
            "model.teacher=null",
            "rl.opd_loss=reward",
            "rl.opd_beta=0.0",
            "rl.opd_top_k=null",
            "rl.task_coef=1.0",
            "rl.teacher_coef=1.0",
            f"rl.temperature={main_job.rl.temperature}",  # the main job's sampling temperature (opd_tiny's is 1)
            *args.overrides,
            *args.grpo,
        ],
    }
    summary: dict = {"teacher_greedy": target}
    for name, overrides in runs.items():
        if name not in args.runs:
            continue
        points = curve(student, overrides, args.steps, args.every)
        reached = next((p["step"] for p in points if p["greedy"] >= args.fraction * target), None)
        summary[name] = {"points": points, f"steps_to_{args.fraction:g}_of_teacher": reached}
        print(json.dumps({name: reached}), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
