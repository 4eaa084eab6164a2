"""deploy.carry_over at 2 gloo ranks: each rank's worker carries its own rows; every row trained once, within the bound;
a resume gives each rank its own rows in flight back (the checkpoint holds them per rank)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_helpers import leave, spawn
from rlcore.train import carry as carry_module
from rlcore.train import load_config, train
from tiny_runs import QUIET, TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
STEPS, STALENESS, PROMPTS, SAMPLES = 4, 2, 2, 2
CARRY_RANKS = [
    *TINY_MODEL,
    *QUIET,
    "parallel.data_parallel=2",
    f"rl.batch_size={PROMPTS}",
    f"rl.mini_batch_size={PROMPTS}",
    f"rl.num_rollouts={SAMPLES}",
    "rl.max_new_tokens=6",
    "trainer.warmup_steps=0",
    "trainer.export=false",
    "deploy.mode=disaggregated",
    "deploy.async_infer=true",
    f"deploy.staleness={STALENESS}",
    "deploy.partial_rollouts=true",
    "deploy.carry_over=true",
    f"trainer.steps={STEPS}",
]


def length_reward(prompts, responses, **columns):
    return [len(r) / 6 for r in responses]


def _ranks(rank: int, init_file: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    keys: list[tuple[int, int, int]] = []  # (pipeline step, prompt step, row) of the rows each call hands over
    books = []  # each run's carry book, as the trainer gave it to carried()
    redo: list[tuple[int, int]] = []  # the rows the resumed run's book was given back by the checkpoint
    carried = carry_module.carried

    def recording(rollout, task, **kw):
        books.append(kw["book"])
        redo.extend(kw["book"].redo)
        roll, source = carried(rollout, task, **kw)

        def call(b):
            out = roll.fn(b)
            step = int(b["iteration"][0])
            keys.extend((step, s, r) for s, r in zip(out["prompt_step"].tolist(), out["row"].tolist()))
            return out

        return dataclasses.replace(roll, fn=call), source

    carry_module.carried = recording
    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", [*CARRY_RANKS, f"trainer.output_dir={tmp}/run"])
    run = train(cfg, reward=length_reward)
    # What the last step's checkpoint saved of this rank's book (no call since: the same again).
    untrained = sorted(tuple(k) for k in books[0].checkpoint_state(STEPS - 1)["rows"].tolist())
    first = list(keys)
    keys.clear()
    cfg = load_config(
        ROOT / "configs" / "grpo_tiny.yaml",
        [*CARRY_RANKS, f"trainer.steps={STEPS + 1}", f"trainer.output_dir={tmp}/run"],
    )
    train(cfg, resume=True, reward=length_reward)
    torch.save((run.records, first, untrained, sorted(redo), keys), Path(tmp) / f"rank{rank}.pt")
    leave()


def test_carry_over_at_two_ranks(tmp_path):
    spawn(_ranks, (str(tmp_path / "init"), str(tmp_path)), 2, timeout=300)
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    (a, keys0, *_), (b, keys1, *_) = saved
    assert [r["step"] for r in a] == list(range(STEPS)) == [r["step"] for r in b]
    for x, y in zip(a, b):  # the metrics are the whole batch's on every rank
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-7), x["step"]
        assert x["token_lag_max"] == y["token_lag_max"], x["step"]
    assert all(0 <= r["token_lag"] <= r["token_lag_max"] <= STALENESS for r in a)  # the per-token bound
    rows = PROMPTS * SAMPLES
    for rank, keys in ((0, keys0), (1, keys1)):
        assert len(keys) == STEPS * rows  # every slot filled by one call's rows
        assert all(rank * rows <= r < (rank + 1) * rows for _, _, r in keys)  # a rank trains its own rows
    trained = [(s, r) for _, s, r in keys0 + keys1]
    assert len(set(trained)) == len(trained)  # every row trained once
    # The resume: each rank was given back exactly its own rows in flight at the save, and trains them at most once.
    resumed = []
    for rank, (_, first, untrained, redo, after) in enumerate(saved):
        assert redo == untrained and redo  # its own, whole (rows were in flight at the save)
        assert all(rank * rows <= r < (rank + 1) * rows for _, r in redo)
        assert all(rank * rows <= r < (rank + 1) * rows for _, _, r in after)
        assert not {(s, r) for _, s, r in first} & set(redo)
        resumed += [(s, r) for _, s, r in after]
    assert len(resumed) == 2 * rows and not set(resumed) & set(trained)  # one step, none trained twice
