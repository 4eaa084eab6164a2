"""Concurrent vs one-after-another tool execution in the multi-turn rollout: trajectories per second.

Run: python benchmarks/bench_agent.py [--trajectories 32] [--turns 3] [--repeats 5]

Each trajectory of a tiny random-init causal LM runs ``--turns`` policy turns of up to 8
tokens; every turn but the last calls a tool that takes 50 ms (``time.sleep``, a sync
tool run in a worker thread, like an HTTP or sandbox call). The environment is a
:class:`rlcore.agent.ToolEnv`; since a random model writes no tool calls, the
environment issues the call on the policy's behalf (the work measured, tool execution
overlapping decoding and other tools, is the same).

* rlcore: :func:`rlcore.agent.multi_turn_rollout` with a :class:`rlcore.agent.StepRunner`
  of ``--trajectories`` workers: each row's tool call starts the moment its turn ends,
  while the other rows keep decoding and the other tools run.
* baseline: the same rollout with ``StepRunner(max_concurrency=1)``: the tools run one
  after another (the decoding is identical).

Prints medians of trajectories per second and the ratio (target >= 3x).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from _timing import median_time, report
from rlcore.agent import StepRunner, Tool, ToolEnv, multi_turn_rollout

TOOL_SECONDS = 0.05


def slow_lookup(key: str) -> str:
    time.sleep(TOOL_SECONDS)
    return key


class CallingEnv(ToolEnv):
    """Calls ``slow_lookup`` on every turn but the last, then scores the episode 1."""

    def __init__(self, turns: int):
        super().__init__([Tool("slow_lookup", slow_lookup)], reward=lambda sample, text: 1.0)
        self.turns, self.turn = turns, 0

    async def step(self, action: str):
        self.turn += 1
        if self.turn < self.turns:
            action = '<tool_call>{"name": "slow_lookup", "arguments": {"key": "k"}}</tool_call>'
        else:
            action = "done"
        return await super().step(action)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "qwen2",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompts = [[2 + i % 20, 3, 4] for i in range(args.trajectories)]

    def run(runner: StepRunner) -> dict[str, torch.Tensor]:
        return multi_turn_rollout(
            model,
            prompts,
            [CallingEnv(args.turns) for _ in prompts],
            decode=lambda ids: "",
            encode_observation=lambda text: [5, 6, 7],
            eos_token_id=1,
            pad_token_id=0,
            max_turns=args.turns,
            max_new_tokens=8,
            max_total_tokens=64,
            generator=torch.Generator().manual_seed(0),
            runner=runner,
        )

    with StepRunner(max_concurrency=args.trajectories) as concurrent, StepRunner(max_concurrency=1) as sequential:
        check = run(concurrent)
        calls = int(check["num_tool_calls"].sum())
        assert calls == args.trajectories * (args.turns - 1), calls
        print(
            f"load average {os.getloadavg()[0]:.2f}; {args.trajectories} trajectories x {args.turns} turns, "
            f"{calls} tool calls of {TOOL_SECONDS * 1e3:.0f} ms per rollout",
            flush=True,
        )
        ours = median_time(lambda: run(concurrent), repeats=args.repeats)
        base = median_time(lambda: run(sequential), repeats=args.repeats)
    print(
        f"concurrent tools:    {args.trajectories / ours:8.1f} trajectories/s (median {ours * 1e3:.0f} ms per rollout)"
    )
    print(
        f"one after another:   {args.trajectories / base:8.1f} trajectories/s (median {base * 1e3:.0f} ms per rollout)"
    )
    report("multi-turn rollout, 50 ms tools: concurrent vs sequential", ours, base, target=3.0)


if __name__ == "__main__":
    main()
