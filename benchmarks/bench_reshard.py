"""Resharding flow: predicted device peaks of train -> rollout -> train, naive order vs AllGather-Swap.

Run: python benchmarks/bench_reshard.py

Accounting mode (any machine, the CPU included): the weights of a ~1.1B-parameter
decoder (TinyLlama-1.1B shapes: 22 layers, hidden 2048, GQA 32/4 heads, MLP 5632,
vocab 32000, untied lm_head) exist as ``meta`` tensors only -- nothing is allocated.
Per layout change, rlcore's memory plan predicts for the worst rank the device peak
of the naive order (inference weights built while params, grads and optimizer state
stay resident; cleanup after) and of AllGather-Swap (offload first, stream the
build bucket by bucket, free before reload), and the redundancy: peak minus the
larger of the two phases' resident bytes. Target: AllGather-Swap's redundancy at
most one bucket. Training state: bf16 params and grads, AdamW's two moments in bf16
(as torch.optim keeps them); the KV cache is a fixed budget.
"""

from __future__ import annotations

import argparse

import torch

from rlcore.dataflow.layout import decoder_layout, decoder_param_meta
from rlcore.dataflow.reshard import plan_reshard
from rlcore.memory.plan import colocated_plan

GIB = 1 << 30


def tinyllama_meta(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return decoder_param_meta(layers=22, hidden=2048, intermediate=5632, vocab=32000, kv_hidden=256, dtype=dtype)


def gib(x: int) -> str:
    return f"{x / GIB:7.3f} GiB"


def account(meta: dict, train: dict, infer: dict, bucket_bytes: int, kv_cache_bytes: int) -> None:
    src, dst = decoder_layout(meta, **train), decoder_layout(meta, **infer)
    plan = plan_reshard(meta, src, dst, bucket_bytes=bucket_bytes)
    rows = []
    for rank in range(src.world_size):
        mem = colocated_plan(plan, rank=rank, kv_cache_bytes=kv_cache_bytes)
        rows.append(
            (
                mem,
                {
                    (a, b, o): mem.transition(a, b, order=o)
                    for a, b in (("train", "rollout"), ("rollout", "train"))
                    for o in ("naive", "swap")
                },
            )
        )
    print(
        f"\n{src.describe()}  ->  {dst.describe()}   ({len(plan.buckets)} buckets of <= {gib(bucket_bytes)},"
        f" KV cache {gib(kv_cache_bytes)})"
    )
    for phase in ("train", "rollout"):
        res = [m.resident_bytes(phase) for m, _ in rows]
        print(f"  resident in {phase:<7} per rank: {gib(min(res))} .. {gib(max(res))}")
    for a, b in (("train", "rollout"), ("rollout", "train")):
        naive = max((t[(a, b, "naive")] for _, t in rows), key=lambda x: x.redundancy_bytes)
        swap = max((t[(a, b, "swap")] for _, t in rows), key=lambda x: x.redundancy_bytes)
        peak_n = max(t[(a, b, "naive")].peak_bytes for _, t in rows)
        peak_s = max(t[(a, b, "swap")].peak_bytes for _, t in rows)
        ok = "met" if swap.redundancy_bytes <= bucket_bytes else "NOT met"
        print(
            f"  {a:>7} -> {b:<7} max over ranks: peak naive {gib(peak_n)} (redundancy {gib(naive.redundancy_bytes)})"
            f" | AllGather-Swap {gib(peak_s)} (redundancy {gib(swap.redundancy_bytes)},"
            f" {swap.redundancy_bytes / bucket_bytes:.2f} bucket; target <= 1 bucket: {ok})"
        )
    tr = {k: max((t[k] for _, t in rows), key=lambda x: x.redundancy_bytes) for k in rows[0][1]}
    naive, swap = tr[("train", "rollout", "naive")].redundancy_bytes, tr[("train", "rollout", "swap")].redundancy_bytes
    removed = 1 - swap / max(naive, 1)
    print(f"  redundant bytes removed on train -> rollout: {removed:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--kv-gib", type=float, nargs="+", default=[4.0, 0.0])
    args = parser.parse_args()
    meta = tinyllama_meta()
    total = sum(t.numel() for t in meta.values())
    print(f"decoder: {total / 1e9:.3f}B parameters (meta tensors, nothing allocated); accounting mode")
    bucket = args.bucket_mib << 20
    for kv_gib in args.kv_gib:
        kv = int(kv_gib * GIB)
        account(meta, dict(tp=4, pp=2), dict(tp=2, dp=4), bucket, kv)
        account(meta, dict(tp=4, pp=2), dict(dp=8), bucket, kv)
        account(meta, dict(tp=2, dp=2), dict(dp=4), bucket, kv)
        account(meta, dict(dp=2), dict(tp=2), bucket, kv)
        account(meta, dict(pp=2, dp=2), dict(dp=4), bucket, kv)


if __name__ == "__main__":
    main()
