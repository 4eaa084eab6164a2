"""Whether a distilled student stuck on certain wrong tokens gets out, by GKD's beta: reverse KL, JSD, forward KL.

``benchmarks/opd_vs_grpo.py`` trains a student with ``opd_tiny``'s sampled-token reverse KL.
Where that student becomes sure of wrong tokens it stops moving: the reverse KL's gradient
``pi(v) (log pi(v) - log pi_T(v) - KL)`` is near 0 for every ``v`` there. This script takes
such a student and its teacher and continues each from the same weights with on-policy
distillation over the full vocabulary, :func:`rlcore.algos.generalized_jsd_loss` at each
``--betas`` value (1: the reverse KL, 0: the forward KL, whose gradient ``pi - pi_T`` does
not fade): the student samples (temperature 1, the task's prompts, 32 x 8 per step), both
models score every response position, AdamW steps on the token mean. It prints the
student's greedy accuracy (``val/pass@1`` on the task's validation set) every ``--every``
steps and the first step at which each reaches ``--fraction`` of the teacher's.

    python benchmarks/opd_vs_grpo.py --steps 800 --out outputs/opd_vs_grpo --runs opd
    python benchmarks/opd_escape.py --student outputs/opd_vs_grpo/opd/hf --teacher outputs/opd_vs_grpo/teacher/hf

A loop of its own, outside the trainer: ``rl.opd_loss`` has no full-vocabulary loss yet.
Everything runs in this process, on the CPU; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from rlcore.algos import generalized_jsd_loss
from rlcore.models import load_causal_lm
from rlcore.train import load_config, task_options
from rlcore.train.prompts import TaskPrompts
from rlcore.train.rollout import generate

sys.path.insert(0, os.path.dirname(__file__))
from opd_vs_grpo import greedy_accuracy

ROOT = Path(__file__).resolve().parents[1]


def escape(args: argparse.Namespace, beta: float, cfg, source: TaskPrompts, teacher: torch.nn.Module) -> list[dict]:
    """Greedy accuracy every ``args.every`` steps of full-vocabulary on-policy distillation at ``beta``."""
    tok = source.tokenizer
    student = load_causal_lm(args.student, dtype="fp32")
    optimiser = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    points = [{"step": 0, "greedy": greedy_accuracy(student.eval(), cfg)}]
    for step in range(1, args.steps + 1):
        rows = source.draw(args.data_step + step, 0, 32, 8)
        prompts, prompt_mask = rows["prompts"], rows["prompt_mask"]
        student.eval()
        rollout = generate(
            student,
            prompts,
            prompt_mask,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            max_new_tokens=cfg.rl.max_new_tokens,
            temperature=1.0,
            generator=torch.Generator().manual_seed(step),
        )
        ids = torch.cat([prompts, rollout.responses], 1)
        attention = torch.cat([prompt_mask, rollout.mask], 1)
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        scored = slice(prompts.shape[1] - 1, -1)  # the positions that predict the response tokens
        with torch.no_grad():
            teacher_logits = teacher(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, scored]
        student.train()
        logits = student(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, scored]
        loss_t, _ = generalized_jsd_loss(logits, teacher_logits, rollout.mask, beta=beta)
        loss = (loss_t * rollout.mask).sum() / rollout.mask.sum()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % args.every == 0:
            points.append({"step": step, "loss": float(loss.detach()), "greedy": greedy_accuracy(student.eval(), cfg)})
            print(json.dumps({"beta": beta, **points[-1]}), flush=True)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", required=True, help="the stuck student's causal LM directory")
    parser.add_argument("--teacher", required=True, help="its teacher's causal LM directory")
    parser.add_argument("--betas", default="1,0.5,0", help="GKD's beta values to try, comma-separated")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--val-size", type=int, default=512)
    parser.add_argument("--fraction", type=float, default=0.9)
    parser.add_argument("--data-step", type=int, default=10_000, help="prompts come from steps after this one")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(
        ROOT / "configs" / "opd_tiny.yaml",
        [f"model.teacher={args.teacher}", f"data.val_size={args.val_size}", "trainer.eval_every=1"],
    )
    source = TaskPrompts(cfg, task_options(cfg))
    teacher = load_causal_lm(args.teacher, dtype="fp32").eval()
    target = greedy_accuracy(teacher, cfg)
    print(json.dumps({"teacher_greedy": target}), flush=True)
    for beta in (float(b) for b in args.betas.split(",")):
        points = escape(args, beta, cfg, source, teacher)
        reached = next((p["step"] for p in points if p["greedy"] >= args.fraction * target), None)
        best = max(p["greedy"] for p in points)
        print(
            json.dumps(
                {
                    "beta": beta,
                    "start": points[0]["greedy"],
                    "end": points[-1]["greedy"],
                    "best": best,
                    f"steps_to_{args.fraction:g}_of_teacher": reached,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
