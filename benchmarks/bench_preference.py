"""A DPO step with chosen and rejected in one packed or one padded forward pass, against two separate forwards.

Run: python benchmarks/bench_preference.py [--pairs 8] [--length 128] [--repeats 15] [--threads 1]
Model: a random-weight Qwen2 causal LM built from its config (hidden 128, 2 layers,
vocabulary 4096; no download). A step is forward + DPO loss + backward of the policy,
with reference log-probs precomputed as batch columns. Three paths, timed in the
same run, call by call in turn:

- padded: ``rlcore.models.preference_logps(..., packed=False)``, one forward of ``[2B, T]``
  (both sides right-padded to one length), then ``dpo().loss``;
- packed: ``preference_logps(*rlcore.models.from_hf(lm), ...)``, one forward of the ``N``
  real tokens in one packed row, fused log-probs (the logits are never built), then
  ``dpo().loss``;
- two forwards: ``[B, T_chosen]`` and ``[B, T_rejected]``, with the padded path's
  primitives (logprobs_from_logits, sequence_logps, dpo_loss).

Prints the medians (wall and process CPU time) and the ratios (baseline / ours) of
packed vs padded, packed vs two forwards and padded vs two forwards, for equal and
for unequal longest lengths.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from _timing import report
from rlcore.algos import dpo, dpo_loss
from rlcore.device import get_device
from rlcore.models import from_hf, preference_logps
from rlcore.ops import logprobs_from_logits, sequence_logps


def tiny_qwen2(device: torch.device) -> torch.nn.Module:
    config = transformers.Qwen2Config(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).to(device)


def pair_batch(pairs: int, length: int, rejected_length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded pairs with random lengths up to ``length`` (chosen) and ``rejected_length``."""
    g = torch.Generator().manual_seed(0)
    batch = {}
    for side, longest in (("chosen", length), ("rejected", rejected_length)):
        lengths = torch.randint(longest // 2, longest + 1, (pairs,), generator=g)
        pos = torch.arange(longest)
        attention = (pos < lengths[:, None]).long()
        mask = (pos >= length // 4) & attention.bool()
        ids = torch.randint(0, 4096, (pairs, longest), generator=g) * attention
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": attention, f"{side}_mask": mask})
    return {k: v.to(device) for k, v in batch.items()}


def _side_logps(model, batch, side):  # type: ignore[no-untyped-def]
    ids, attention, mask = (batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "mask"))
    logits = model(ids, attention)
    scored = mask[:, 1:]
    logp = logprobs_from_logits(logits[:, :-1], torch.where(scored, ids[:, 1:], 0))
    return sequence_logps(logp.float(), scored)


def bench(model, lm, device, pairs, length, rejected_length, repeats):  # type: ignore[no-untyped-def]
    batch = pair_batch(pairs, length, rejected_length, device)
    padded_apply = lambda _, ids, am: model(ids, am)  # noqa: E731 -- the padded path's apply(params, ids, mask)
    with torch.no_grad():
        ref = preference_logps(padded_apply, None, batch, packed=False)
    batch.update(ref_chosen_logps=ref["chosen_logps"] - 0.5, ref_rejected_logps=ref["rejected_logps"] + 0.5)
    recipe = dpo(beta=0.1)
    apply, params = from_hf(lm)

    def synchronize() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize()

    def one_forward() -> torch.Tensor:
        loss, _ = recipe.loss({**batch, **preference_logps(padded_apply, None, batch, packed=False)})
        loss.backward()
        lm.zero_grad(set_to_none=True)
        synchronize()
        return loss.detach()

    def packed() -> torch.Tensor:
        loss, _ = recipe.loss({**batch, **preference_logps(apply, params, batch)})
        loss.backward()
        lm.zero_grad(set_to_none=True)
        synchronize()
        return loss.detach()

    def two_forwards() -> torch.Tensor:
        chosen = _side_logps(model, batch, "chosen")
        rejected = _side_logps(model, batch, "rejected")
        loss = dpo_loss(chosen, rejected, batch["ref_chosen_logps"], batch["ref_rejected_logps"])[0].mean()
        loss.backward()
        lm.zero_grad(set_to_none=True)
        synchronize()
        return loss.detach()

    torch.testing.assert_close(one_forward(), two_forwards(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed(), two_forwards(), rtol=1e-4, atol=1e-5)
    # The paths take turns call by call, so drift in machine load hits all alike.
    # Process CPU time is reported beside wall time: on a shared machine it leaves out
    # the time this process spent descheduled.
    paths = {"padded": one_forward, "packed": packed, "two": two_forwards}
    times: dict[str, list[tuple[float, float]]] = {key: [] for key in paths}
    for _ in range(repeats):
        for key, fn in paths.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[key].append((time.perf_counter() - wall, time.process_time() - cpu))
    real = sum(int(batch[f"{side}_attention_mask"].sum()) for side in ("chosen", "rejected"))
    stacked = 2 * pairs * length
    print(f"DPO step {pairs} pairs, T_c<={length}, T_r<={rejected_length}: {real} real tokens of {stacked} padded")
    for i, clock in enumerate(("wall", "cpu")):
        median = {key: statistics.median(t[i] for t in runs) for key, runs in times.items()}
        report(f"  packed vs padded [{clock}]", median["packed"], median["padded"])
        report(f"  packed vs two forwards [{clock}]", median["packed"], median["two"])
        report(f"  padded vs two forwards [{clock}]", median["padded"], median["two"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    # One thread by default: on a shared CPU a descheduled worker thread stalls every
    # op of a two-thread run, which swamps the difference being measured.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    device = get_device()
    lm = tiny_qwen2(device)

    def model(ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return lm(input_ids=ids, attention_mask=attention_mask).logits

    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads")
    # Equal longest lengths: the padded pass adds no padding across sides. Shorter
    # rejected side: it pads rejected to the chosen length, which two forwards avoid.
    # The packed pass drops all padding, also that of the shorter pairs within a side.
    for rejected_length in (args.length, args.length * 7 // 8, args.length // 2):
        bench(model, lm, device, args.pairs, args.length, rejected_length, args.repeats)


if __name__ == "__main__":
    main()
