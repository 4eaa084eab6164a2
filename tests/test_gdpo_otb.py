"""GDPO (group-decoupled multi-reward normalisation) and the optimal token baseline: loop
references, reductions to GRPO and to the group-mean baseline, invariances, compilation."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.testing.strategies import group_ids, grouped_scores, masks


@st.composite
def multi_rewards(draw, *, dtype=torch.float32):
    """``(scores [B, K], group_ids [B])``: K components, binary, normal or constant per group."""
    first, ids = draw(grouped_scores(max_groups=5, max_size=5, patterns=("binary", "normal", "constant")))
    k = draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    cols = [first.double()]
    for _ in range(k - 1):
        kind = draw(st.sampled_from(["binary", "normal", "constant"]))
        if kind == "binary":
            cols.append(torch.randint(0, 2, ids.shape, generator=g).double())
        elif kind == "normal":
            cols.append(torch.randn(ids.shape, generator=g, dtype=torch.float64))
        else:
            cols.append(torch.full(ids.shape, 0.5, dtype=torch.float64))
    return torch.stack(cols, -1).to(dtype), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=15, deadline=None)
@given(data=multi_rewards(), batch_norm=st.booleans(), weighted=st.booleans())
def test_gdpo_matches_loop_reference(dtype, data, batch_norm, weighted):
    scores, ids = data
    scores = scores.to(dtype)
    weights = [1.0, 0.5, 2.0][: scores.shape[1]] if weighted else None
    w = torch.tensor(weights) if weighted else None
    got = algos.gdpo_advantages(scores, ids, weights=w, batch_norm=batch_norm)
    want = ref.gdpo_advantages_ref(scores, ids, weights=weights, batch_norm=batch_norm)
    assert got.dtype == dtype and got.shape == ids.shape
    # A group std near 0 (bf16 scores) amplifies rounding: scale the tolerance with the values.
    assert_close(got, want, dtype=dtype, scale=max(1.0, float(want.abs().max())))


@settings(max_examples=15, deadline=None)
@given(data=grouped_scores(max_groups=5, max_size=5), eps=st.sampled_from([0.0, 1e-6]))
def test_gdpo_with_one_reward_is_grpo(data, eps):
    scores, ids = data
    grpo = algos.grpo_advantages(scores, ids, eps=eps)
    assert torch.equal(algos.gdpo_advantages(scores, ids, eps=eps, batch_norm=False), grpo)
    assert torch.equal(algos.gdpo_advantages(scores[:, None], ids, eps=eps, batch_norm=False), grpo)
    whitened = algos.batch_normalize(grpo, torch.ones_like(grpo, dtype=torch.bool))
    torch.testing.assert_close(algos.gdpo_advantages(scores, ids, eps=eps), whitened)


@settings(max_examples=20, deadline=None)
@given(data=multi_rewards(dtype=torch.float64), perm_seed=st.integers(0, 999), scale=st.sampled_from([0.5, 3.0]))
def test_gdpo_invariances(data, perm_seed, scale):
    """Relabelling samples permutes the advantages; rescaling one component changes nothing;
    the batch-normalised advantages have mean 0."""
    scores, ids = data
    base = algos.gdpo_advantages(scores, ids, eps=0.0)
    perm = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(perm_seed))
    torch.testing.assert_close(algos.gdpo_advantages(scores[perm], ids[perm], eps=0.0), base[perm])
    rescaled = scores.clone()
    rescaled[:, 0] *= scale
    torch.testing.assert_close(algos.gdpo_advantages(rescaled, ids, eps=0.0), base)
    assert abs(float(base.mean())) < 1e-9


def test_gdpo_keeps_apart_what_grpo_collapses():
    # Two rewards (accuracy, format) in one group of two: (1, 0) vs (0, 1) and (1, 1) vs (0, 0)
    # sum to the same GRPO advantage pattern in a two-sample group; GDPO's z-scores differ
    # in a group of three, where the summed reward ties and GRPO gives 0.
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    ids = torch.tensor([0, 0, 0])
    grpo = algos.grpo_advantages(scores.sum(-1), ids)
    gdpo = algos.gdpo_advantages(scores, ids, batch_norm=False)
    assert float(grpo[0]) == float(grpo[1])
    assert float(gdpo[0]) == pytest.approx(float(gdpo[1])) and float(gdpo[2]) < float(gdpo[0])


@st.composite
def token_groups(draw, *, interior_zeros=True, allow_empty=True):
    ids = draw(group_ids(max_groups=4, max_size=4))
    b = ids.shape[0]
    t = draw(st.integers(1, 8))
    mask = draw(masks(b, t, interior_zeros=interior_zeros, allow_empty=allow_empty))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(b, t, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 6, (b, t), generator=g)
    probs = logits.softmax(-1)
    old_logp = probs.gather(-1, labels[..., None]).squeeze(-1).log()
    sum_sq = probs.square().sum(-1)
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64) * (torch.rand(b, t, generator=g) < 0.3)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    pad = {k: torch.where(mask, v, nan) for k, v in (("rewards", rewards), ("old_logp", old_logp), ("sum_sq", sum_sq))}
    rho = torch.rand(b, t, generator=g, dtype=torch.float64) + 0.5
    return {**pad, "mask": mask, "group_ids": ids, "rho": rho}


def _otb(batch, dtype=torch.float64, **kw):
    def cast(x):
        return x.to(dtype)

    return algos.optimal_token_baseline_advantages(
        cast(batch["rewards"]), cast(batch["old_logp"]), cast(batch["sum_sq"]), batch["mask"], batch["group_ids"], **kw
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=15, deadline=None)
@given(batch=token_groups(), tail=st.booleans(), multi=st.booleans(), use_rho=st.booleans())
def test_otb_matches_loop_reference(dtype, batch, tail, multi, use_rho):
    kw = {"handle_zero_tail": tail, "multi_turn": multi}
    rho = batch["rho"] if use_rho else None
    adv, ret = _otb(batch, dtype, is_weights=None if rho is None else rho.to(dtype), **kw)
    # The reference sees the inputs as the estimator does, rounded to dtype.
    args = [batch[k].to(dtype) for k in ("rewards", "old_logp", "sum_sq")]
    want_adv, want_ret = ref.optimal_token_baseline_advantages_ref(
        *args, batch["mask"], batch["group_ids"], is_weights=None if rho is None else rho.to(dtype), **kw
    )
    assert adv.dtype == dtype and ret.dtype == dtype
    assert_close(ret, want_ret, dtype=dtype, scale=max(1.0, float(want_ret.abs().max())))
    assert_close(adv, want_adv, dtype=dtype, scale=max(1.0, float(want_adv.abs().max())))


@settings(max_examples=15, deadline=None)
@given(data=grouped_scores(max_groups=4, max_size=4), length=st.integers(1, 6), c=st.sampled_from([0.3, 1.0]))
def test_otb_with_uniform_variance_and_equal_lengths_is_the_group_mean_baseline(data, length, c):
    """With the same path variance everywhere and no ragged tail, b_t is the group mean of
    the returns: an outcome reward gives Dr. GRPO's group-centred score on every token."""
    scores, ids = data
    scores = scores.double()
    b = ids.shape[0]
    mask = torch.ones(b, length, dtype=torch.bool)
    rewards = torch.zeros(b, length, dtype=torch.float64)
    rewards[:, -1] = scores
    old_logp = torch.full((b, length), -1.2, dtype=torch.float64)
    sum_sq = 2 * old_logp.exp() - 1 + c  # w = 1 - 2 pi + sum pi^2 = c
    adv, ret = algos.optimal_token_baseline_advantages(rewards, old_logp, sum_sq, mask, ids, eps=0.0)
    centred = algos.grpo_advantages(scores, ids, scale="none")
    sizes = torch.bincount(ids)[ids]
    want = torch.where(sizes > 1, centred, scores)[:, None].expand(b, length)  # a group of one: no baseline
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(ret, scores[:, None].expand(b, length))


@settings(max_examples=15, deadline=None)
@given(batch=token_groups(interior_zeros=False), tail=st.booleans())
def test_otb_multi_turn_is_single_turn_without_holes(batch, tail):
    nonempty = batch["mask"].any(-1)
    groups = int(batch["group_ids"].max()) + 1
    # Empty responses count as group members in the single-turn form only (as in verl).
    for key in ("rewards", "old_logp", "sum_sq", "mask", "group_ids"):
        batch[key] = batch[key][nonempty]
    if batch["mask"].shape[0] == 0:
        return
    single = _otb(batch, handle_zero_tail=tail, num_groups=groups)
    multi = _otb(batch, handle_zero_tail=tail, multi_turn=True, num_groups=groups)
    torch.testing.assert_close(multi, single)


@settings(max_examples=15, deadline=None)
@given(batch=token_groups(interior_zeros=False), data=st.data())
def test_otb_multi_turn_ignores_inserted_observation_tokens(batch, data):
    """Observation tokens (mask 0) inserted inside a response move nothing in multi-turn mode."""
    b, t = batch["mask"].shape
    at = data.draw(st.integers(0, t))
    width = data.draw(st.integers(1, 3))

    def widen(x, fill):
        pad = torch.full((b, width), fill, dtype=x.dtype)
        return torch.cat([x[:, :at], pad, x[:, at:]], 1)

    wide = {k: widen(batch[k], float("nan")) for k in ("rewards", "old_logp", "sum_sq")}
    wide["mask"] = widen(batch["mask"], False)
    wide["group_ids"] = batch["group_ids"]
    adv, ret = _otb(batch, multi_turn=True)
    wadv, wret = _otb(wide, multi_turn=True)
    keep = torch.ones(t + width, dtype=torch.bool)
    keep[at : at + width] = False
    torch.testing.assert_close(wadv[:, keep], adv)
    torch.testing.assert_close(wret[:, keep], ret)
    assert torch.all(wadv[:, ~keep] == 0)


def test_otb_zero_tail_gives_the_longest_response_its_return():
    # Lengths 3 and 1: positions 1 and 2 of the first response have no peer.
    rewards = torch.tensor([[0.0, 0.0, 2.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    old_logp, sum_sq = torch.full((2, 3), -1.0), torch.full((2, 3), 0.4)
    adv, _ = algos.optimal_token_baseline_advantages(rewards, old_logp, sum_sq, mask, torch.tensor([0, 0]))
    torch.testing.assert_close(adv[0, 1:], torch.tensor([2.0, 2.0]))
    # Position 0 is shared, with equal path variances: b = (2 + 1) / 2.
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5]))
    off, _ = algos.optimal_token_baseline_advantages(
        rewards, old_logp, sum_sq, mask, torch.tensor([0, 0]), handle_zero_tail=False
    )
    assert torch.all(off[0, 1:].abs() < 1e-6)


def test_bad_inputs_raise_value_error_naming_the_argument():
    s, ids = torch.zeros(4, 2), torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="scores"):
        algos.gdpo_advantages(torch.zeros(4, 2, 1), ids)
    with pytest.raises(ValueError, match="scores"):
        algos.gdpo_advantages(torch.zeros(4, 0), ids)
    with pytest.raises(ValueError, match="weights"):
        algos.gdpo_advantages(s, ids, weights=torch.ones(3))
    with pytest.raises(ValueError, match="group_ids"):
        algos.gdpo_advantages(s, torch.tensor([0, 1]))
    x, m = torch.zeros(4, 3), torch.ones(4, 3)
    otb = algos.optimal_token_baseline_advantages
    with pytest.raises(ValueError, match="sum_pi_squared"):
        otb(x, x, torch.zeros(4, 2), m, ids)
    with pytest.raises(ValueError, match="mask"):
        otb(x, x, x, torch.ones(3, 3), ids)
    with pytest.raises(ValueError, match="group_ids"):
        otb(x, x, x, m, torch.tensor([0.0, 1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="group_ids"):
        otb(x, x, x, m, torch.tensor([0, 1, 9, 1]))
    with pytest.raises(ValueError, match="is_weights"):
        otb(x, x, x, m, ids, is_weights=torch.ones(4))


@pytest.mark.parametrize("multi", [False, True])
def test_no_host_sync(multi):
    g = torch.Generator().manual_seed(0)
    scores, ids = torch.rand(8, 3, generator=g), torch.tensor([0, 1, 0, 1, 2, 2, 3, 3])
    assert_no_host_sync(functools.partial(algos.gdpo_advantages, num_groups=4), scores, ids)
    mask = torch.rand(8, 5, generator=g) > 0.3
    x = torch.rand(8, 5, generator=g)
    fn = functools.partial(algos.optimal_token_baseline_advantages, multi_turn=multi, num_groups=4)
    assert_no_host_sync(fn, x, x.log(), x, mask, ids)
