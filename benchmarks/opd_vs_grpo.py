"""On-policy distillation (configs/opd_tiny.yaml) against GRPO from the same initialisation.

Trains the teacher (configs/opd_teacher_tiny.yaml) unless its directory exists, then runs
the student twice from the same warmed-up initialisation (same seed, same warm-up): with
``rl.algo: opd`` (the teacher's reverse KL) and with ``rl.algo: grpo`` (the task reward, as
the main job). Every ``--every`` steps it measures the student's greedy accuracy on a fixed
set of held-out prompts, and prints both curves and the first step at which each reaches
``--fraction`` of the teacher's greedy accuracy. Everything runs in this one process
(runs resume from their checkpoints between measurements: a resumed run equals an
uninterrupted one bit for bit, whatever the measurement interval, tests/test_chunked_resume.py),
on the CPU; nothing is downloaded. The thread count and the machine's instruction set change
the rounding, and GRPO on this tiny model amplifies it: compare curves measured with the same
``--threads`` on the same machine.

    python benchmarks/opd_vs_grpo.py [--steps 1000] [--every 50] [key=value ...]

Extra ``key=value`` overrides apply to both students (e.g. ``trainer.warmup_steps=60``), ``--opd key=value``
to the distilled one only (e.g. its sampling temperature).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from rlcore.models import load_causal_lm
from rlcore.models.sampling import left_pad
from rlcore.train import load_config, train
from rlcore.train.rollout import generate
from rlcore.train.tasks import make_task

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, cfg, *, n: int = 512, seed: int = 12345) -> float:
    """Exact-match accuracy of greedy answers on ``n`` reversal prompts drawn from their own stream."""
    d = cfg.data
    task = make_task(d.task, length=d.length, min_length=d.min_length, letters=d.letters)
    tok = task.tokenizer
    samples = task.sample(n, torch.Generator().manual_seed(seed))
    prompts, pmask = left_pad([tok.encode(s["prompt"]) for s in samples], tok.pad_token_id)
    was = model.training
    model.eval()
    out = generate(
        model,
        prompts,
        pmask,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=cfg.rl.max_new_tokens,
        temperature=0.0,
    )
    model.train(was)
    texts = [tok.decode(r) for r in out.responses.tolist()]
    return sum(t == s["answer"] for t, s in zip(texts, samples)) / n


def curve(path: Path, overrides: list[str], steps: int, every: int) -> list[dict]:
    """Greedy accuracy, mean sampled reward and KL of one student every ``every`` steps (step 0: after the warm-up)."""
    points = []
    for k, end in enumerate(range(0, steps + 1, every)):
        cfg = load_config(path, [*overrides, f"trainer.steps={end}", f"trainer.save_every={every}"])
        t0 = time.perf_counter()
        # Step 0 is the warm-up alone; the first chunk starts again from it (a deterministic warm-up).
        run = train(cfg, resume=k > 1, overwrite=k <= 1)
        recent = run.records[-every:] if run.records else []
        point = {
            "step": end,
            "greedy": greedy_accuracy(run.policy, cfg),
            "reward": sum(r["reward"] for r in recent) / len(recent) if recent else None,
            "kl": sum(r["kl"] for r in recent if "kl" in r) / len(recent) if recent and "kl" in recent[-1] else None,
            "seconds": time.perf_counter() - t0,
        }
        print(json.dumps(point), flush=True)
        points.append(point)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--fraction", type=float, default=0.9)
    parser.add_argument("--out", default="outputs/opd_vs_grpo")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one runs best on a shared machine)")
    parser.add_argument(
        "--opd", action="append", default=[], metavar="KEY=VALUE", help="an override of the opd run only"
    )
    parser.add_argument("--runs", nargs="+", default=["opd", "grpo"], choices=["opd", "grpo"])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    threads = f"trainer.threads={args.threads}"
    teacher_cfg = load_config(ROOT / "configs" / "opd_teacher_tiny.yaml", ["trainer.progress=false", threads])
    teacher_dir = os.path.join(teacher_cfg.trainer.output_dir, "hf")
    if not os.path.isdir(teacher_dir):
        train(teacher_cfg, overwrite=True)
    teacher = load_causal_lm(teacher_dir, dtype="fp32")
    target = greedy_accuracy(teacher, teacher_cfg)
    print(json.dumps({"teacher_greedy": target}), flush=True)
    common = [
        threads,  # else the students run at the config's trainer.threads, whatever --threads says
        "trainer.progress=false",
        "trainer.plot=false",
        "trainer.reward_workers=0",
        f"model.teacher={teacher_dir}",
    ]
    student = ROOT / "configs" / "opd_tiny.yaml"
    runs = {
        "opd": [*common, f"trainer.output_dir={args.out}/opd", *args.overrides, *args.opd],
        "grpo": [
            *common,
            f"trainer.output_dir={args.out}/grpo",
            "rl.algo=grpo",
            "rl.beta=0.0",
            "model.teacher=null",
            "rl.opd_loss=reward",
            "rl.task_coef=1.0",
            "rl.teacher_coef=1.0",
            *args.overrides,
        ],
    }
    summary = {"teacher_greedy": target}
    for name, overrides in runs.items():
        if name not in args.runs:
            continue
        points = curve(student, overrides, args.steps, args.every)
        reached = next((p["step"] for p in points if p["greedy"] >= args.fraction * target), None)
        summary[name] = {"points": points, f"steps_to_{args.fraction:g}_of_teacher": reached}
        print(json.dumps({name: summary[name][f"steps_to_{args.fraction:g}_of_teacher"]}), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
