"""Rollout throughput: VLLMEngine (vLLM, in-process) against TorchEngine (rlcore's KV-cached decode loop).

Run: python benchmarks/bench_rollout.py [--sizes 32x32,128x64,256x128,512x128] [--dtype float32] [--repeats 3]
[--device cuda] [--layers 4] [--hidden 512] [--head-dim 64] [--vocab 2048] [--vllm KEY=VALUE ...] (one size alone: ``--sizes 256x128``;
``--vllm enforce_eager=false``: any ``deploy.vllm`` key, read as the trainer reads it)

Both engines sample the same random Qwen2 (by default 4 layers, hidden 512, 8 heads of 64,
MLP 1536, vocabulary 2048, float32 by default; built on ``--device``) from the same left-padded prompts (8 to 24
tokens), temperature 1, keyed by the same row streams, each size ``ROWSxNEW``: ROWS
sequences (prompts x 8 samples) of up to NEW new tokens. vLLM holds the weights the
trainer would publish: they reach it through ``rlcore.dataflow.WeightSync``. Tokens
per second count the response tokens each engine produced (a row may stop at
``<eos>``); the time is the median of ``--repeats`` calls after one warm-up call each,
the two engines' calls alternated so that a load on the machine falls on both.
Printed per size: both medians, both rates, and the ratio vLLM / torch (target: at
least 2x at 256 x 128 and above), then the sizes between which the ratio crosses 1.
The engine's build (with ``enforce_eager=false``: vLLM's compile) and its first call
are timed apart. Threads: torch's setting (``--threads``, default all cores), the same
for both (the in-process engine computes on torch's threads, so vLLM's thread binding,
``VLLM_CPU_OMP_THREADS_BIND``, does not apply). ``--stepped`` also times vLLM's interruptible path
(``generate(refresh=)``, the engine stepped one token at a time and asked for new weights
between steps; none arrives) and prints its time over the plain call's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import transformers
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from _timing import median_time
from rlcore.dataflow import WeightSync
from rlcore.device import get_device, synchronize
from rlcore.seeding import Purpose, RowStream
from rlcore.train import TorchEngine, VLLMEngine, left_pad, parse_vllm_options

EOS, PAD, SAMPLES = 1, 0, 8
BLOCK = 128  # KV-cache block (tokens): vLLM's CPU default, set so the cache is sized in whole blocks


def model(
    dtype: torch.dtype,
    layers: int,
    hidden: int,
    *,
    head_dim: int = 64,
    vocab: int = 2048,
    device: torch.device | None = None,
) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=hidden // head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    with torch.device(device or "cpu"):  # initialised where it runs: a large model's init on the host is slow
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def prompts(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 25, (rows // SAMPLES,), generator=g).tolist()
    return left_pad([torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths], PAD)


def _never() -> None:
    """A refresh under which no new version ever arrives: the interruptible path's own cost."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32x32,128x64,256x128,512x128", help="ROWSxNEW, comma-separated")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--stepped", action="store_true", help="also time vLLM's interruptible (partial) path")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512, help="a multiple of --head-dim")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--device", default=None, help="torch device of the weights and prompts (default: rlcore's)")
    parser.add_argument(
        "--vllm", action="append", default=[], metavar="KEY=VALUE", help="a deploy.vllm option (repeatable)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device) if args.device else get_device()
    if args.hidden % args.head_dim:
        parser.error(f"--hidden: got {args.hidden}, expected a multiple of --head-dim ({args.head_dim})")
    policy = model(dtype, args.layers, args.hidden, head_dim=args.head_dim, vocab=args.vocab, device=device)
    longest_rows = max(r for r, _ in sizes)
    # Every sequence of the largest size holds its blocks at once: vLLM never preempts a row
    # (a resumed seeded request fails on the CPU build), whole blocks per sequence.
    blocks = -(-(24 + max(n for _, n in sizes)) // BLOCK)
    kv_token_bytes = 2 * args.layers * args.hidden * torch.finfo(dtype).bits // 8
    raw = {
        "kv_cache_memory_bytes": int(1.25 * longest_rows * blocks * BLOCK * kv_token_bytes),
        "max_num_seqs": longest_rows,
        "block_size": BLOCK,
    }
    for item in args.vllm:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--vllm: got {item!r}, expected KEY=VALUE")
        raw[key] = yaml.safe_load(value) if value.strip() else None  # as the config overrides read it
    options = parse_vllm_options(raw, key="--vllm")
    start = time.perf_counter()
    vllm_engine = VLLMEngine.from_module(policy, eos_token_id=EOS, pad_token_id=PAD, options=options)
    built = time.perf_counter() - start
    params = dict(policy.named_parameters())
    largest = max(p.numel() * p.element_size() for p in params.values())  # a large vocabulary's embedding
    record = WeightSync(params, bucket_bytes=max(64 << 20, largest)).sync(1, vllm_engine.receiver())
    print(
        f"model: {args.layers} layers, hidden {args.hidden} ({args.head_dim} per head), vocab {args.vocab}, {args.dtype}, on {device}; "
        f"{args.threads} threads; "
        f"vLLM built in {built:.1f} s ({options}); "
        f"weights synced to vLLM in {record.seconds:.3f} s ({record.nbytes / 2**20:.1f} MiB); "
        f"medians of {args.repeats} alternated calls after 1 warm-up each",
        flush=True,
    )
    ratios = []
    for rows, new in sizes:
        ids, mask = (t.to(device) for t in prompts(rows, args.vocab))
        engines = {
            "vllm": vllm_engine.sampling(max_new_tokens=new),
            "torch": TorchEngine(policy, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=new),
        }
        calls = {name: {} for name in engines}
        if args.stepped:
            engines["stepped"] = engines["vllm"]
            calls["stepped"] = {"refresh": _never}
        runs, outs, first = {}, {}, {}
        for name, engine in engines.items():
            out: list = []

            def call(engine=engine, out=out, kw=calls[name]) -> None:
                stream = RowStream(0, Purpose.SAMPLING, 0)
                out[:] = [engine.generate(ids, mask, n=SAMPLES, generator=stream, **kw)]
                synchronize(device)  # the torch engine's kernels may still be queued

            runs[name], outs[name] = call, out
            first[name] = median_time(call, repeats=1, warmup=0)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, call in runs.items():
                times[name].append(median_time(call, repeats=1, warmup=0))
        seconds = {name: statistics.median(t) for name, t in times.items()}
        tokens = {name: int(out[0].mask.sum()) for name, out in outs.items()}
        rate = {k: tokens[k] / seconds[k] for k in engines}
        stepped = f"   stepped / plain vllm time {seconds['stepped'] / seconds['vllm']:5.2f}x" if args.stepped else ""
        print(
            f"{rows:4d} seqs x {new:3d} new tokens   vllm {seconds['vllm']:8.3f} s {rate['vllm']:9.1f} tok/s   "
            f"torch {seconds['torch']:8.3f} s {rate['torch']:9.1f} tok/s   ratio {rate['vllm'] / rate['torch']:5.2f}x"
            f"   (first calls: vllm {first['vllm']:.2f} s, torch {first['torch']:.2f} s){stepped}",
            flush=True,
        )
        ratios.append((f"{rows}x{new}", rate["vllm"] / rate["torch"]))
    for (a, ra), (b, rb) in zip(ratios, ratios[1:]):
        if (ra - 1) * (rb - 1) < 0:
            print(f"the ratio crosses 1 between {a} ({ra:.2f}x) and {b} ({rb:.2f}x)", flush=True)
    vllm_engine.close()


if __name__ == "__main__":
    main()
