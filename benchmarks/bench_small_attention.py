"""Small-head attention on the CPU: rlcore.ops.masked_attention against SDPA's fused kernel, and the step they serve.

Run: python benchmarks/bench_small_attention.py [--threads 2] [--repeats 30] [--skip-grid] [--skip-step]

Grid: forward + backward of masked attention (a causal mask as a bool tensor, grouped
query heads) over problem shapes from the main job's shared-prompt forward (32 groups,
4 heads over 2 kv heads of 16 dimensions, 44 tokens) to a few hundred keys, each timed by
``F.scaled_dot_product_attention(..., attn_mask=mask, enable_gqa=True)`` and by
:func:`rlcore.ops.masked_attention`, their calls alternated; printed: both medians and
SDPA's time over ours, and the key counts between which the ratio crosses 1 (the models
use ours up to :data:`rlcore.models.attention.CPU_SMALL_KEYS` keys on the CPU). Malloc is
set as the trainer sets it (:func:`rlcore.memory.keep_freed_host_memory`, 256 MiB).

Step: the forward and backward of the main job's policy (``configs/grpo_tiny.yaml``'s
model) over a GRPO batch of its task (32 reversal prompts x 8 responses of 1 to 5
tokens), the shared-prompt forward the update runs, in four variants alternated in one
process: the attention kernel (SDPA, or ours as the models pick it) times glibc's malloc
(its start-up thresholds, 128 KiB, held fixed; or :func:`rlcore.memory.keep_freed_host_memory`
with the trainer's default 256 MiB). glibc's own adaptive thresholds cannot be restored
in a process once set; the bench's default-malloc variant is therefore the thresholds
glibc starts with. Printed: each median, each variant's speed-up over SDPA with the
start-up thresholds, and the page faults per step of each malloc setting (over consecutive
steps under that setting).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from _timing import alternated_medians
from rlcore.memory import START_THRESHOLD, keep_freed_host_memory, set_malloc_thresholds
from rlcore.models import attention as model_attention
from rlcore.models import from_hf, load_causal_lm
from rlcore.ops import masked_attention
from rlcore.train.stages import response_logprobs
from rlcore.train.tasks import Reversal

ROOT = Path(__file__).resolve().parents[1]
GRID = [  # (groups, heads, kv heads, tokens, head dim)
    (32, 4, 2, 44, 16),
    (16, 4, 2, 88, 16),
    (8, 4, 2, 128, 16),
    (8, 4, 2, 260, 16),
    (32, 8, 2, 44, 64),
    (8, 8, 2, 88, 64),
    (8, 8, 2, 128, 64),
    (256, 4, 2, 6, 16),
]


def grid(repeats: int) -> None:
    keep_freed_host_memory(256)  # as the trainer runs
    print("forward + backward, causal bool mask, malloc as the trainer sets it; ratio = SDPA / ours (> 1: ours faster)")
    rows = []
    for b, h, kv, t, d in GRID:
        g = torch.Generator().manual_seed(0)
        mask = torch.ones(t, t, dtype=torch.bool).tril_()[None, None].expand(b, 1, t, t).contiguous()
        q = torch.randn(b, h, t, d, generator=g).requires_grad_()
        k, v = (torch.randn(b, kv, t, d, generator=g).requires_grad_() for _ in range(2))
        cotangent = torch.randn(b, h, t, d, generator=g)

        def sdpa() -> None:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True).backward(cotangent)

        def ours() -> None:
            masked_attention(q, k, v, mask, scale=d**-0.5).backward(cotangent)

        m = alternated_medians({"sdpa": sdpa, "ours": ours}, repeats=repeats)
        ratio = m["sdpa"] / m["ours"]
        rows.append((t, ratio))
        print(
            f"  [{b:3d}, {h}/{kv} heads, {t:3d} tokens, head_dim {d:3d}]  sdpa {m['sdpa'] * 1e3:7.3f} ms  "
            f"ours {m['ours'] * 1e3:7.3f} ms  ratio {ratio:5.2f}x",
            flush=True,
        )
    faster = sorted({t for t, r in rows if r > 1})
    slower = sorted({t for t, r in rows if r <= 1})
    print(f"ours faster at {faster} keys, SDPA at {slower} keys; CPU_SMALL_KEYS = {model_attention.CPU_SMALL_KEYS}")


def _batch(prompts: int, samples: int, vocab: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    task = Reversal(length=4, min_length=2, letters="abcdef")
    encoded = [task.tokenizer.encode(r["prompt"]) for r in task.sample(prompts, g)]
    width = max(len(p) for p in encoded)
    ids = torch.zeros(prompts * samples, width, dtype=torch.long)
    pmask = torch.zeros_like(ids)
    for i, p in enumerate(encoded):
        ids[i * samples : (i + 1) * samples, width - len(p) :] = torch.tensor(p)
        pmask[i * samples : (i + 1) * samples, width - len(p) :] = 1
    lengths = torch.randint(1, 6, (prompts * samples,), generator=g)
    responses = torch.randint(2, vocab, (prompts * samples, 5), generator=g)
    mask = (torch.arange(5)[None] < lengths[:, None]).float()
    return {"prompts": ids, "prompt_mask": pmask, "responses": responses * mask.long(), "mask": mask}


def step(repeats: int) -> None:
    def malloc(kept: bool) -> None:
        if kept:
            keep_freed_host_memory(256)
        else:
            set_malloc_thresholds(START_THRESHOLD, START_THRESHOLD)

    cfg = yaml.safe_load((ROOT / "configs" / "grpo_tiny.yaml").read_text())
    task = Reversal(length=4, min_length=2, letters="abcdef")
    model = load_causal_lm(cfg["model"]["model_name_or_path"], vocab_size=task.tokenizer.vocab_size, seed=0)
    lm = from_hf(model)
    batch = _batch(32, 8, task.tokenizer.vocab_size, torch.Generator().manual_seed(0))
    small = model_attention.CPU_SMALL_KEYS

    def once() -> None:
        logp, entropy = response_logprobs(lm, batch, temperature=2.5, with_entropy=True)
        (logp.sum() + entropy.sum()).backward()

    def variant(ours: bool, kept: bool):
        def run() -> None:
            model_attention.CPU_SMALL_KEYS = small if ours else 0
            malloc(kept)
            once()

        return run

    names = {"sdpa, malloc 128 KiB": (False, False), "sdpa, kept": (False, True)}
    names.update({"ours, malloc 128 KiB": (True, False), "ours, kept": (True, True)})
    m = alternated_medians({n: variant(*v) for n, v in names.items()}, repeats=repeats)
    model_attention.CPU_SMALL_KEYS = small
    base = m["sdpa, malloc 128 KiB"]
    print("the main job's policy, forward + backward of a 32 x 8 GRPO batch (shared-prompt forward)")
    for name, t in m.items():
        print(f"  {name:<22} {t * 1e3:7.2f} ms   speed-up {base / t:5.2f}x", flush=True)
    for kept in (False, True):  # consecutive steps under one setting
        malloc(kept)
        counts = []
        for _ in range(7):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            once()
            counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        print(f"  page faults per step, malloc {'kept' if kept else '128 KiB'}: median {sorted(counts)[3]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--skip-step", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    if not args.skip_grid:
        grid(args.repeats)
    if not args.skip_step:
        step(args.repeats)


if __name__ == "__main__":
    main()
