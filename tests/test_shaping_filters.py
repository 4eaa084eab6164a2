"""Reward shaping (overlong penalty, running normalisation, clipping) and sample filters."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlcore.algos.filters
import rlcore.algos.shaping
from rlcore.algos import (
    clip_rewards,
    dynamic_sampling_indices,
    dynamic_sampling_mask,
    grpo_advantages,
    overlong_penalty,
    rejection_mask,
    running_reward_normalizer,
    scores_to_token_rewards,
    truncated_is_weights,
)
from rlcore.testing import assert_close, assert_no_host_sync, grouped_scores, masks
from rlcore.testing import reference as ref
from rlcore.testing.algo_strategies import logp_batches
from rlcore.testing.strategies import float_tensors


@pytest.mark.parametrize("module", [rlcore.algos.filters, rlcore.algos.shaping])
def test_doctests(module):
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------ overlong penalty


@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    max_length=st.integers(1, 256),
    frac=st.floats(0.01, 1.0),
    factor=st.sampled_from([1.0, 0.5, 2.0]),
)
def test_overlong_penalty_matches_reference(lengths, max_length, frac, factor):
    cache = max(1, int(max_length * frac))
    lens = torch.tensor(lengths)
    got = overlong_penalty(lens, max_length=max_length, cache_length=cache, penalty_factor=factor)
    want = ref.overlong_penalty_ref(lens, max_length=max_length, cache_length=cache, penalty_factor=factor)
    assert got.dtype == torch.float32
    assert_close(got, want)
    assert bool((got <= 0).all()) and bool((got >= -factor).all())


def test_overlong_penalty_dapo_defaults_and_bad_input():
    got = overlong_penalty(torch.tensor([16384, 18432, 20480, 25000]))
    torch.testing.assert_close(got, torch.tensor([0.0, -0.5, -1.0, -1.0]))
    assert overlong_penalty(torch.tensor([1.0, 20000.0], dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(torch.tensor([1]), max_length=10, cache_length=20)
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(torch.ones(2, 2))
    assert_no_host_sync(lambda x: overlong_penalty(x, max_length=64, cache_length=8), torch.arange(100))


# ------------------------------------------------------------------ clip / placement


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(data=st.data(), low=st.sampled_from([-10.0, -1.0, 0.0]), high=st.sampled_from([0.0, 1.0, 10.0]))
def test_clip_rewards_matches_reference(dtype, data, low, high):
    x = data.draw(float_tensors((7,), dtype=dtype, patterns=("wide", "normal")))
    got = clip_rewards(x, low=low, high=high)
    assert got.dtype == dtype
    assert_close(got, ref.clip_rewards_ref(x, low=low, high=high))
    with pytest.raises(ValueError, match="low"):
        clip_rewards(x, low=1.0, high=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(data=st.data(), b=st.integers(1, 6), t=st.integers(1, 9))
def test_scores_to_token_rewards_matches_reference(dtype, data, b, t):
    mask = data.draw(masks(b, t))
    scores = data.draw(float_tensors((b,), dtype=dtype))
    got = scores_to_token_rewards(scores, mask)
    assert got.dtype == dtype
    assert_close(got, ref.scores_to_token_rewards_ref(scores, mask))
    # the total reward of a row is its score when the row has a counted token
    assert_close(got.sum(-1), torch.where(mask.any(-1), scores, 0.0).double())


def test_scores_to_token_rewards_no_host_sync_and_bad_input():
    assert_no_host_sync(scores_to_token_rewards, torch.randn(3), torch.rand(3, 8) > 0.4)
    with pytest.raises(ValueError, match="mask"):
        scores_to_token_rewards(torch.zeros(3), torch.ones(2, 4))


# --------------------------------------------------------------- running normaliser


@pytest.mark.parametrize("shift_mean", [True, False])
@settings(max_examples=25)
@given(data=st.data(), steps=st.integers(1, 4), masked=st.booleans())
def test_running_normalizer_matches_exact_history(shift_mean, data, steps, masked):
    norm = running_reward_normalizer(shift_mean=shift_mean)
    oracle = ref.RunningNormalizerRef(shift_mean=shift_mean)
    state = norm.init()
    for _ in range(steps):
        b = data.draw(st.integers(1, 9))
        x = data.draw(float_tensors((b,), patterns=("normal", "offset", "constant", "binary")))
        mask = data.draw(masks(1, b, interior_zeros=False))[0] if masked else torch.ones(b, dtype=torch.bool)
        got, state = norm.update(x, mask, state)
        want = oracle.update(x, mask)
        scale = max(1.0, float(want.abs().max()))
        assert_close(got, want, scale=scale)
    assert int(state.count) == len(oracle.seen)


def test_running_normalizer_hand_computed_and_bfloat16():
    norm = running_reward_normalizer()
    _out1, s = norm.update(torch.tensor([1.0, 3.0]), torch.ones(2, dtype=torch.bool), norm.init())
    out2, s = norm.update(torch.tensor([5.0], dtype=torch.bfloat16), torch.ones(1, dtype=torch.bool), s)
    # after both batches: {1, 3, 5}, mean 3, unbiased var 4
    torch.testing.assert_close(out2, torch.tensor([1.0], dtype=torch.bfloat16))
    torch.testing.assert_close(s.mean, torch.tensor(3.0, dtype=torch.float64))
    torch.testing.assert_close(s.m2, torch.tensor(8.0, dtype=torch.float64))
    assert out2.dtype == torch.bfloat16


def test_running_normalizer_no_host_sync():
    norm = running_reward_normalizer()
    state = norm.init()
    _out, new = assert_no_host_sync(
        lambda x, st_: norm.update(x, torch.ones_like(x, dtype=torch.bool), st_), torch.randn(8), state
    )
    assert int(new.count) == 8 and int(state.count) == 0


# --------------------------------------------------------------- dynamic sampling


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(scores_ids=grouped_scores(patterns=("binary", "constant", "normal")))
def test_dynamic_sampling_matches_reference(dtype, scores_ids):
    scores, ids = scores_ids
    scores = scores.to(dtype)
    want = ref.dynamic_sampling_mask_ref(scores, ids)
    assert torch.equal(dynamic_sampling_mask(scores, ids), want)
    assert torch.equal(dynamic_sampling_indices(scores, ids), torch.arange(len(ids))[want])
    # dropped samples are exactly the ones whose GRPO advantage is 0 for lack of signal
    adv = grpo_advantages(scores, ids)
    assert torch.equal(adv[~want], torch.zeros_like(adv[~want]))


def test_dynamic_sampling_hand_computed_and_no_host_sync():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert dynamic_sampling_mask(scores, ids).tolist() == [False, False, True, True, False, False, False]
    assert dynamic_sampling_indices(scores, ids).tolist() == [2, 3]
    assert_no_host_sync(lambda s, i: dynamic_sampling_mask(s, i, num_groups=4), scores, ids)
    with pytest.raises(ValueError, match="group_ids"):
        dynamic_sampling_mask(scores, ids[:3])


# ------------------------------------------------------- rollout / trainer mismatch


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=25)
@given(batch=logp_batches(scales=("zero", "small", "large")), cap=st.sampled_from([1.5, 2.0, 5.0]))
def test_truncated_is_weights_matches_reference(level, dtype, batch, cap):
    lp, rl, m = batch["logp"].to(dtype), batch["ref_logp"].to(dtype), batch["mask"]
    got = truncated_is_weights(lp, rl, m, level=level, cap=cap)
    assert got.dtype == dtype
    want = ref.truncated_is_weights_ref(lp, rl, m, level=level, cap=cap)
    assert_close(got, want, scale=cap)
    assert bool((got <= cap).all()) and bool((got >= 0).all())


def test_truncated_is_weights_properties():
    lp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    m = torch.tensor([[1, 1, 0]])
    same = truncated_is_weights(lp, lp.detach(), m, level="sequence")
    torch.testing.assert_close(same, torch.tensor([[1.0, 1.0, 0.0]]))
    assert not same.requires_grad
    # a sequence whose log-ratio sum is 1e4 neither overflows nor escapes the cap
    far = truncated_is_weights(torch.full((1, 4), 0.0), torch.full((1, 4), -2500.0), torch.ones(1, 4), level="sequence")
    torch.testing.assert_close(far, torch.full((1, 4), 2.0))
    # the sequence weight is the product of the token ratios
    rl = torch.tensor([[-1.2, -1.9, 0.0]])
    want = math.exp(0.2 - 0.1)
    torch.testing.assert_close(truncated_is_weights(lp, rl, m, level="sequence"), torch.tensor([[want, want, 0.0]]))


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@settings(max_examples=25)
@given(
    batch=logp_batches(scales=("zero", "small", "large")),
    high=st.sampled_from([1.001, 1.5, 2.0, 10.0]),
    veto=st.sampled_from([None, 1e-4, 0.5]),
    mask_dtype=st.sampled_from([torch.bool, torch.float32, torch.int64]),
)
def test_rejection_mask_matches_reference(level, batch, high, veto, mask_dtype):
    m = batch["mask"].to(mask_dtype)
    got = rejection_mask(batch["logp"], batch["ref_logp"], m, level=level, high=high, veto=veto)
    assert got.dtype == mask_dtype
    want = ref.rejection_mask_ref(batch["logp"], batch["ref_logp"], batch["mask"], level=level, high=high, veto=veto)
    assert torch.equal(got != 0, want)
    assert bool(((got != 0) <= (m != 0)).all())  # only ever removes tokens


def test_rejection_mask_hand_computed():
    lp = torch.zeros(3, 3)
    rl = torch.tensor([[0.0, 0.0, -1.0], [0.0, 0.1, 0.0], [0.0, -20.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    tok = rejection_mask(lp, rl, m, level="token")  # rho = e^1 > 2 rejected
    assert tok.tolist() == [[True, True, False], [True, True, True], [True, False, True]]
    seq = rejection_mask(lp, rl, m, level="sequence")
    assert seq.tolist() == [[False, False, False], [True, True, True], [True, False, True]]
    geo = rejection_mask(lp, rl, m, level="geometric", high=1.001)  # row 1: exp(-0.1/3) < 1/1.001
    assert geo.tolist() == [[False, False, False], [False, False, False], [True, False, True]]
    # rho = e^-0.1 < 0.95 vetoes row 1; row 2's e^20 sits on a mask-0 token and does not count
    vetoed = rejection_mask(lp, rl, m, level="token", high=10.0, veto=0.95)
    assert vetoed.tolist() == [[True, True, True], [False, False, False], [True, False, True]]


def test_filters_no_host_sync_and_bad_input():
    g = torch.Generator().manual_seed(21)
    lp, rl = torch.randn(3, 7, generator=g) - 2, torch.randn(3, 7, generator=g) - 2
    m = torch.rand(3, 7, generator=g) > 0.3
    for level in ("token", "sequence"):
        assert_no_host_sync(lambda a, b, c: truncated_is_weights(a, b, c, level=level), lp, rl, m)
    for level in ("token", "sequence", "geometric"):
        assert_no_host_sync(lambda a, b, c: rejection_mask(a, b, c, level=level, veto=1e-4), lp, rl, m)
    with pytest.raises(ValueError, match="level.*'token', 'sequence'"):
        truncated_is_weights(lp, rl, m, level="geometric")
    with pytest.raises(ValueError, match="low"):
        rejection_mask(lp, rl, m, high=2.0, low=3.0)
    with pytest.raises(ValueError, match="rollout_logp"):
        rejection_mask(lp, rl[:, :3], m)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(lp, rl, m, cap=0.0)


@pytest.mark.parametrize("bounds", [{"low": math.nan}, {"high": math.nan}, {"low": math.nan, "high": math.nan}])
def test_reprobe_clip_rewards_rejects_nan_bounds(bounds):
    # A NaN bound made every reward NaN.
    with pytest.raises(ValueError, match="(low|high): got nan"):
        clip_rewards(torch.tensor([1.0, 5.0]), **bounds)


def test_reprobe_negative_overlong_lengths_are_refused_naming_lengths():
    # A negative length passed as a zero penalty.
    with pytest.raises(ValueError, match=r"lengths: got values in \[-5, 12\], expected counts >= 0"):
        overlong_penalty(torch.tensor([-5, 12]), max_length=10, cache_length=4)
