"""Packed versus padded forward + backward of a tiny Qwen2 on heavy-tailed sequence lengths.

Run: python benchmarks/bench_packing.py [--seqs 64 --median 200 --max-len 2048 --repeats 3]

Lengths are log-normal (median ``--median``, sigma 1), clipped to ``[8, --max-len]``,
as RL responses are. Both paths compute the log-prob of every real token with the
same fused kernel (``rlcore.ops.linear_logprobs``) and backpropagate into the model,
so the difference is the layout alone:

* padded: the HF backbone on ``[B, T]`` right-padded inputs with ``attention_mask``
  (SDPA), then log-probs over all ``B * T`` positions, masked.
* packed: ``rlcore.models.token_logprobs`` (one row of real tokens, per-sequence
  attention).

Prints the padding fraction the packing removes, median step times, real tokens per
second of each, and their ratio (target >= 2x).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import median_time
from rlcore.models import from_hf, load_causal_lm, token_logprobs
from rlcore.ops import linear_logprobs

CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def lengths_lognormal(n: int, median: float, max_len: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(
        torch.randn(n, generator=g, dtype=torch.float64) + torch.log(torch.tensor(median, dtype=torch.float64))
    )
    return raw.round().clamp(8, max_len).long().tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--median", type=float, default=200.0)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    lengths = lengths_lognormal(args.seqs, args.median, args.max_len)
    b, t = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (b, t), generator=g)
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).long()
    real = sum(lengths)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny Qwen2 {CONFIG['hidden_size']}d x "
        f"{CONFIG['num_hidden_layers']} layers, vocab {CONFIG['vocab_size']}"
    )
    print(
        f"{b} sequences, lengths log-normal: median {sorted(lengths)[b // 2]}, max {t}, {real} real tokens; "
        f"padded [{b}, {t}] = {b * t} positions: packing removes {1 - real / (b * t):.1%} of them"
    )

    model = load_causal_lm(CONFIG, seed=0)
    model.set_attn_implementation("sdpa")
    apply, params = from_hf(model)
    backbone = model.model
    batch = {"input_ids": ids, "attention_mask": mask}
    labels = torch.roll(ids, -1, dims=1).reshape(-1)
    scored = (mask * torch.roll(mask, -1, dims=1)).reshape(-1).float()

    def padded() -> None:
        hidden = backbone(ids, attention_mask=mask).last_hidden_state.reshape(b * t, -1)
        logp = linear_logprobs(hidden, model.lm_head.weight, labels)
        (logp * scored).sum().backward()
        model.zero_grad(set_to_none=True)

    def packed() -> None:
        token_logprobs(apply, params, batch).sum().backward()
        model.zero_grad(set_to_none=True)

    t_packed = median_time(packed, repeats=args.repeats)
    print(f"  packed  median {t_packed * 1e3:9.1f} ms   {real / t_packed:10.0f} tokens/s", flush=True)
    t_padded = median_time(padded, repeats=args.repeats)
    print(f"  padded  median {t_padded * 1e3:9.1f} ms   {real / t_padded:10.0f} tokens/s", flush=True)
    ratio = t_padded / t_packed
    print(f"packed / padded tokens per second: {ratio:.2f}x (target >= 2x: {'met' if ratio >= 2 else 'NOT met'})")


if __name__ == "__main__":
    main()
