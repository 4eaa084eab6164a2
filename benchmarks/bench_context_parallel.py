"""Context parallelism: per-rank peak activation memory at cp = 4 against cp = 1, and time per token.

Run: python benchmarks/bench_context_parallel.py [--tokens 32768 --cp 4 --modes ring ulysses]

The tiny Qwen2 model of ``configs/grpo_tiny.yaml`` (random weights, its full
151,936-entry vocabulary) scores one packed row of ``--tokens`` tokens (four
sequences of uneven lengths): log-probs and entropies forward and backward, the
path a training step takes. ``cp = 1`` is :func:`rlcore.models.token_logprobs` in
one process; ``cp = 4`` is :func:`rlcore.models.sharded_token_logprobs` on a gloo
group of 4 CPU processes (ring attention and Ulysses).

Each measurement runs in fresh processes; the model and inputs are built first and
the figure is the peak resident set size (``ru_maxrss``) above the resident size
right after that, the accounting of ``bench_logprobs.py`` (on an accelerator,
``torch.accelerator``'s peak allocated bytes), less the parameter-gradient buffers
every rank holds whatever the split: the "step peak". The activation memory is
counted exactly: the bytes of the distinct non-parameter tensors autograd saves
for the backward (``saved_tensors_hooks``), all alive at the end of the forward,
which is their peak. The log-prob path (:func:`rlcore.ops.linear_logprobs` with entropy, forward
and backward, on one rank's hidden-state shard) is measured the same way, less its
weight-gradient buffer, against the size of that rank's logits shard
``[2L, V]`` in float32, which it never builds.

Targets (issue 16): activations per rank at cp = 4 <= 0.3x cp = 1; log-prob
path extra peak <= 1.5x the per-rank logits shard.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _config(tokens: int) -> dict:
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_tiny.yaml").read_text())["model"]["model_name_or_path"]
    return {**cfg, "max_position_embeddings": max(tokens, cfg.get("max_position_embeddings", 0))}


def _lengths(tokens: int) -> list[int]:
    parts = [tokens // 8, tokens // 2, tokens // 16]
    return [*parts, tokens - sum(parts)]


def _worker(rank: int, cp: int, tokens: int, what: str, mode: str, out_dir: str) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads() // cp))
    if cp > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out_dir}/store",
            rank=rank,
            world_size=cp,
            timeout=datetime.timedelta(minutes=30),
        )
    from rlcore.models import from_hf, load_causal_lm, plan_sequence_shards, sharded_token_logprobs, token_logprobs
    from rlcore.ops import linear_logprobs

    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    model = load_causal_lm(_config(tokens), seed=0).to(device)
    apply, params = from_hf(model)
    g = torch.Generator().manual_seed(0)
    vocab = apply.output_weight(params).shape[0]
    seqs = [torch.randint(0, vocab, (n,), generator=g).to(device) for n in _lengths(tokens)]
    local = plan_sequence_shards([0, tokens], world=cp, rank=rank).local_len if cp > 1 else tokens
    grad_bytes = sum(p.numel() * p.element_size() for p in params.values())
    if what == "logprobs":
        hidden_size = apply.output_weight(params).shape[1]
        hidden = torch.randn(local, hidden_size, generator=g).to(device).requires_grad_()
        weight = apply.output_weight(params).detach().clone().requires_grad_()
        labels = torch.randint(0, vocab, (local,), generator=g).to(device)
        grad_bytes = weight.numel() * weight.element_size()

    param_storages = {p.untyped_storage().data_ptr() for p in params.values()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def step() -> None:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = forward()
        loss.backward()

    def forward() -> torch.Tensor:
        if what == "logprobs":
            lp, ent = linear_logprobs(hidden, weight, labels, with_entropy=True)
            return lp.sum() + ent.sum()
        if cp == 1:
            lp, ent = token_logprobs(apply, params, seqs, with_entropy=True)
            return lp.sum() + ent.sum()
        out = sharded_token_logprobs(apply, params, seqs, group=dist.group.WORLD, mode=mode, with_entropy=True)
        assert out.entropy is not None
        return out.logp.sum() + out.entropy.sum()

    if cp > 1:
        dist.barrier()
    if device.type != "cpu":
        torch.accelerator.synchronize()
        torch.accelerator.reset_peak_memory_stats()
        base = torch.accelerator.memory_allocated()
    else:
        base = _rss_bytes()
    start = time.perf_counter()
    step()
    if cp > 1:
        dist.barrier()
    elapsed = time.perf_counter() - start
    if device.type != "cpu":
        peak = torch.accelerator.max_memory_allocated() - base
    else:
        peak = _peak_bytes() - base
    result = {
        "extra_peak": peak,
        "saved": sum(saved.values()),
        "grad_bytes": grad_bytes,
        "time": elapsed,
        "local_tokens": local,
        "vocab": vocab,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if cp > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(cp: int, tokens: int, what: str, mode: str) -> list[dict]:
    # Fixed mmap threshold: freed blocks go back to the system, so the resident size follows live memory.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(cp, tokens, what, mode, tmp), nprocs=cp, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(cp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["ring", "ulysses"], choices=["ring", "ulysses"])
    args = parser.parse_args()
    mib = 1 << 20
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny Qwen2 of configs/grpo_tiny.yaml; "
        f"{args.tokens} packed tokens {_lengths(args.tokens)}; log-probs + entropy, forward + backward, float32",
        flush=True,
    )

    def act(r: dict) -> float:
        return r["saved"] / mib

    def step_peak(r: dict) -> float:
        return (r["extra_peak"] - r["grad_bytes"]) / mib

    base = run(1, args.tokens, "model", "ring")[0]
    print(
        f"  cp=1            activations {act(base):9.1f} MiB  (step peak beyond gradients {step_peak(base):9.1f} MiB)"
        f"   time/token {base['time'] / args.tokens * 1e6:8.2f} us",
        flush=True,
    )
    model_cfg = _config(args.tokens)
    for mode in args.modes:
        heads = (
            model_cfg["num_attention_heads"],
            model_cfg.get("num_key_value_heads", model_cfg["num_attention_heads"]),
        )
        if mode == "ulysses" and any(h % args.cp for h in heads):
            print(
                f"  cp={args.cp} ulysses    not run: {heads[0]} query / {heads[1]} key-value heads do not divide by cp"
            )
            continue
        res = run(args.cp, args.tokens, "model", mode)
        worst = max(res, key=act)
        wall = max(r["time"] for r in res)
        ratio = act(worst) / act(base)
        peak_ratio = step_peak(worst) / step_peak(base)
        print(
            f"  cp={args.cp} {mode:<8}   activations {act(worst):9.1f} MiB  (step peak beyond gradients "
            f"{step_peak(worst):9.1f} MiB, worst rank)   time/token {wall / args.tokens * 1e6:8.2f} us",
            flush=True,
        )
        print(
            f"    activation peak per rank cp={args.cp} / cp=1: {ratio:.3f}x "
            f"(target <= 0.3x: {'met' if ratio <= 0.3 else 'NOT met'}); "
            f"step peak {peak_ratio:.3f}x; time per token {wall / base['time']:.2f}x cp=1",
            flush=True,
        )
    lp = run(args.cp, args.tokens, "logprobs", "ring")
    worst = max(lp, key=act)
    shard_bytes = worst["local_tokens"] * worst["vocab"] * 4
    lp_ratio = (worst["extra_peak"] - worst["grad_bytes"]) / shard_bytes
    print(
        f"  log-prob path on a {worst['local_tokens']}-token shard: extra peak beyond the weight gradient "
        f"{step_peak(worst):.1f} MiB = {lp_ratio:.3f}x the per-rank logits shard ({shard_bytes / mib:.0f} MiB) "
        f"(target <= 1.5x: {'met' if lp_ratio <= 1.5 else 'NOT met'})",
        flush=True,
    )


if __name__ == "__main__":
    main()
