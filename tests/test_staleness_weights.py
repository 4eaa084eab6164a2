"""Staleness-aware data: rows older than k versions dropped or discounted (rlcore.algos.staleness_weights)."""

from __future__ import annotations

import functools

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.algos import staleness_weights
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref

lags = st.lists(st.integers(0, 12), min_size=1, max_size=16)


@settings(max_examples=40, deadline=None)
@given(
    lag=lags,
    max_lag=st.integers(0, 5),
    mode=st.sampled_from(algos.STALE_MODES),
    decay=st.sampled_from([0.25, 0.5, 0.9, 1.0]),
    dtype=st.sampled_from([torch.int64, torch.float32, torch.bfloat16]),
)
def test_matches_the_reference(lag, max_lag, mode, decay, dtype):
    x = torch.tensor(lag).to(dtype)
    got = staleness_weights(x, max_lag=max_lag, mode=mode, decay=decay)
    assert got.dtype == (torch.float32 if dtype == torch.int64 else dtype)
    want = ref.staleness_weights_ref(x, max_lag=max_lag, mode=mode, decay=decay)
    assert_close(got, want, dtype=got.dtype)


@settings(max_examples=30, deadline=None)
@given(lag=lags, max_lag=st.integers(0, 5), mode=st.sampled_from(algos.STALE_MODES))
def test_fresh_rows_whole_old_rows_never_heavier(lag, max_lag, mode):
    x = torch.tensor(lag)
    w = staleness_weights(x, max_lag=max_lag, mode=mode)
    assert bool(((w >= 0) & (w <= 1)).all())
    assert bool((w[x <= max_lag] == 1).all())
    order = torch.argsort(x, stable=True)
    assert bool((w[order].diff() <= 0).all())  # monotone: an older row never weighs more than a newer one
    if mode == "drop":
        assert bool((w[x > max_lag] == 0).all())


def test_decay_one_keeps_every_row_and_staleness_zero_is_the_identity():
    x = torch.tensor([0, 3, 7])
    assert torch.equal(staleness_weights(x, max_lag=0, mode="weight", decay=1.0), torch.ones(3))
    assert torch.equal(staleness_weights(torch.zeros(5, dtype=torch.int64), max_lag=0), torch.ones(5))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lag": torch.zeros(2, 2), "max_lag": 1}, "lag"),
        ({"lag": torch.zeros(2), "max_lag": -1}, "max_lag: got -1"),
        ({"lag": torch.zeros(2), "max_lag": 1.5}, "max_lag: got 1.5"),
        ({"lag": torch.zeros(2), "max_lag": 1, "mode": "skip"}, "mode"),
        ({"lag": torch.zeros(2), "max_lag": 1, "decay": 0.0}, "decay: got 0.0"),
        ({"lag": torch.zeros(2), "max_lag": 1, "decay": 1.5}, "decay: got 1.5"),
    ],
)
def test_bad_input_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        staleness_weights(**kwargs)


def test_no_host_sync():
    x = torch.tensor([0, 1, 2, 5])
    for mode in algos.STALE_MODES:
        assert_no_host_sync(functools.partial(staleness_weights, max_lag=1, mode=mode), x)


# --- in the trainer: the loss mask weighted, rows refilled, the metrics -------------------------------


def test_staleness_weighted_scales_each_rows_loss_mask():
    from rlcore.train import staleness_weighted

    forward = staleness_weighted(
        lambda b: {"mask": torch.ones(3, 2), "logp": torch.zeros(3, 2)},
        functools.partial(staleness_weights, max_lag=1, mode="weight"),
        start=10,
    )
    out = forward({"iteration": torch.tensor([12, 12, 12]), "version": torch.tensor([2, 1, 0])})
    assert out["mask"].tolist() == [[1.0, 1.0], [1.0, 1.0], [0.5, 0.5]]


class _Worker:
    published = 5


def test_refill_redraws_the_stale_rows_with_the_newest_version_a_bounded_number_of_times():
    from rlcore.train.deploy import refilled

    calls = []

    def call(b):
        calls.append(b["policy_version"].tolist())
        width = 2 + len(calls)  # each draw a longer response: the token columns are padded to the wider
        return {
            "responses": torch.full((len(b["row"]), width), len(calls)),
            "version": b["policy_version"].clone(),
        }

    b = {"row": torch.arange(4), "policy_version": torch.tensor([1, 4, 2, 5])}
    out = refilled(call, _Worker(), after=1, draws=2)(b)
    assert calls == [[1, 4, 2, 5], [5, 5]]  # rows 0 and 2 were 4 and 3 versions behind version 5
    assert out["version"].tolist() == [5, 4, 5, 5]
    assert out["responses"].shape == (4, 4) and out["responses"][:, 0].tolist() == [2, 1, 2, 1]
    assert out["responses"][1].tolist() == [1, 1, 1, 0]
    calls.clear()
    refilled(call, _Worker(), after=10, draws=3)(b)
    assert len(calls) == 1  # nothing stale: no redraw


@pytest.mark.parametrize(
    "extra, key",
    [
        (["rl.stale_after=1"], "rl.stale_after"),
        (["deploy.async_infer=true", "rl.stale_decay=0.0"], "rl.stale_decay"),
        (["deploy.async_infer=true", "deploy.stale_refills=1"], "deploy.stale_refills"),
        (["deploy.async_infer=true", "rl.stale_after=1", "deploy.stale_refills=1"], "deploy.stale_refills"),
    ],
)
def test_stale_keys_are_refused_where_they_mean_nothing(extra, key):
    from rlcore.train import parse_config

    raw = {"model": {"model_name_or_path": {"model_type": "qwen2"}}, "rl": {}, "deploy": {}}
    for item in extra:
        path, value = item.split("=")
        section, name = path.split(".")
        raw[section][name] = yaml.safe_load(value)
    with pytest.raises(ValueError, match=f"config key '{key}'"):
        parse_config(raw)


def test_a_run_drops_and_refills_stale_rows(tmp_path):
    from pathlib import Path

    from rlcore.train import load_config, train
    from tiny_runs import TINY

    root = Path(__file__).resolve().parents[1]
    extra = [
        "trainer.steps=4",
        "deploy.mode=disaggregated",
        "deploy.async_infer=true",
        "deploy.staleness=2",
        "rl.stale_after=0",
        "deploy.stale_refills=1",
    ]
    cfg = load_config(root / "configs" / "grpo_tiny.yaml", [*TINY, f"trainer.output_dir={tmp_path}", *extra])
    run = train(cfg)
    assert [r["step"] for r in run.records] == [0, 1, 2, 3]
    for r in run.records:
        assert 0 <= r["stale/dropped"] <= 1 and r["stale/weight"] == pytest.approx(1 - r["stale/dropped"])
