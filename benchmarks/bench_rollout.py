"""Rollout throughput: VLLMEngine (vLLM, in-process) against TorchEngine (rlcore's KV-cached decode loop).

Run: python benchmarks/bench_rollout.py [--sizes 32x32,128x64,256x128,512x128] [--dtype float32] [--repeats 3]
(one size alone: ``--sizes 256x128``)

Both engines sample the same random Qwen2 (4 layers, hidden 512, 8 heads of 64, MLP
1536, vocabulary 2048, float32 by default) from the same left-padded prompts (8 to 24
tokens), temperature 1, keyed by the same row streams, each size ``ROWSxNEW``: ROWS
sequences (prompts x 8 samples) of up to NEW new tokens. vLLM holds the weights the
trainer would publish: they reach it through ``rlcore.dataflow.WeightSync``. Tokens
per second count the response tokens each engine produced (a row may stop at
``<eos>``); the time is the median of ``--repeats`` calls after one warm-up call.
Printed per size: both medians, both rates, and the ratio vLLM / torch (target: at
least 2x at 256 x 128 and above). Threads: torch's setting (``--threads``, default
all cores), the same for both. ``--stepped`` also times vLLM's interruptible path
(``generate(refresh=)``, the engine stepped one token at a time and asked for new weights
between steps; none arrives) and prints its time over the plain call's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from _timing import median_time
from rlcore.dataflow import WeightSync
from rlcore.seeding import Purpose, RowStream
from rlcore.train import TorchEngine, VLLMEngine, VLLMOptions, left_pad

EOS, PAD, VOCAB, SAMPLES = 1, 0, 2048, 8
LAYERS, HIDDEN, HEADS, HEAD_DIM = 4, 512, 8, 64
BLOCK = 128  # KV-cache block (tokens): vLLM's CPU default, set so the cache is sized in whole blocks


def model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "qwen2",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=3 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def prompts(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 25, (rows // SAMPLES,), generator=g).tolist()
    return left_pad([torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths], PAD)


def _never() -> None:
    """A refresh under which no new version ever arrives: the interruptible path's own cost."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32x32,128x64,256x128,512x128", help="ROWSxNEW, comma-separated")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--stepped", action="store_true", help="also time vLLM's interruptible (partial) path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    policy = model(dtype)
    longest_rows = max(r for r, _ in sizes)
    # Every sequence of the largest size holds its blocks at once: vLLM never preempts a row
    # (a resumed seeded request fails on the CPU build), whole blocks per sequence.
    blocks = -(-(24 + max(n for _, n in sizes)) // BLOCK)
    kv_token_bytes = 2 * LAYERS * HEADS * HEAD_DIM * torch.finfo(dtype).bits // 8
    options = VLLMOptions(
        kv_cache_memory_bytes=int(1.25 * longest_rows * blocks * BLOCK * kv_token_bytes),
        max_num_seqs=longest_rows,
        block_size=BLOCK,
    )
    vllm_engine = VLLMEngine.from_module(policy, eos_token_id=EOS, pad_token_id=PAD, options=options)
    record = WeightSync(dict(policy.named_parameters())).sync(1, vllm_engine.receiver())
    print(
        f"model: {LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}, {args.dtype}; {args.threads} threads; "
        f"weights synced to vLLM in {record.seconds:.3f} s ({record.nbytes / 2**20:.1f} MiB); "
        f"medians of {args.repeats} after 1 warm-up",
        flush=True,
    )
    for rows, new in sizes:
        ids, mask = prompts(rows)
        engines = {
            "vllm": vllm_engine.sampling(max_new_tokens=new),
            "torch": TorchEngine(policy, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=new),
        }
        calls = {name: {} for name in engines}
        if args.stepped:
            engines["stepped"] = engines["vllm"]
            calls["stepped"] = {"refresh": _never}
        seconds, tokens = {}, {}
        for name, engine in engines.items():
            out: list = []

            def call(engine=engine, out=out, kw=calls[name]) -> None:
                stream = RowStream(0, Purpose.SAMPLING, 0)
                out[:] = [engine.generate(ids, mask, n=SAMPLES, generator=stream, **kw)]

            seconds[name] = median_time(call, repeats=args.repeats, warmup=1)
            tokens[name] = int(out[0].mask.sum())
        rate = {k: tokens[k] / seconds[k] for k in engines}
        stepped = f"   stepped / plain vllm time {seconds['stepped'] / seconds['vllm']:5.2f}x" if args.stepped else ""
        print(
            f"{rows:4d} seqs x {new:3d} new tokens   vllm {seconds['vllm']:8.3f} s {rate['vllm']:9.1f} tok/s   "
            f"torch {seconds['torch']:8.3f} s {rate['torch']:9.1f} tok/s   ratio {rate['vllm'] / rate['torch']:5.2f}x"
            f"{stepped}",
            flush=True,
        )
    vllm_engine.close()


if __name__ == "__main__":
    main()
