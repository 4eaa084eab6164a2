"""Async pipeline vs the synchronous loop: a small GRPO workload on a tiny random-init causal LM.

Run: python benchmarks/bench_pipeline.py [--iterations 16] [--repeats 5]

Per iteration: 8 prompts x 4 samples, 64 sampled tokens each (rlcore.train.rollout's
KV-cached sampler, which also returns the behaviour log-probs), a rule reward,
group-normalised GRPO advantages, and a PPO-clip update over micro-batches of 8 rows
(one AdamW step per iteration; GRPO without the KL term).

* synchronous: one process generates the whole batch, then computes rewards,
  advantages and the update -- the loop of verl / TRL / OpenRLHF without overlap --
  with ``torch.set_num_threads(2)`` (both cores, as specified) and, as a control, with
  1 thread: for a model this small two intra-op threads can be slower than one, and a
  ratio against them alone would flatter the pipeline. The headline ratio is against
  the faster of the two. ``OMP_WAIT_POLICY=PASSIVE`` (unless set) keeps OpenMP threads
  from spin-waiting, which on a machine shared with other jobs slows the 2-thread loop
  by up to 10x.
* pipeline: disaggregated; a :class:`rlcore.dataflow.RolloutWorker` process generates
  (1 thread), this process trains (1 thread); staleness 1, so iteration ``j + 1`` is
  generated while iteration ``j`` trains; weights go to the worker after every step.

Prints the load average, per repeat and as medians the rows/s of each, the ratios
(target >= 1.4x) and the mean policy lag of the pipeline's rows; then, labelled as a
simulation, what :func:`rlcore.dataflow.simulate` predicts for both layouts on two idle
cores from stage costs fitted to a synchronous run (the machine this runs on is shared,
and the measured pipeline needs two free cores). Each timed run covers the whole pipeline,
fill and drain included; the worker's start-up (process spawn, model build) is not
timed, the trainer side is warmed by one synchronous iteration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

# OpenMP threads that spin-wait steal the cores they wait for when other processes run:
# waiting passively keeps the 2-thread baseline from collapsing on a busy machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from rlcore.algos import grpo
from rlcore.dataflow import RolloutWorker, StageGraph, fit_costs, run_pipeline, simulate, stage
from rlcore.models import from_hf, load_causal_lm, token_logprobs
from rlcore.train.rollout import generate

CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN, MICRO_BATCH = 8, 4, 8, 64, 8
ROWS = PROMPTS * SAMPLES
# The sampler's per-step cost hardly grows with the rows, so the worker generates a whole batch per call.
ROLLOUT_MICRO_BATCH = ROWS
TARGET = 7  # reward: the share of response tokens equal to this id
ALGO = grpo(kl_coef=0.0)


def load_prompts(j: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(j)
    prompts = torch.randint(1, CONFIG["vocab_size"], (PROMPTS, PROMPT_LEN), generator=g)
    return {
        "prompts": prompts.repeat_interleave(SAMPLES, 0),
        "group_ids": torch.arange(PROMPTS).repeat_interleave(SAMPLES),
    }


def sample(model: torch.nn.Module, prompts: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Responses and their behaviour log-probs; eos -1 never matches, so every response has RESPONSE_LEN tokens."""
    with torch.no_grad():
        r = generate(
            model, prompts, torch.ones_like(prompts), eos_token_id=-1, max_new_tokens=RESPONSE_LEN, generator=generator
        )
    return {"responses": r.responses, "old_logp": r.logp}


def make_rollout() -> callable:
    """Runs in the rollout worker: the same architecture, loaded with each published version."""
    model = load_causal_lm(CONFIG, seed=0).eval()
    generator = torch.Generator().manual_seed(1)
    loaded = {"params": None}

    def rollout(batch: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if params is not loaded["params"]:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(params[name])
            loaded["params"] = params
        return sample(model, batch["prompts"], generator)

    return rollout


class Trainer:
    """The trainer's stages: reward, GRPO advantages, PPO-clip update with one AdamW step per iteration."""

    def __init__(self) -> None:
        self.model = load_causal_lm(CONFIG, seed=0)
        self.apply, self.params = from_hf(self.model)
        self.opt = torch.optim.AdamW(self.params.values(), lr=1e-3)

    @staticmethod
    def reward(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"scores": (batch["responses"] == TARGET).float().mean(1)}

    @staticmethod
    def advantages(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mask = torch.ones(batch["scores"].shape[0], RESPONSE_LEN)
        groups = torch.unique(batch["group_ids"], return_inverse=True)[1]  # numbered 0.. within the micro-batch
        return {
            "advantages": ALGO.advantages({"scores": batch["scores"], "group_ids": groups, "mask": mask})["advantages"]
        }

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seq = torch.cat([batch["prompts"], batch["responses"]], 1)
        logp = token_logprobs(self.apply, self.params, {"input_ids": seq, "attention_mask": torch.ones_like(seq)})
        mb = {
            "logp": logp[:, PROMPT_LEN:],
            "old_logp": batch["old_logp"],
            "advantages": batch["advantages"],
            "mask": torch.ones_like(batch["old_logp"]),
        }
        loss, _ = ALGO.loss(mb, num_seqs=ROWS)
        loss.backward()
        return {"loss": loss.detach().expand(seq.shape[0]).clone()}

    def step(self, iteration: int) -> None:
        self.opt.step()
        self.opt.zero_grad()


def synchronous(iterations: int, *, threads: int) -> float:
    """The synchronous loop with ``threads`` intra-op threads; returns seconds."""
    torch.set_num_threads(threads)
    trainer = Trainer()
    generator = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for j in range(iterations):
        batch = load_prompts(j)
        trainer.model.eval()
        batch.update(sample(trainer.model, batch["prompts"], generator))
        batch.update(trainer.reward(batch))
        batch.update(trainer.advantages(batch))
        for a in range(0, ROWS, MICRO_BATCH):
            trainer.update({k: v[a : a + MICRO_BATCH] for k, v in batch.items()})
        trainer.step(j)
    return time.perf_counter() - start


def trainer_stages(trainer: Trainer, step: Callable[[int], None], *, resource: str) -> list:
    """Reward, advantages (whole groups) and the update, streaming micro-batches."""
    return [
        stage(
            trainer.reward,
            inputs=["responses"],
            outputs=["scores"],
            name="reward",
            micro_batch=MICRO_BATCH,
            resource=resource,
        ),
        stage(
            trainer.advantages,
            inputs=["scores", "group_ids"],
            outputs=["advantages"],
            name="advantages",
            micro_batch=MICRO_BATCH,
            by_group=True,
            resource=resource,
        ),
        stage(
            trainer.update,
            inputs=["prompts", "responses", "old_logp", "advantages"],
            outputs=["loss"],
            name="update",
            role="update",
            micro_batch=MICRO_BATCH,
            resource=resource,
            on_iteration_end=step,
        ),
    ]


def pipelined(iterations: int) -> tuple[float, float]:
    """The disaggregated pipeline, one thread per side, staleness 1; returns (seconds, mean policy lag)."""
    torch.set_num_threads(1)
    trainer = Trainer()
    with RolloutWorker(make_rollout, threads=1) as worker:
        worker.wait_ready()
        worker.publish(0, trainer.params)

        def step(j: int) -> None:
            trainer.step(j)
            worker.publish(j + 1, trainer.params)

        graph = StageGraph(
            [
                worker.stage(
                    inputs=["prompts"],
                    outputs=["responses", "old_logp"],
                    micro_batch=ROLLOUT_MICRO_BATCH,
                    resource="rollout",
                ),
                *trainer_stages(trainer, step, resource="train"),
            ],
            sources=["prompts", "group_ids"],
        )
        start = time.perf_counter()
        res = run_pipeline(
            graph, load_prompts, num_prompts=PROMPTS, n_samples=SAMPLES, num_iterations=iterations, staleness=1
        )
        seconds = time.perf_counter() - start
    lag = torch.cat([j - b["policy_version"] for j, b in enumerate(res.batches)]).double().mean().item()
    return seconds, lag


def projected(iterations: int) -> tuple[float, float]:
    """Simulated seconds (synchronous, pipeline) on two otherwise idle cores, from stage costs measured here.

    The synchronous loop runs as a blocking one-thread pipeline (the same calls, timed per
    stage); :func:`rlcore.dataflow.fit_costs` turns its calls into a cost model that
    :func:`rlcore.dataflow.simulate` replays for both layouts. Process and IPC overheads
    of the real pipeline are not in the model.
    """
    torch.set_num_threads(1)
    trainer = Trainer()
    generator = torch.Generator().manual_seed(1)

    def rollout(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return sample(trainer.model.eval(), batch["prompts"], generator)

    def roll(resource: str):
        return stage(
            rollout,
            inputs=["prompts"],
            outputs=["responses", "old_logp"],
            role="rollout",
            micro_batch=ROLLOUT_MICRO_BATCH,
            resource=resource,
        )

    one = StageGraph(
        [roll("device"), *trainer_stages(trainer, trainer.step, resource="device")], sources=["prompts", "group_ids"]
    )
    two = StageGraph(
        [roll("rollout"), *trainer_stages(trainer, trainer.step, resource="train")], sources=["prompts", "group_ids"]
    )
    kw = dict(num_prompts=PROMPTS, n_samples=SAMPLES, num_iterations=iterations)
    cost = fit_costs(run_pipeline(one, load_prompts, blocking=True, **kw).tasks)
    return simulate(one, cost, blocking=True, **kw).makespan, simulate(two, cost, staleness=1, **kw).makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = args.iterations * ROWS
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores", flush=True)
    synchronous(1, threads=2)  # warm the trainer-side code paths
    rates: dict[str, list[float]] = {"sync2": [], "sync1": [], "pipe": []}
    lags = []
    for r in range(args.repeats):
        sync2 = synchronous(args.iterations, threads=2)
        sync1 = synchronous(args.iterations, threads=1)
        pipe, lag = pipelined(args.iterations)
        for key, seconds in (("sync2", sync2), ("sync1", sync1), ("pipe", pipe)):
            rates[key].append(rows / seconds)
        lags.append(lag)
        print(
            f"repeat {r}: synchronous 2 threads {rows / sync2:7.1f} rows/s ({sync2:.2f} s)   1 thread {rows / sync1:7.1f} "
            f"rows/s ({sync1:.2f} s)   pipeline {rows / pipe:7.1f} rows/s ({pipe:.2f} s)   mean policy lag {lag:.3f}",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in rates.items()}
    best = max(med["sync2"], med["sync1"])
    print(f"median over {args.repeats} repeats, {args.iterations} iterations x {ROWS} rows each:")
    print(
        f"  synchronous loop, 2 threads         {med['sync2']:7.1f} rows/s   (ratio {med['pipe'] / med['sync2']:.2f}x)"
    )
    print(
        f"  synchronous loop, 1 thread          {med['sync1']:7.1f} rows/s   (ratio {med['pipe'] / med['sync1']:.2f}x)"
    )
    print(f"  disaggregated pipeline (1+1, k=1)   {med['pipe']:7.1f} rows/s")
    ratio = med["pipe"] / best
    print(
        f"  ratio vs the faster synchronous loop {ratio:.2f}x (target >= 1.4x: {'met' if ratio >= 1.4 else 'NOT met'})   "
        f"mean policy lag {statistics.median(lags):.3f} iterations"
    )
    sim_sync, sim_pipe = projected(args.iterations)
    print(
        f"  simulated, not measured (stage costs fitted to a 1-thread synchronous run, no IPC):  synchronous "
        f"{rows / sim_sync:7.1f} rows/s   pipeline {rows / sim_pipe:7.1f} rows/s   ratio {sim_sync / sim_pipe:.2f}x"
    )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
