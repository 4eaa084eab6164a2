"""The replay buffer: its slot rules (pure, against a loop reference), and the replay stage's mixing and weights."""

from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlcore.algos.replay
from rlcore.algos import replay_init, replay_insert, replay_serve
from rlcore.testing import assert_no_host_sync
from rlcore.testing import reference as ref


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
