"""Agent RL on the shipped calculator task, assembled from library pieces: warm-up, then GRPO over multi-turn rollouts.

    python examples/agent_calc.py --config configs/agent_calc_tiny.yaml [--steps N] [--out DIR]

Reads the config's model, rl (with rl.multi_turn), data and trainer sections; writes
``metrics.jsonl`` (accuracy of the T-sampled trajectories, greedy accuracy on a fixed
set, tool-call rate, tool errors, turns, tool latency) and ``curves.png`` to the output
folder, and prints the first-10% / last-10% accuracy of the RL steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

# OpenMP threads that spin-wait steal the cores they wait for on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import transformers
import yaml

from rlcore import algos
from rlcore.agent import (
    Multiplication,
    StepRunner,
    build_env_factory,
    multi_turn_rollout,
    parse_multi_turn,
    stop_token_ids,
    trajectory_logprobs,
)
from rlcore.models import from_hf, token_logprobs


def build_model(spec: dict, vocab_size: int) -> torch.nn.Module:
    options = {"vocab_size": vocab_size, **spec}
    config = transformers.AutoConfig.for_model(options.pop("model_type"), **options)
    return transformers.AutoModelForCausalLM.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/agent_calc_tiny.yaml")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--eval-every", type=int, default=25)
    args = parser.parse_args()
    raw = yaml.safe_load(Path(args.config).read_text())
    rl, data, tr = raw["rl"], raw["data"], raw["trainer"]
    mt = parse_multi_turn(rl.get("multi_turn"))
    steps = args.steps if args.steps is not None else tr["steps"]
    warmup_steps = args.warmup_steps if args.warmup_steps is not None else tr["warmup_steps"]
    out_dir = Path(args.out or tr["output_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(tr.get("threads") or 1)
    seed = tr.get("seed", 0)
    torch.manual_seed(seed)

    task = Multiplication(digits=data["digits"])
    tok = task.tokenizer
    model = build_model(raw["model"]["model_name_or_path"], tok.vocab_size)
    apply, params = from_hf(model)
    make_env = build_env_factory(mt, reward=task.reward, base_dir=Path(args.config).parent)
    stops = stop_token_ids(mt, tok)
    t_start = time.perf_counter()

    # Supervised warm-up on tool-using traces (loss on the policy's tokens only).
    opt = torch.optim.AdamW(model.parameters(), lr=tr["warmup_lr"])
    model.train()
    for step in range(warmup_steps):
        batch = task.warmup_batch(task.sample(tr["warmup_batch_size"], torch.Generator().manual_seed(10_000 + step)))
        logp = token_logprobs(apply, params, batch)
        loss = algos.aggregate(-logp, batch["mask"], mode="token-mean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    warmup_s = time.perf_counter() - t_start

    algo = algos.grpo(kl_coef=rl.get("beta") or 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=rl["lr"])
    n, per_step = rl["num_rollouts"], rl["batch_size"]
    eval_samples = task.sample(128, torch.Generator().manual_seed(999_999))
    records = []
    budgets = dict(max_turns=mt.max_turns, max_new_tokens=mt.max_new_tokens, max_total_tokens=mt.max_total_tokens)

    def rollout(samples, temperature, generator):
        model.eval()
        try:
            return multi_turn_rollout(
                model,
                [tok.encode(s["prompt"]) for s in samples],
                [make_env() for _ in samples],
                samples,
                tokenizer=tok,
                stop_token_ids=stops,
                temperature=temperature,
                generator=generator,
                runner=runner,
                **budgets,
            )
        finally:
            model.train()

    with (
        StepRunner(max_concurrency=mt.max_concurrency, timeout=mt.step_timeout) as runner,
        open(out_dir / "metrics.jsonl", "w") as log,
    ):
        for step in range(steps):
            t0 = time.perf_counter()
            g = torch.Generator().manual_seed(seed * 1_000_003 + step)
            samples = [s for s in task.sample(per_step, g) for _ in range(n)]
            traj = rollout(samples, rl["temperature"], g)
            t_roll = time.perf_counter() - t0
            logp = trajectory_logprobs(apply, params, traj, temperature=rl["temperature"])
            batch = {
                "scores": traj["scores"],
                "group_ids": torch.arange(per_step).repeat_interleave(n),
                "mask": traj["mask"].float(),
                "logp": logp,
                "old_logp": logp.detach(),  # one on-policy update per rollout: the ratio starts at 1
                "ref_logp": logp.detach(),
            }
            batch = algo.advantages(batch)
            loss, _ = algo.loss(batch, **algos.global_counts(batch["mask"]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), rl.get("grad_clip", 1.0))
            opt.step()
            record = {
                "step": step,
                "accuracy": traj["final_reward"].mean().item(),
                "tool_call_rate": (traj["num_tool_calls"] > 0).float().mean().item(),
                "tool_errors": traj["num_tool_errors"].float().mean().item(),
                "turns": traj["num_turns"].float().mean().item(),
                "tool_latency_ms": 1e3
                * traj["tool_latency"].sum().item()
                / max(1, traj["num_tool_calls"].sum().item()),
                "response_length": traj["responses_mask"].sum(-1).float().mean().item(),
                "rollout_s": t_roll,
                "step_s": time.perf_counter() - t0,
            }
            if step % args.eval_every == 0 or step == steps - 1:
                with torch.no_grad():
                    greedy = rollout(eval_samples, 0.0, None)
                record["greedy_accuracy"] = greedy["final_reward"].mean().item()
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            if step % 10 == 0:
                print(json.dumps({k: round(v, 3) for k, v in record.items()}), flush=True)

    total_s = time.perf_counter() - t_start
    k = max(1, math.ceil(0.1 * steps))
    first = sum(r["accuracy"] for r in records[:k]) / k
    last = sum(r["accuracy"] for r in records[-k:]) / k
    greedy = [r["greedy_accuracy"] for r in records if "greedy_accuracy" in r]
    summary = {
        "warmup_s": round(warmup_s, 1),
        "total_s": round(total_s, 1),
        "accuracy_first_10pct": round(first, 3),
        "accuracy_last_10pct": round(last, 3),
        "greedy_accuracy_first": greedy[0],
        "greedy_accuracy_last": greedy[-1],
        "tool_call_rate_last_10pct": round(sum(r["tool_call_rate"] for r in records[-k:]) / k, 3),
    }
    print(json.dumps(summary))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(records, out_dir / "curves.png")


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [r["accuracy"] for r in records], lw=1.2, label="accuracy (T-sampled)")
    ax.plot(steps, [r["tool_call_rate"] for r in records], lw=1.2, label="tool-call rate")
    evals = [r for r in records if "greedy_accuracy" in r]
    ax.plot([r["step"] for r in evals], [r["greedy_accuracy"] for r in evals], "o-", ms=3, label="greedy accuracy")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right")
    ax.set_title("agent_calc_tiny: multiplication with a calculator tool")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
