"""The pass-rate curriculum: the rate update and the band probabilities (against loop references), the draw,
and a short trainer run on a prompt dataset with it on."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlcore.data.curriculum
from dataset_runs import reversal_run
from rlcore import seeding
from rlcore.data import curriculum_draw, curriculum_probs, difficulty_bands, parse_curriculum, pass_rate_update
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.train import train


def test_doctests():
    result = doctest.testmod(rlcore.data.curriculum, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    prompts=st.integers(1, 8),
    decay=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_pass_rate_update_matches_reference_and_stays_in_the_unit_interval(data, prompts, decay, dtype):
    rates = torch.tensor(data.draw(st.lists(st.floats(0, 1), min_size=prompts, max_size=prompts)))
    n = data.draw(st.integers(0, 12))
    index = torch.tensor(data.draw(st.lists(st.integers(0, prompts - 1), min_size=n, max_size=n)), dtype=torch.long)
    values = st.sampled_from([0.0, 0.4, 0.5, 1.0, float("nan")])
    scores = torch.tensor(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=dtype)
    got = pass_rate_update(rates, index, scores, decay=decay, threshold=0.5)
    want = ref.pass_rate_update_ref(rates, index, scores, decay=decay, threshold=0.5)
    assert_close(got, want.float())
    assert bool((got >= 0).all()) and bool((got <= 1).all())
    untouched = torch.ones(prompts, dtype=torch.bool)
    untouched[index] = False
    assert torch.equal(got[untouched], rates[untouched])  # a prompt not drawn keeps its rate


@given(
    rates=st.lists(st.sampled_from([0.0, 0.1, 0.2, 0.5, 0.8, 0.9, 1.0]), min_size=1, max_size=10),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_difficulty_bands_match_reference(rates, dtype):
    r = torch.tensor(rates, dtype=dtype)
    got = difficulty_bands(r, (0.2, 0.8))
    assert got.tolist() == ref.difficulty_bands_ref(
        r.tolist(), [float(torch.tensor(e, dtype=dtype)) for e in (0.2, 0.8)]
    )


@settings(max_examples=40, deadline=None)
@given(
    bands=st.lists(st.integers(0, 2), min_size=1, max_size=12),
    weights=st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=3, max_size=3),
)
def test_curriculum_probs_match_reference_and_the_band_shares(bands, weights):
    got = curriculum_probs(torch.tensor(bands), weights)
    assert_close(got, torch.tensor(ref.curriculum_probs_ref(bands, weights), dtype=torch.float64))
    assert math.isclose(float(got.sum()), 1.0, rel_tol=1e-9)
    live = sum(weights[b] for b in set(bands))
    for b in set(bands):
        mine = got[torch.tensor(bands) == b]
        assert bool((mine == mine[0]).all())  # uniform within a band
        if live > 0:
            assert math.isclose(float(mine.sum()), weights[b] / live, rel_tol=1e-9, abs_tol=1e-12)


def test_prompts_move_between_bands_and_the_draw_follows_them():
    rates = torch.full((6,), 0.5)
    edges, weights = (0.2, 0.8), (1.0, 0.0, 0.0)  # only the hardest band is drawn
    # Prompts 0 and 1 fail every sample twice: their rate falls below 0.2, into the hard band.
    for _ in range(2):
        rates = pass_rate_update(rates, torch.tensor([0, 0, 1, 1]), torch.zeros(4), decay=0.3)
    bands = difficulty_bands(rates, edges)
    assert bands.tolist() == [0, 0, 1, 1, 1, 1]
    g = seeding.generator(0, seeding.Purpose.CURRICULUM, 0)
    drawn = curriculum_draw(curriculum_probs(bands, weights), 5, g)
    assert sorted(drawn[:2]) == [0, 1] and set(drawn) == {0, 1}  # distinct while they last, then again
    # Passing lifts prompt 0 out of the band; the draw leaves it.
    for _ in range(4):
        rates = pass_rate_update(rates, torch.tensor([0]), torch.ones(1), decay=0.3)
    bands = difficulty_bands(rates, edges)
    assert bands.tolist()[:2] == [2, 0]
    assert set(curriculum_draw(curriculum_probs(bands, weights), 3, g)) == {1}
    assert_no_host_sync(
        lambda r, i, s: pass_rate_update(r, i, s, decay=0.5), rates, torch.tensor([0, 2]), torch.ones(2)
    )
    assert_no_host_sync(lambda b: curriculum_probs(b, weights), bands)


def test_curriculum_config_and_bad_input():
    with pytest.raises(ValueError, match="data.curriculum.edges': got"):
        parse_curriculum({"edges": [0.8, 0.2], "weights": [1, 1, 1]})
    with pytest.raises(ValueError, match="data.curriculum.decay'"):
        parse_curriculum({"decay": 2})
    with pytest.raises(ValueError, match="data.curriculum.band': unknown"):
        parse_curriculum({"band": 2})
    with pytest.raises(ValueError, match="index"):
        pass_rate_update(torch.zeros(2), torch.zeros(2), torch.zeros(2))


def test_grpo_trains_on_a_dataset_with_the_curriculum_and_refills(tmp_path):
    cfg = reversal_run(
        tmp_path,
        tmp_path / "out",
        4,
        [
            "data.curriculum.edges=[0.3]",
            "data.curriculum.weights=[1.0, 1.0]",
            "data.curriculum.decay=0.0",
            "rl.max_refill_draws=1",  # composed: the refills are drawn from the dataset by the curriculum's source
        ],
    )
    run = train(cfg)
    assert len(run.records) == 4
    last = run.records[-1]
    # The prompts drawn in steps 0 and 1 scored 0 (a random model): step 3's draw sees them in the hard band.
    assert last["curriculum/band_0"] > 0 and math.isclose(last["curriculum/band_0"] + last["curriculum/band_1"], 1.0)
    assert all(r["refill/draws"] in (0.0, 1.0) and 0 <= r["refill/shortfall"] <= 2 for r in run.records)
