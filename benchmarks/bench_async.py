"""Asynchronous RL on heavy-tailed response lengths: the synchronous trainer against async and partial rollouts.

Run: python benchmarks/bench_async.py [--steps 120] [--warmup-steps 150] [--median 8] [--sigma 1.0] [--cap 20]
     [--variants sync,async1,async2,async4,partial,carry] [--seeds 0,1,2] [--val-size 512] [--eval-samples 8]
     python benchmarks/bench_async.py --sim-only      (the simulated schedule at AReaL's scale alone)

1. Real, on this machine. The main job's task and model (``configs/grpo_tiny.yaml``,
   trained by :func:`rlcore.train.train`), with a long tail of response lengths: each
   row stays in the decode batch past its end (fed padding; those tokens are masked
   out: not scored, not trained) until it has decoded a length drawn per row: a
   lognormal, ``median * exp(sigma * z)`` with ``z`` standard normal keyed by the row's
   (prompt step, row), median ``--median`` tokens and shape ``--sigma``, capped at
   ``--cap`` times the median -- so a few rows of every batch are 10-20x the median.
   Every variant decodes the same lengths for the same rows, and every variant's
   decoder lets a row leave the batch once it has decoded its length (as
   :class:`rlcore.models.decoding.CachedDecoder.drop` does at ``<eos>``: continuous
   batching, not a static batch padded to its longest row). Variants, same samples each:

   * synchronous: the blocking, staleness-0 pipeline, rollout and update in one
     process on both cores (``trainer.threads=2``);
   * async at staleness 1, 2 and 4: ``deploy.mode=disaggregated``,
     ``deploy.async_infer=true``, one rollout worker process (1 thread) beside the
     trainer (1 thread);
   * async with partial rollouts (``deploy.partial_rollouts=true``) at
     ``--partial-staleness``: a version reaching the worker mid-rollout is taken
     between two tokens (the tail included);
   * async with partial rollouts and carry-over (``deploy.carry_over=true``) at
     ``--partial-staleness``: the worker keeps that many later steps' prompts in
     flight and a step trains the first ``rl.batch_size`` groups that finished; the
     long rows finish into later steps (no token older than the staleness bound).

   Samples per second over the RL steps (the sum of the steps' wall times; warm-up and
   worker start-up excluded), each variant's ratio to the synchronous one, the final
   reward and its difference from the synchronous one, and the mean row and token lags.
   Every variant trains the same number of samples (``--steps`` x the batch). The final
   reward is the final weights' (``val/reward`` of :class:`rlcore.train.validation.Validator`:
   ``--val-size`` held-out prompts x ``--eval-samples`` answers at the rollout's
   temperature, the same prompts and random streams for every variant). The rollout
   reward of the last 10% of steps is printed beside it: it scores rows sampled by
   weights up to ``deploy.staleness`` versions old, so on a rising curve it lags the
   synchronous run's by about the mean lag times the curve's slope.
   Each variant runs once per seed of ``--seeds`` (``trainer.seed``: the warm-up, the
   data order and the sampling; the synchronous run is deterministic, the async ones
   are not: a version reaches the worker when it is ready). One seed is one draw: runs
   that differ only in rounding (the synchronous run on 1 thread instead of 2, or async
   at staleness 0) ended up to 0.03 apart in the final reward. The summary prints the
   mean over the seeds +- the sample standard deviation; ratios and reward differences
   are taken per seed against that seed's synchronous run, then averaged.

2. Simulated at AReaL's scale (:func:`rlcore.dataflow.simulate`, the pipeline's own
   scheduling rules on a virtual clock). AReaL (Fu et al., 2025, arXiv:2505.24298)
   reports 2.77x over a synchronous system with the same GPUs. The layout here: 16
   nodes of 8 devices (AReaL's 1.5B runs), ``--sim-prompts`` prompts x
   ``--sim-samples`` answers per step, lengths lognormal as above at ``--sim-median``
   tokens capped at ``--cap`` x. The cost model, in decode steps of one instance (the
   step latency is the unit):

   * synchronous: every device generates, then every device trains; the step's
     generation lasts until the longest row of the batch (a batch waits for its tail);
   * async: some nodes generate (one instance per device, a call of ``rows /
     instances`` rows lasting until its longest row), the others train, at staleness
     ``--sim-staleness`` (AReaL's eta = 8 for math); the split by whole nodes that
     finishes first is reported (AReaL balances generation against training);
   * async with partial rollouts: a call costs its rows' tokens over the instance's
     concurrency (an interrupted row carries on into the next call: no call waits for
     its tail).

   Training takes ``--sim-train-share`` of the synchronous step on all devices, and
   proportionally longer on fewer. These costs are assumptions to calibrate against
   AReaL's measured generation and training times, not figures taken from its paper.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from rlcore.dataflow import StageGraph, simulate, stage
from rlcore.models.decoding import CachedDecoder
from rlcore.seeding import mix
from rlcore.train import TorchEngine, build_model, load_config, source_tokenizer, task_options, train
from rlcore.train.carry import ContinuousRollout
from rlcore.train.deploy import RolloutServer, WorkerDeployment

ROOT = Path(__file__).resolve().parents[1]
# The tail's shape, read by the rollout worker process too (it re-imports this module).
TAIL = "RLCORE_BENCH_TAIL"
AREAL_SPEEDUP = 2.77


def tail_lengths(rows: torch.Tensor, step: int, median: float, sigma: float, cap: float) -> torch.Tensor:
    """Each row's decode length: ``median * exp(sigma * z)`` capped at ``cap * median``, ``z`` keyed by (step, row)."""
    out = []
    for row in rows.tolist():
        g = torch.Generator().manual_seed(mix(7919, step, row))
        z = float(torch.randn((), generator=g))
        out.append(min(cap * median, median * math.exp(sigma * z)))
    return torch.tensor(out).round().clamp(min=1).to(torch.int64)


def _tail_shape() -> tuple[float, float, float]:
    median, sigma, cap = (float(x) for x in os.environ.get(TAIL, "8,1.0,20").split(","))
    return median, sigma, cap


class TailEngine(TorchEngine):
    """A :class:`rlcore.train.TorchEngine` whose rows stay in the decode batch past their end to their tail length.

    The response is the engine's; the extra decode steps only cost time. A row leaves the
    batch once it has decoded its length (the rule of :meth:`CachedDecoder.drop
    <rlcore.models.decoding.CachedDecoder.drop>`), so a call lasts until its longest row
    and costs the forwards of the rows still in it. With ``refresh`` (partial rollouts)
    new weights are taken in the tail too: the cache is rebuilt on the new weights, as in
    :func:`rlcore.train.generate`.
    """

    def __init__(self, model: Any, **sampling: Any):
        super().__init__(model, **sampling)
        self.tail = _tail_shape()

    def generate(self, prompts, prompt_mask, *, n, generator, refresh=None, version=0):  # type: ignore[no-untyped-def]
        extra = {} if refresh is None else {"refresh": refresh, "version": version}
        r = super().generate(prompts, prompt_mask, n=n, generator=generator, **extra)
        rows = getattr(generator, "rows", None)
        rows = torch.arange(r.responses.shape[0]) if rows is None else rows
        lengths = tail_lengths(rows, getattr(generator, "step", 0), *self.tail)
        if int(lengths.max()) > r.responses.shape[1]:
            attention = torch.cat([r.prompt_mask, torch.ones_like(r.mask)], 1)
            self._decode(torch.cat([r.prompts, r.responses], 1), attention, lengths - r.responses.shape[1], refresh)
        return r

    @torch.no_grad()
    def _decode(self, ids: torch.Tensor, attention: torch.Tensor, left: torch.Tensor, refresh: Any) -> None:
        """Feed padding to each row for ``left`` more steps; a row leaves the batch once its steps are done."""
        was_training = self.model.training
        self.model.eval()
        try:
            decoder = CachedDecoder(self.model, ids, attention)
            pad = torch.zeros(ids.shape[0], dtype=torch.int64)
            for t in range(int(left.max())):
                if refresh is not None and refresh() is not None:  # new weights: re-encode the rows still in
                    active = decoder.active
                    decoder = CachedDecoder(self.model, ids[active], decoder.attention, active=active)
                if decoder.drop(left <= t) == 0:
                    break
                decoder.feed(pad)
                ids = torch.cat([ids, pad[:, None]], 1)
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def load_weights(self, params: dict[str, torch.Tensor]) -> None:
        """The trainer's weights into this engine's own model (the synchronous run's in-process engine)."""
        for name, p in self.model.named_parameters():
            p.copy_(params[name])


class TailRows(ContinuousRollout):
    """Carry-over's rows in flight with the same tail: each row stays in the batch to its drawn length."""

    def hold(self, step: int, rows: torch.Tensor) -> torch.Tensor:
        return tail_lengths(rows, step, *_tail_shape())


class TailServer(RolloutServer):
    """The rollout worker's server with the tail engine (built in the worker process)."""

    continuous = TailRows

    def __init__(self, cfg_dict: dict[str, Any], vocab_size: int, build: Any):
        super().__init__(cfg_dict, vocab_size, build)
        inner = self.engine
        assert isinstance(inner, TorchEngine)
        self.engine = TailEngine(inner.model, **inner.sampling)


def _config(out: str, overrides: list[str]) -> Any:
    return load_config(ROOT / "configs" / "grpo_tiny.yaml", [f"trainer.output_dir={out}", *overrides])


def run(out: str, overrides: list[str]) -> dict[str, float]:
    """samples/s over the RL steps, the final weights' reward, the rollout reward of the last 10% of steps, lags."""
    cfg = _config(out, overrides)
    if cfg.deploy.mode == "disaggregated":
        records = train(cfg).records
    else:  # the synchronous run: the tail engine in the trainer's process, fed each version
        tok = source_tokenizer(cfg, task_options(cfg))
        rl = cfg.rl
        engine = TailEngine(
            build_model(cfg, tok.vocab_size).eval(),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            max_new_tokens=rl.max_new_tokens,
            temperature=rl.temperature,
            top_p=rl.top_p,
            top_k=rl.top_k,
        )
        records = train(cfg, engine=engine).records
    samples = len(records) * cfg.rl.batch_size * cfg.rl.n_samples
    k = max(1, len(records) // 10)
    return {
        "rate": samples / sum(r["step_time_s"] for r in records),
        "reward": records[-1]["val/reward"],
        "rollout_reward": sum(r["reward"] for r in records[-k:]) / k,
        "lag": statistics.mean(r["policy_lag"] for r in records),
        "token_lag": statistics.mean(r.get("token_lag", r["policy_lag"]) for r in records),
    }


def real(args: argparse.Namespace) -> None:
    os.environ[TAIL] = f"{args.median},{args.sigma},{args.cap}"
    longest = int(args.median * args.cap) + 16
    common = [
        f"trainer.steps={args.steps}",
        f"trainer.warmup_steps={args.warmup_steps}",
        f"model.model_name_or_path.max_position_embeddings={max(64, longest)}",
        "trainer.progress=false",
        "trainer.plot=false",
        "trainer.save_every=0",
    ]
    disagg = ["trainer.threads=1", "deploy.mode=disaggregated", "deploy.async_infer=true"]
    partial = [*disagg, f"deploy.staleness={args.partial_staleness}", "deploy.partial_rollouts=true"]
    every = {
        "sync": ("synchronous (blocking, 2 threads)", ["trainer.threads=2"]),
        **{f"async{s}": (f"async, staleness {s} (1+1 threads)", [*disagg, f"deploy.staleness={s}"]) for s in (1, 2, 4)},
        "partial": (f"async + partial rollouts, staleness {args.partial_staleness}", partial),
        "carry": (
            f"async + partial + carry-over, staleness {args.partial_staleness}",
            [*partial, "deploy.carry_over=true"],
        ),
    }
    chosen = args.variants.split(",")
    if "sync" not in chosen or any(v not in every for v in chosen):
        raise SystemExit(f"--variants: got {args.variants!r}, expected 'sync' and some of {list(every)}")
    variants = dict(every[v] for v in chosen)
    seeds = [int(x) for x in args.seeds.split(",")]
    sync = every["sync"][0]
    evaluation = [
        f"trainer.eval_every={args.steps}",
        f"data.val_size={args.val_size}",
        f"trainer.eval_samples={args.eval_samples}",
    ]
    WorkerDeployment.server = TailServer  # the worker builds the tail engine
    try:
        results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        with tempfile.TemporaryDirectory() as out:
            for seed in seeds:  # seeds outside, variants inside: a change in the machine's load spreads over all
                for i, (name, overrides) in enumerate(variants.items()):
                    r = run(f"{out}/{seed}-{i}", [*common, *evaluation, f"trainer.seed={seed}", *overrides])
                    results[name].append(r)
                    print(
                        f"seed {seed} {name:<46} {r['rate']:8.1f} samples/s   final reward {r['reward']:.3f}   "
                        f"rollout reward {r['rollout_reward']:.3f}",
                        flush=True,
                    )
    finally:
        WorkerDeployment.server = RolloutServer
    print(
        f"\nload average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {args.steps} RL steps; seeds {args.seeds}; "
        f"tail: median {args.median} tokens, sigma {args.sigma}, cap {args.cap}x; final reward: the final weights on "
        f"{args.val_size} held-out prompts x {args.eval_samples}; rollout reward: the last 10% of steps' rows"
    )
    print(f"mean +- standard deviation over {len(seeds)} seed(s); ratio and diffs per seed against its synchronous run")
    for name, rs in results.items():
        ratio = [r["rate"] / b["rate"] for r, b in zip(rs, results[sync])]
        diff = [r["reward"] - b["reward"] for r, b in zip(rs, results[sync])]
        rdiff = [r["rollout_reward"] - b["rollout_reward"] for r, b in zip(rs, results[sync])]
        print(
            f"{name:<46} {spread([r['rate'] for r in rs], '8.1f')} samples/s  ratio {spread(ratio, '.2f')}x  "
            f"final reward {spread([r['reward'] for r in rs], '.3f')} (diff {spread(diff, '+.3f')})  rollout reward "
            f"{spread([r['rollout_reward'] for r in rs], '.3f')} (diff {spread(rdiff, '+.3f')})  lag row "
            f"{statistics.mean(r['lag'] for r in rs):.2f} token {statistics.mean(r['token_lag'] for r in rs):.2f}"
        )


def spread(xs: list[float], fmt: str) -> str:
    """``mean +- sample standard deviation`` of ``xs`` (the mean alone for one value).

    >>> spread([1.0, 2.0, 3.0], ".2f")
    '2.00 +- 1.00'
    """
    mean = format(statistics.mean(xs), fmt)
    return mean if len(xs) < 2 else f"{mean} +- {format(statistics.stdev(xs), fmt.lstrip('+').lstrip('0123456789'))}"


def _graph(rollout_batch: int) -> StageGraph:
    def noop(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {}

    roll = stage(
        noop,
        inputs=["prompts"],
        outputs=["responses"],
        name="rollout",
        role="rollout",
        micro_batch=rollout_batch,
        resource="gen",
    )
    update = stage(noop, inputs=["responses"], outputs=["loss"], name="update", role="update", resource="train")
    return StageGraph([roll, update])


def simulated(args: argparse.Namespace) -> None:
    devices = args.sim_nodes * 8
    rows = args.sim_prompts * args.sim_samples
    concurrency = rows / devices  # rows each device decodes at once in the synchronous step
    g = torch.Generator().manual_seed(0)

    def lengths(n: int) -> torch.Tensor:
        z = torch.randn(n, generator=g, dtype=torch.float64)
        return (args.sim_median * torch.exp(args.sigma * z)).clamp(max=args.cap * args.sim_median)

    # Synchronous: generation on every device until the batch's longest row, then training on every device,
    # which takes --sim-train-share of the step (on average).
    gen = [float(lengths(rows).max()) for _ in range(args.sim_iterations)]
    train_all = statistics.mean(gen) * args.sim_train_share / (1 - args.sim_train_share)
    sync = sum(gen) + train_all * args.sim_iterations

    def schedule(partial: bool, gen_nodes: int) -> float:
        gen_devices = gen_nodes * 8
        train = train_all * devices / (devices - gen_devices)  # the same work on fewer devices

        def cost(s: Any, n: int) -> float:
            if s.name == "update":
                return train
            lens = lengths(n)
            return float(lens.sum()) / concurrency if partial else float(lens.max())

        return simulate(
            _graph(math.ceil(rows / gen_devices)),
            cost,
            num_prompts=rows,
            num_iterations=args.sim_iterations,
            staleness=args.sim_staleness,
            slots={"gen": gen_devices, "train": 1},
        ).makespan

    print(
        f"\nsimulated at AReaL's scale: {args.sim_nodes} nodes x 8 devices, {args.sim_prompts} prompts x "
        f"{args.sim_samples} answers, lengths median {args.sim_median:g} tokens (sigma {args.sigma}, cap {args.cap}x), "
        f"staleness {args.sim_staleness}; assumed: training is {args.sim_train_share:.0%} of the synchronous step"
    )
    print(f"{'synchronous':<46} {sync:14.0f} decode steps")
    for name, partial in (("async", False), ("async + partial rollouts", True)):
        # AReaL balances generation and training devices: the best split by whole nodes.
        makespan, nodes = min((schedule(partial, n), n) for n in range(1, args.sim_nodes))
        print(
            f"{name + f' ({nodes} of {args.sim_nodes} nodes generate)':<46} {makespan:14.0f} decode steps  "
            f"ratio {sync / makespan:5.2f}x  (AReaL reports {AREAL_SPEEDUP}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--median", type=float, default=8.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--cap", type=float, default=20.0)
    parser.add_argument("--partial-staleness", type=int, default=2)
    parser.add_argument("--variants", default="sync,async1,async2,async4,partial,carry")
    parser.add_argument("--seeds", default="0,1,2", help="trainer.seed of each run, comma-separated")
    parser.add_argument("--val-size", type=int, default=512, help="held-out prompts scoring the final weights")
    parser.add_argument("--eval-samples", type=int, default=8, help="answers per held-out prompt")
    parser.add_argument("--sim-only", action="store_true")
    parser.add_argument("--sim-nodes", type=int, default=16)
    parser.add_argument("--sim-prompts", type=int, default=512)
    parser.add_argument("--sim-samples", type=int, default=16)
    parser.add_argument("--sim-median", type=float, default=2000.0)
    parser.add_argument("--sim-train-share", type=float, default=0.3)
    parser.add_argument("--sim-staleness", type=int, default=8)
    parser.add_argument("--sim-iterations", type=int, default=20)
    args = parser.parse_args()
    if not args.sim_only:
        real(args)
    simulated(args)


if __name__ == "__main__":
    main()
