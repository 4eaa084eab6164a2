"""Token log-probs + entropy, forward and backward: peak memory and time against the plain paths.

Run: python benchmarks/bench_logprobs.py [--tokens 2048 --vocab 151936 --hidden 896 --repeats 3]

Each variant runs in its own subprocess, so one variant's freed memory cannot hide
another's peak. In each, the inputs are built first; the figure reported is the peak
resident set size (``ru_maxrss``) above the resident size right after that, over
``repeats`` forward + backward passes (log-probs and entropy, float32), and the
median time of those passes. Variants:

* naive:   ``log_softmax(logits).gather`` and ``logsumexp - sum(softmax * logits)``
           (verl's ``entropy_from_logits``), two autograd graphs over the logits.
* chunked: ``rlcore.ops.logprobs_from_logits(..., with_entropy=True)``, one call.
* plain:   from hidden states: ``hidden @ weight.T`` then the naive path.
* fused:   ``rlcore.ops.linear_logprobs(hidden, weight, ..., with_entropy=True)``.

Targets (issue 5): chunked extra peak <= 1.5x the logits size at no more than the
naive time; fused extra peak beyond the weight-gradient buffer <= 0.25x the logits
size at no more than 1.3x the plain time.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = ("naive", "chunked", "plain", "fused")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits, -1)
    entropy = torch.logsumexp(logits, -1) - (probs * logits).sum(-1)
    return logp.sum() + entropy.sum()


def run_variant(name: str, n: int, vocab: int, hidden_size: int, repeats: int) -> dict[str, float]:
    from rlcore.ops import linear_logprobs, logprobs_from_logits

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab, (n,), generator=g)
    # Inputs are made in place: a temporary here would raise the peak before the baseline.
    if name in ("naive", "chunked"):
        logits = torch.empty(n, vocab).normal_(generator=g).mul_(3.0).requires_grad_()
        leaves = [logits]
    else:
        hidden = torch.empty(n, hidden_size).normal_(generator=g).requires_grad_()
        weight = torch.empty(vocab, hidden_size).normal_(generator=g).mul_(hidden_size**-0.5).requires_grad_()
        leaves = [hidden, weight]

    def step() -> None:
        if name == "naive":
            loss = _naive(logits, labels)
        elif name == "chunked":
            lp, ent = logprobs_from_logits(logits, labels, with_entropy=True)
            loss = lp.sum() + ent.sum()
        elif name == "plain":
            loss = _naive(hidden @ weight.T, labels)
        else:
            lp, ent = linear_logprobs(hidden, weight, labels, with_entropy=True)
            loss = lp.sum() + ent.sum()
        loss.backward()
        for leaf in leaves:
            leaf.grad = None

    base = _rss_bytes()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"extra_peak": float(_peak_bytes() - base), "time": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--repeats", type=int, default=3, help="passes per logits variant")
    parser.add_argument("--hidden-repeats", type=int, default=2, help="passes per hidden-state variant (matmul-bound)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.tokens, args.vocab, args.hidden, args.repeats)))
        return

    n, vocab, h = args.tokens, args.vocab, args.hidden
    logits_bytes = n * vocab * 4
    wgrad_bytes = vocab * h * 4
    gib = 1 << 30
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; N={n}, V={vocab}, H={h}, float32, "
        f"fwd+bwd of log-probs and entropy, median of {args.repeats} passes ({args.hidden_repeats} from hidden states)"
    )
    print(f"logits tensor: {logits_bytes / gib:.2f} GiB; weight gradient: {wgrad_bytes / gib:.2f} GiB")
    res = {}
    for name in VARIANTS:
        repeats = args.repeats if name in ("naive", "chunked") else args.hidden_repeats
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            name,
            "--tokens",
            str(n),
            "--vocab",
            str(vocab),
            "--hidden",
            str(h),
            "--repeats",
            str(repeats),
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res[name] = json.loads(out.strip().splitlines()[-1])
        r = res[name]
        print(
            f"  {name:<8} extra peak {r['extra_peak'] / gib:6.2f} GiB = {r['extra_peak'] / logits_bytes:5.2f}x logits"
            f"   time {r['time'] * 1e3:9.1f} ms",
            flush=True,
        )

    chunk_mem = res["chunked"]["extra_peak"] / logits_bytes
    chunk_time = res["chunked"]["time"] / res["naive"]["time"]
    naive_mem = res["naive"]["extra_peak"] / logits_bytes
    print(f"naive path: extra peak {naive_mem:.2f}x logits")
    print(
        f"chunked: extra peak {chunk_mem:.2f}x logits (target <= 1.5x: {'met' if chunk_mem <= 1.5 else 'NOT met'}); "
        f"time {chunk_time:.2f}x naive (target <= 1x: {'met' if chunk_time <= 1.0 else 'NOT met'})"
    )
    fused_mem = (res["fused"]["extra_peak"] - wgrad_bytes) / logits_bytes
    plain_mem = (res["plain"]["extra_peak"] - wgrad_bytes) / logits_bytes
    fused_time = res["fused"]["time"] / res["plain"]["time"]
    print(f"plain from hidden: extra peak beyond the weight gradient {plain_mem:.2f}x logits")
    print(
        f"fused: extra peak beyond the weight gradient {fused_mem:.2f}x logits "
        f"(target <= 0.25x: {'met' if fused_mem <= 0.25 else 'NOT met'}); "
        f"time {fused_time:.2f}x plain (target <= 1.3x: {'met' if fused_time <= 1.3 else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
