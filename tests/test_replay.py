"""The replay buffer: its slot rules (pure, against a loop reference), and the replay stage's mixing and weights."""

from __future__ import annotations

import dataclasses
import doctest
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlcore.algos.replay
from rlcore.algos import replay_init, replay_insert, replay_serve
from rlcore.testing import assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.train import Replay, load_config, parse_replay, train
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]


def test_doctests():
    result = doctest.testmod(rlcore.algos.replay, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0


_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.lists(st.tuples(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0, float("nan")]), st.booleans()), max_size=6),
        ),
        st.tuples(st.just("serve"), st.integers(0, 5)),
    ),
    max_size=8,
)


@settings(max_examples=25, deadline=None)
@given(capacity=st.integers(1, 5), max_reuse=st.integers(1, 3), ops=_OPS, dtype=st.sampled_from(["f32", "bf16"]))
def test_replay_matches_reference_and_never_serves_a_row_past_max_reuse(capacity, max_reuse, ops, dtype):
    torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
    state, ids = replay_init(capacity), [-1] * capacity
    loop = ref.ReplayBufferRef(capacity, max_reuse)
    served_count: dict[int, int] = {}
    next_id = 0
    for op, arg in ops:
        if op == "insert":
            offered = [(p, keep, next_id + j) for j, (p, keep) in enumerate(arg)]
            next_id += len(arg)
            pr = torch.tensor([p for p, _, _ in offered], dtype=torch_dtype)
            keep = torch.tensor([k for _, k, _ in offered], dtype=torch.bool)
            state, source = replay_insert(state, pr, keep)
            pool = ids + [i for _, _, i in offered]
            ids = [pool[s] if s >= 0 else -1 for s in source.tolist()]
            loop.insert([(float(torch.tensor(p, dtype=torch_dtype)), k, i) for p, k, i in offered])
        else:
            state, slots, valid = replay_serve(state, arg, max_reuse=max_reuse)
            got = [ids[s] for s in slots[valid].tolist()]
            assert got == loop.serve(arg)
            assert slots.shape == (arg,) and bool((slots[~valid] == -1).all())
            for i in got:
                served_count[i] = served_count.get(i, 0) + 1
            ids = [i if f else -1 for i, f in zip(ids, state.filled.tolist())]
        assert all(c <= max_reuse for c in served_count.values())  # the reduction: never past max_reuse
        assert bool((state.uses < max_reuse).all()) and int(state.filled.sum()) <= capacity
        stored = sorted((i, u) for i, u, f in zip(ids, state.uses.tolist(), state.filled.tolist()) if f)
        assert stored == sorted((i, u) for _, u, i in loop.rows)


def test_replay_keeps_the_highest_priorities_and_bad_input():
    state, _ = replay_insert(replay_init(2), torch.tensor([1.0, 3.0]), torch.tensor([True, True]))
    state, source = replay_insert(state, torch.tensor([2.0, 0.5]), torch.tensor([True, True]))
    assert source.tolist() == [0, 2] and state.priority.tolist() == [3.0, 2.0]
    state, slots, valid = replay_serve(state, 3, max_reuse=2)
    assert slots.tolist() == [0, 1, -1] and valid.tolist() == [True, True, False]
    assert state.uses.tolist() == [1, 1]
    assert_no_host_sync(lambda s: replay_serve(s, 2, max_reuse=2), state)
    assert_no_host_sync(lambda s, p, k: replay_insert(s, p, k), state, torch.tensor([5.0]), torch.tensor([True]))
    with pytest.raises(ValueError, match="capacity: got 0"):
        replay_init(0)
    with pytest.raises(ValueError, match="max_reuse: got 0"):
        replay_serve(state, 1, max_reuse=0)
    with pytest.raises(ValueError, match="keep"):
        replay_insert(state, torch.tensor([1.0]), torch.tensor([True, False]))


# ------------------------------------------------------------------ the update's transforms


def _rows(n, width, adv, step):
    return {
        "prompts": torch.ones(n, 3, dtype=torch.long),
        "prompt_mask": torch.ones(n, 3, dtype=torch.long),
        "responses": torch.full((n, width), step, dtype=torch.long),
        "mask": torch.ones(n, width),
        "loss_mask": torch.ones(n, width),
        "advantages": torch.tensor(adv, dtype=torch.float32)[:, None].expand(n, width).clone(),
        "rollout_logp": torch.full((n, width), -1.0),
        "iteration": torch.full((n,), step),
        "scores": torch.tensor(adv).clamp(min=0),
    }


def test_replay_mixes_stored_rows_weights_them_and_logs_the_fresh_only():
    replay = Replay(parse_replay({"capacity": 4, "fraction": 0.5, "max_reuse": 1, "cap": 2.0}))
    rows, metrics = replay.dispatch(_rows(4, 2, [1.0, -1.0, 2.0, 0.0], step=0))
    assert rows["responses"].shape[0] == 4 and float(metrics["replay/served"]) == 0  # nothing stored yet
    assert float(metrics["replay/stored"]) == 2  # the positive advantages
    rows, metrics = replay.dispatch(_rows(4, 3, [0.5, 0.5, -1.0, -1.0], step=1))
    assert float(metrics["replay/served"]) == 2 and rows["responses"].shape == (6, 3)
    assert rows["replayed"].tolist() == [0, 0, 0, 0, 1, 1]
    assert rows["responses"][4:].tolist() == [[0, 0, 0], [0, 0, 0]]  # step 0's rows, zero-padded on the right
    assert float(rows["advantages"][4, 0]) == 2.0  # the highest advantage first
    # Each stored row is served once (max_reuse 1): the next update gets step 1's rows only.
    again, metrics = replay.dispatch(_rows(2, 3, [0.0, 0.0], step=2))
    assert float(metrics["replay/served"]) == 1 and again["iteration"].tolist() == [2, 2, 1]

    def forward(b):  # the current policy's log-probs: 0 (the rows were sampled at -1: ratio e, capped at 2)
        n, w = b["responses"].shape
        return {"logp": torch.zeros(n, w), "mask": b["loss_mask"], "old_logp": torch.full((n, w), -5.0)}

    out = replay.forward(forward)(rows)
    assert out["mask"][:4].tolist() == [[1.0] * 3] * 4
    assert out["mask"][4:, :2].tolist() == [[2.0, 2.0]] * 2 and out["mask"][4:, 2].tolist() == [0.0, 0.0]
    assert out["old_logp"][4:].abs().sum() == 0 and bool((out["old_logp"][:4] == -5).all())
    seen = []
    replay.on_metrics(lambda b, loss, m: seen.append(b))(rows, torch.tensor(0.0), {})
    assert seen[0]["responses"].shape[0] == 4 and "replayed" not in seen[0]


def test_replay_config_is_checked():
    with pytest.raises(ValueError, match="rl.replay.fraction': got 0"):
        parse_replay({"fraction": 0})
    with pytest.raises(ValueError, match="rl.replay.capasity': unknown"):
        parse_replay({"capasity": 3})
    with pytest.raises(ValueError, match="rl.replay.level': got 'row'"):
        parse_replay({"level": "row"})


def test_grpo_trains_with_replay(tmp_path):
    overrides = [*TINY, f"trainer.output_dir={tmp_path}", "trainer.steps=3", "rl.mini_batch_size=4"]
    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", [*overrides, "trainer.warmup_steps=0"])
    cfg = dataclasses.replace(
        cfg, rl=dataclasses.replace(cfg.rl, replay={"capacity": 8, "fraction": 0.5, "min_advantage": -1.0})
    )
    run = train(cfg)
    assert [r["replay/stored"] > 0 for r in run.records][1:] == [True, True]
    assert run.records[0]["replay/served"] == 0 and run.records[2]["replay/served"] > 0
    assert all(math.isfinite(r["loss"]) for r in run.records)
    with pytest.raises(ValueError, match="rl.replay': got a section with rl.epochs > 1"):
        load_config(ROOT / "configs" / "grpo_tiny.yaml", [*overrides, "rl.epochs=2", "rl.replay.capacity=4"])
