"""rlcore.train.tagged_metrics: values carry their reduction over a step's updates and the data-parallel ranks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_helpers import leave, spawn
from rlcore.testing.reference import merge_metrics_ref
from rlcore.train.tagged_metrics import (
    REDUCTIONS,
    Metric,
    all_reduce_metrics,
    as_tensors,
    maximum,
    mean,
    merge,
    merge_into,
    total,
)

_MAKE = {"mean": mean, "sum": total, "max": maximum}
_finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@st.composite
def produced(draw, max_ranks=3, max_updates=4):
    """ranks x updates x {name: (value, reduction)}, one reduction per name; every update makes every name."""
    kinds = draw(st.dictionaries(st.sampled_from("abcdef"), st.sampled_from(REDUCTIONS), min_size=1, max_size=4))
    ranks = draw(st.integers(1, max_ranks))
    out = []
    for _ in range(ranks):
        updates = draw(st.integers(1, max_updates))
        out.append([{n: (draw(_finite), k) for n, k in kinds.items()} for _ in range(updates)])
    return out


def _fold(streams, dtype=torch.float32):
    """Each rank folds its updates, then the ranks fold together: the same merge for both."""
    per_rank = []
    for rank in streams:
        acc: dict[str, Metric] = {}
        for update in rank:
            merge_into(acc, {n: _MAKE[k](torch.tensor(v, dtype=dtype)) for n, (v, k) in update.items()})
        per_rank.append(acc)
    whole = dict(per_rank[0])
    for acc in per_rank[1:]:
        merge_into(whole, acc)
    return whole


@settings(max_examples=60, deadline=None)
@given(produced())
def test_fold_over_updates_and_ranks_equals_the_loop_reference(streams):
    got = as_tensors(_fold(streams))
    want = merge_metrics_ref(streams)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == torch.float32 and got[name].shape == ()
        assert float(got[name]) == pytest.approx(value, rel=1e-5, abs=1e-3), name


@settings(max_examples=30, deadline=None)
@given(produced(max_ranks=1))
def test_bfloat16_values_are_combined_in_float32(streams):
    got = as_tensors(_fold(streams, dtype=torch.bfloat16))
    want = merge_metrics_ref(
        [[{n: (float(torch.tensor(v).bfloat16()), k) for n, (v, k) in u.items()} for u in r] for r in streams]
    )
    for name, value in want.items():
        assert got[name].dtype == torch.float32
        assert float(got[name]) == pytest.approx(value, rel=1e-5, abs=1e-3), name


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(REDUCTIONS), st.lists(_finite, min_size=3, max_size=3))
def test_merge_is_associative_and_commutative(kind, xs):
    a, b, c = (_MAKE[kind](x) for x in xs)
    left, right = merge(merge(a, b), c), merge(a, merge(b, c))
    assert float(left.value) == pytest.approx(float(right.value), rel=1e-5, abs=1e-4)
    assert float(merge(a, b).value) == pytest.approx(float(merge(b, a).value), rel=1e-6, abs=1e-6)
    assert left.num_values == right.num_values == (3.0 if kind == "mean" else 1.0)


def test_each_reduction_by_hand():
    assert float(merge(total(2.0), total(3.0)).value) == 5.0
    assert float(merge(maximum(2.0), maximum(-3.0)).value) == 2.0
    three = merge(merge(mean(1.0), mean(2.0)), mean(6.0))
    assert (float(three.value), three.num_values) == (3.0, 3.0)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"metric\.reduce: got 'median'"):
        merge(Metric(torch.tensor(1.0), "median"), mean(1.0))
    with pytest.raises(ValueError, match=r"metrics\['x'\]: got reductions 'sum' and 'max', expected one reduction"):
        merge_into({"x": total(1.0)}, {"x": maximum(2.0)})
    with pytest.raises(ValueError, match=r"value: got shape \(2,\), expected a scalar metric"):
        mean(torch.ones(2))


def test_no_group_is_the_identity():
    metrics = {"a": mean(1.0), "b": maximum(2.0)}
    assert all_reduce_metrics(metrics, None) == metrics


# Two ranks with different numbers of updates and values: the all-reduce equals the fold.
_STREAMS = [
    [{"loss": (0.5, "sum"), "kl": (0.1, "mean"), "lag": (1.0, "max")}] * 2,
    [{"loss": (0.25, "sum"), "kl": (0.4, "mean"), "lag": (3.0, "max")}] * 3,
]


def _ranks(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    local = _fold([_STREAMS[rank]])
    reduced = all_reduce_metrics(local, dist.group.WORLD)
    torch.save({n: (float(m.value), m.reduce, m.num_values) for n, m in reduced.items()}, f"{out}/rank{rank}.pt")
    leave()


def test_all_reduce_over_two_gloo_ranks_equals_the_fold(tmp_path):
    spawn(_ranks, (str(tmp_path / "rendezvous"), str(tmp_path)), 2, timeout=120)
    want = _fold(_STREAMS)
    ref = merge_metrics_ref(_STREAMS)
    for rank in range(2):
        got = torch.load(Path(tmp_path) / f"rank{rank}.pt")
        assert got.keys() == want.keys()
        for name, m in want.items():
            value, kind, count = got[name]
            assert kind == m.reduce and count == m.num_values and math.isclose(value, float(m.value), rel_tol=1e-6)
            assert math.isclose(value, ref[name], rel_tol=1e-6)
