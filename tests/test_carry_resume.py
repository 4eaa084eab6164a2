"""deploy.carry_over across a checkpoint and a replaced worker: the rows in flight are redone, none trained twice."""

from __future__ import annotations

import dataclasses
import multiprocessing
import types
from pathlib import Path

import pytest
import torch

from rlcore.dataflow import HandBack, StageGraph, run_pipeline, stage
from rlcore.train import carry as carry_module
from rlcore.train import left_pad, load_checkpoint, load_config, train
from rlcore.train.carry import CarryBook, ContinuousRollout, carried
from tiny_runs import TINY, tiny_lm

EOF_ID, PAD, VOCAB, SEED, NEW, N, STALENESS = 1, 0, 12, 3, 8, 2, 2
PROMPTS = {s: [[2 + (s + k) % 9, 3 + k] for k in range(3)] for s in range(16)}
ROOT = Path(__file__).resolve().parents[1]
# The smallest carried run: 2 prompts x 2 samples a rank, one update a step, no warm-up.
SHORT = ["rl.batch_size=2", "rl.mini_batch_size=2", "rl.num_rollouts=2", "trainer.warmup_steps=0"]


class Held(ContinuousRollout):
    """Rows stay in the batch to a length keyed by (step, row): a few far longer than the rest (carried)."""

    def hold(self, step, rows):
        return torch.tensor([30 if (step + r) % 5 == 0 else 2 for r in rows.tolist()])


def pool():
    model = tiny_lm(torch.float32, 0, VOCAB)
    return Held(model, seed=SEED, eos_token_id=EOF_ID, pad_token_id=PAD, max_new_tokens=NEW, temperature=1.0)


class Source:
    """Three prompts a step, each N times; ``answers`` names the row's prompt, so it must follow the row."""

    columns = ("prompts", "prompt_mask", "answers", "group", "iteration", "row")
    tokenizer, batch_size = types.SimpleNamespace(pad_token_id=PAD), 3

    def loader(self, rank, start, n):
        def load(i):
            step = start + i
            ids, mask = left_pad(PROMPTS[step], PAD)
            rows = len(PROMPTS[step]) * n
            group = torch.arange(len(PROMPTS[step])).repeat_interleave(n)
            return {
                "prompts": ids.repeat_interleave(n, 0),
                "prompt_mask": mask.repeat_interleave(n, 0),
                "answers": [torch.tensor([step, g]) for g in group.tolist()],
                "group": group,
                "iteration": torch.full((rows,), step),
                "row": torch.arange(rows),
            }

        return load


def run(worker, *, start, iterations, book, save_at=None):
    """A carried pipeline from step ``start``: the trained rows (key -> tokens), the book's state after ``save_at``."""
    version = types.SimpleNamespace(v=0)
    proxy = stage(
        lambda b: worker(b, version.v),
        inputs=["prompts"],
        outputs=["x"],
        name="rollout",
        role="rollout",
        resource="gen",
    )
    roll, source = carried(proxy, Source(), rank=0, start=start, n=N, staleness=STALENESS, book=book)
    saved = {}

    def update(b):
        version.v += 1
        return {"loss": torch.zeros(b["mask"].shape[0])}

    def end(i):
        if start + i == save_at:  # as a checkpoint at this step's end takes it
            saved.update(book.checkpoint_state(start + i))

    up = stage(
        update,
        inputs=["mask", "answers"],
        outputs=["loss"],
        name="update",
        role="update",
        resource="train",
        on_iteration_end=end,
    )
    collect = ["prompt_step", "row", "token_version", "responses", "mask", "answers"]
    result = run_pipeline(
        StageGraph([roll, up], sources=source.columns),
        source.loader(0, start, N),
        num_prompts=3,
        n_samples=N,
        num_iterations=iterations,
        staleness=STALENESS,
        collect=collect,
    )
    trained = {}
    for i, b in enumerate(result.batches):
        on = b["mask"] == 1
        assert bool(((i - b["token_version"])[on] <= STALENESS).all())  # the per-token bound
        for k, (s, r) in enumerate(zip(b["prompt_step"].tolist(), b["row"].tolist())):
            assert (s, r) not in trained
            assert b["answers"][k].tolist() == [s, r // N]  # the row's columns came with it
            trained[s, r] = (start + i, b["responses"][k][on[k]].tolist())
    return trained, saved


def keys_of(steps):
    return {(s, r) for s in steps for r in range(3 * N)}


def test_a_resumed_run_redoes_the_rows_the_checkpoint_had_not_trained_and_no_other():
    first = pool()
    book = CarryBook()
    before, state = run(lambda b, v: first(b, lambda: None, v), start=0, iterations=6, book=book, save_at=2)
    assert state["ranks"] == 1 and state["frontier"] >= 3 + STALENESS - 1
    untrained = {tuple(k) for k in state["rows"].tolist()}
    kept = {k for k, (i, _) in before.items() if i <= 2}  # what the checkpoint's run had trained
    assert untrained == keys_of(range(state["frontier"])) - kept  # in flight or handed over past the save
    # A new process: a fresh worker, the book from the checkpoint's state.
    second, resumed = pool(), CarryBook(ranks=1)
    resumed.restore_state(state)
    after, _ = run(lambda b, v: second(b, lambda: None, v), start=3, iterations=5, book=resumed)
    assert not set(after) & kept  # nothing trained twice
    in_flight = {tuple(k) for k in resumed.checkpoint_state(7)["rows"].tolist()}
    assert untrained <= set(after) | in_flight and not set(after) & in_flight  # nothing lost
    assert keys_of(range(resumed.frontier)) == kept | set(after) | in_flight
    assert resumed.resent == len(untrained)
    for key in set(after) & set(before):  # redone from the first token: the same streams, the same weights here
        assert after[key][1] == before[key][1], key


def test_a_resumed_book_at_another_data_parallel_size_is_refused():
    state = CarryBook(frontier=5, ranks=2).checkpoint_state(0)
    book = CarryBook(ranks=1)
    with pytest.raises(
        ValueError, match="resume: the checkpoint's carried rows .* saved at data-parallel size 2, got 1"
    ):
        book.restore_state(state)
    assert book.frontier == 0 and book.redo == []  # unchanged


def test_a_replaced_worker_is_sent_every_row_it_held_again():
    workers = [pool()]

    def worker(b, v):
        if int(b["iteration"].numel()) and len(workers) == 1 and int(b["iteration"][0]) >= 3:
            workers.append(pool())  # the worker died with its rows in flight: the replacement starts empty
            raise HandBack("rollout", "the worker process exited with code -9")
        return workers[-1](b, lambda: None, v)

    book = CarryBook()
    trained, _ = run(worker, start=0, iterations=6, book=book)
    assert len(workers) == 2 and book.resent > 0
    in_flight = {tuple(k) for k in book.checkpoint_state(5)["rows"].tolist()}
    assert keys_of(range(book.frontier)) == set(trained) | in_flight and not set(trained) & in_flight


class KillsTheWorkerOnce:
    """A rule reward that kills the rollout worker process (this process's only child) at its first call."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, responses, **columns):
        self.calls += 1
        if self.calls == 1:
            for child in multiprocessing.active_children():
                child.kill()
                child.join()
        return [len(r) / 6 for r in responses]


def test_a_carry_over_run_with_a_killed_worker_then_resumed_trains_every_row_once(tmp_path, monkeypatch):
    """The trainer: a dead worker replaced mid-run, then a resume from the last checkpoint; rows keyed (step, row)."""
    trained: list[tuple[int, int, int]] = []  # (pipeline step, prompt step, row) of each call's rows

    def recording(rollout, task, **kw):
        roll, source = carried(rollout, task, **kw)

        def call(b):
            out = roll.fn(b)
            step = int(b["iteration"][0])
            trained.extend((step, s, r) for s, r in zip(out["prompt_step"].tolist(), out["row"].tolist()))
            return out

        return dataclasses.replace(roll, fn=call), source

    monkeypatch.setattr(carry_module, "carried", recording)
    extra = ["deploy.mode=disaggregated", "deploy.async_infer=true", "deploy.staleness=2"]
    extra += ["deploy.partial_rollouts=true", "deploy.carry_over=true", "trainer.max_worker_restarts=1"]
    extra += ["trainer.export=false", f"trainer.output_dir={tmp_path}", *SHORT]
    # Killed at step 0's reward; iteration 3's rollout (staleness 2: version 1 at least) comes after it.
    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", [*TINY, "trainer.steps=4", *extra])
    with pytest.warns(RuntimeWarning, match="restarting it"):
        first = train(cfg, reward=KillsTheWorkerOnce())
    assert [r["worker_restarts"] for r in first.records][-1] == 1.0
    state = load_checkpoint(tmp_path)["extras"]["carry"]
    untrained = {tuple(k) for k in state["rows"].tolist()}
    a = {(s, r) for _, s, r in trained}
    assert len(a) == len(trained)  # none trained twice in the run with the restart
    rows = 2 * 2  # rl.batch_size x rl.num_rollouts
    assert {(s, r) for s in range(state["frontier"]) for r in range(rows)} == a | untrained and not a & untrained
    trained.clear()
    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", [*TINY, "trainer.steps=5", *extra])
    second = train(
        cfg, resume=True, allow_config_change=True, reward=lambda prompts, responses, **c: [0.5] * len(responses)
    )
    assert [r["step"] for r in second.records] == [4]
    b = {(s, r) for _, s, r in trained}
    assert len(b) == len(trained) and not a & b  # nothing trained twice across the save and resume
    assert untrained & b  # the rows in flight at the save were redone and trained
    end = {tuple(k) for k in load_checkpoint(tmp_path)["extras"]["carry"]["rows"].tolist()}
    assert untrained <= b | end  # nothing lost
