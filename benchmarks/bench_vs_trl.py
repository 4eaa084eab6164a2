"""End-to-end GRPO step: rlcore's trainer against TRL's ``GRPOTrainer`` on the same model, task, batch and sampling.

Run: pip install -e ".[bench]"    (TRL, for this benchmark only)
     python benchmarks/bench_vs_trl.py [--steps 30] [--repeats 2] [--sizes small,main,large]

Both sides train a randomly initialised Qwen2-architecture model from the same inline
config on the reversal task (``"abcd>" -> "dcba"``, the main job's task), exact-match
reward, GRPO with groups of ``num_rollouts`` samples, one optimiser update per batch,
``beta = 0``, AdamW, no warm-up, on the CPU, at 1 and 2 torch threads (``--threads``):

* rlcore: :func:`rlcore.train.train` on ``configs/grpo_tiny.yaml`` with the size's model,
  batch and ``max_new_tokens`` -- the main job's deployment, co-located, the blocking
  pipeline, rewards in a worker process;
* TRL: ``trl.GRPOTrainer`` (``GRPOConfig(per_device_train_batch_size = prompts x
  num_rollouts, num_generations = num_rollouts, max_completion_length, temperature,
  beta=0, use_cpu=True, bf16=False, gradient_checkpointing=False)``: float32 without
  recomputation, as rlcore runs), the same character tokenizer as a ``transformers`` one.

Each (side, size, threads, repeat) runs in a fresh process of this script, one after the
other, alternating which side goes first. A side's seconds per step is the median over
its steps after the first three (start-up and first-call costs excluded), then over the
repeats; each side is judged at its own fastest thread count. The speed-up is the median
over the repeats of TRL's seconds per step over rlcore's in that repeat's two runs, which
ran one after the other (a run apart at most, with two thread counts): a shared machine's
speed drifts by up to 2x over minutes, and a pair's two runs mostly see the same state (the ratio of the two sides' medians is printed
beside it). The script prints every figure, the speed-up, each side's mean response
length (the work sampled), and a per-stage breakdown: rlcore's busy seconds per stage
from its step records, TRL's from timers around its generation, reward, log-prob
forward, backward and optimiser step.

Sizes: ``small`` (hidden 32, 1 layer, 8 prompts x 4, 5 new tokens), ``main`` (the main
job: hidden 64, 2 layers, 32 prompts x 8, 5 new tokens), ``large`` (hidden 512, 4
layers, 8 prompts x 8, 64 new tokens). Target: at least 2x on ``main``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SKIP = 3  # first steps left out of the median (start-up, first calls)

_MAIN_MODEL = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "model": {
            **_MAIN_MODEL,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        },
        "prompts": 8,
        "samples": 4,
        "new_tokens": 5,
    },
    "main": {"model": _MAIN_MODEL, "prompts": 32, "samples": 8, "new_tokens": 5},
    "large": {
        "model": {
            **_MAIN_MODEL,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
        },
        "prompts": 8,
        "samples": 8,
        "new_tokens": 64,
    },
}
TEMPERATURE, LR = 2.5, 5e-4


# --- rlcore ------------------------------------------------------------------------------------


def run_rlcore(size: dict[str, Any], steps: int, threads: int) -> dict[str, Any]:
    import yaml

    from rlcore.train import load_config, train

    with tempfile.TemporaryDirectory() as out:
        raw = yaml.safe_load((ROOT / "configs" / "grpo_tiny.yaml").read_text())
        raw["model"]["model_name_or_path"] = dict(size["model"])
        raw["rl"].update(
            batch_size=size["prompts"],
            mini_batch_size=size["prompts"],
            num_rollouts=size["samples"],
            max_new_tokens=size["new_tokens"],
            temperature=TEMPERATURE,
            lr=LR,
            beta=0.0,
        )
        raw["trainer"].update(
            steps=steps, warmup_steps=0, save_every=0, progress=False, plot=False, threads=threads, output_dir=out
        )
        path = Path(out) / "config.yaml"
        path.write_text(yaml.safe_dump(raw))
        records = train(load_config(path)).records[SKIP:]
    stages = sorted({k for r in records for k in r if k.startswith("busy_s/")})
    return {
        "step_s": statistics.median(r["step_time_s"] for r in records),
        "response_length": statistics.mean(r["response_length"] for r in records),
        "stages": {k.removeprefix("busy_s/"): statistics.median(r.get(k, 0.0) for r in records) for k in stages},
        "bubble_device": statistics.median(r.get("bubble/device", 0.0) for r in records),
    }


# --- TRL ---------------------------------------------------------------------------------------


def run_trl(size: dict[str, Any], steps: int, threads: int) -> dict[str, Any]:
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.models.export import _char_tokenizer_as_hf
    from rlcore.train.tasks import Reversal

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    task = Reversal(length=4, min_length=2, letters="abcdef")  # configs/grpo_tiny.yaml's data section
    tok = _char_tokenizer_as_hf(task.tokenizer)
    rows = task.sample(size["prompts"] * (steps + 1), torch.Generator().manual_seed(0))
    options = {k: v for k, v in size["model"].items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(
        "qwen2", vocab_size=task.tokenizer.vocab_size, eos_token_id=1, pad_token_id=0, bos_token_id=None, **options
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="sdpa")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0

    def exact_match(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [1.0 if (c.split() or [""])[0] == a else 0.0 for c, a in zip(completions, answer)]

    spans: dict[str, float] = defaultdict(float)
    per_step: list[dict[str, float]] = []
    lengths: list[float] = []

    def timed(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans[name] += time.perf_counter() - t0

        return run

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            spans.clear()
            self.start = time.perf_counter()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.opt = time.perf_counter()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            spans["optimiser"] += time.perf_counter() - self.opt

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            per_step.append({"step_s": time.perf_counter() - self.start, **spans})

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=size["prompts"] * size["samples"],
            num_generations=size["samples"],
            max_completion_length=size["new_tokens"],
            temperature=TEMPERATURE,
            top_k=0,
            beta=0.0,
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            use_cpu=True,
            # GRPOConfig defaults to bf16 autocast and gradient checkpointing; rlcore's side is float32
            # without recomputation, so TRL is run the same way: the same arithmetic, not a slower mode.
            bf16=False,
            gradient_checkpointing=False,
            max_steps=steps,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=exact_match,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[Clock()],
        )
        trainer._generate_single_turn = timed("generation", trainer._generate_single_turn)
        trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
        trainer._get_per_token_logps_and_entropies = timed("logp forward", trainer._get_per_token_logps_and_entropies)
        trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
        trainer.train()
    kept = per_step[SKIP:]
    names = sorted({k for s in kept for k in s if k != "step_s"})
    return {
        "step_s": statistics.median(s["step_s"] for s in kept),
        "response_length": statistics.mean(lengths[SKIP:] or lengths),
        "stages": {k: statistics.median(s.get(k, 0.0) for s in kept) for k in names},
    }


# --- the driver ----------------------------------------------------------------------------------


def _side(side: str, size: str, steps: int, threads: int) -> dict[str, Any]:
    """Run one side in a fresh process of this script; its result dict."""
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", side, "--sizes", size, "--steps", str(steps), "--threads", str(threads)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{side} at size {size!r} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _each(results: list[dict[str, Any]]) -> str:
    return ", ".join(f"{x['step_s'] * 1e3:.1f}" for x in results)


def _stages(result: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v * 1e3:.1f}" for k, v in result["stages"].items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes", default="small,main,large")
    parser.add_argument("--threads", default="1,2", help="torch threads to try per side; each side's fastest counts")
    parser.add_argument("--worker", choices=["rlcore", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        parser.error(f"--sizes: got {bad}, expected some of {list(SIZES)}")
    counts = [int(t) for t in args.threads.split(",")]
    if args.worker:
        fn = run_rlcore if args.worker == "rlcore" else run_trl
        print("RESULT " + json.dumps(fn(SIZES[sizes[0]], args.steps, counts[0])), flush=True)
        return
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; torch threads tried per side: {counts}")
    ratios = {}
    for size in sizes:
        spec = SIZES[size]
        steps = args.steps if size != "large" else max(SKIP + 3, args.steps // 4)
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {(s, t): [] for s in ("rlcore", "trl") for t in counts}
        for r in range(args.repeats):
            for threads in counts:
                for side in ("rlcore", "trl") if r % 2 == 0 else ("trl", "rlcore"):
                    runs[side, threads].append(_side(side, size, steps, threads))
        medians = {key: statistics.median(x["step_s"] for x in found) for key, found in runs.items()}
        best = {side: min(counts, key=lambda t: medians[side, t]) for side in ("rlcore", "trl")}
        ours, theirs = medians["rlcore", best["rlcore"]], medians["trl", best["trl"]]
        # A repeat's two runs at the sides' best counts ran one after the other (a run apart at most): one machine state.
        paired = [t["step_s"] / o["step_s"] for o, t in zip(runs["rlcore", best["rlcore"]], runs["trl", best["trl"]])]
        ratios[size] = statistics.median(paired)
        m = spec["model"]
        print(
            f"\n[{size}] hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {spec['prompts']} prompts x "
            f"{spec['samples']}, {spec['new_tokens']} new tokens, {steps} steps x {args.repeats} repeats"
        )
        for side, label in (("rlcore", "rlcore"), ("trl", "TRL")):
            for threads in counts:
                last = runs[side, threads][-1]
                mark = "*" if threads == best[side] else " "
                print(
                    f"  {label:<6} {threads} thr{mark} {medians[side, threads] * 1e3:8.1f} ms/step   "
                    f"response length {last['response_length']:.2f}   stages (ms, last run): {_stages(last)}\n"
                    f"           each repeat (ms/step): {_each(runs[side, threads])}"
                )
        bubble = statistics.median(x["bubble_device"] for x in runs["rlcore", best["rlcore"]])
        print(f"  rlcore device idle {bubble:.1%} of the step (bubble/device, {best['rlcore']} threads)")
        goal = f"  (target >= 2x: {'met' if ratios[size] >= 2 else 'NOT met'})" if size == "main" else ""
        print(
            f"  speed-up rlcore vs TRL, each at its fastest thread count (*): {ratios[size]:.2f}x{goal}\n"
            f"    (median of the repeats' paired ratios {', '.join(f'{r:.2f}' for r in paired)}; "
            f"ratio of the two medians {theirs / ours:.2f}x)",
            flush=True,
        )
    order = [s for s in ("small", "main", "large") if s in ratios]
    print("\nspeed-up by size: " + ", ".join(f"{s} {ratios[s]:.2f}x" for s in order))
    below = [s for s in order if ratios[s] < 1]
    print("crossover: " + (f"TRL is faster at {', '.join(below)}" if below else "none (rlcore faster at every size)"))


if __name__ == "__main__":
    main()
