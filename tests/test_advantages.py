"""Advantage estimators: differential tests against loop references, properties, gradients, no host sync."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlcore.algos.advantages.normalize
import rlcore.algos.advantages.outcome
import rlcore.algos.advantages.passk
import rlcore.algos.advantages.token
import rlcore.testing.algo_strategies
from rlcore.algos import (
    batch_normalize,
    gae,
    gpg_advantages,
    grpo_advantages,
    opo_advantages,
    passk_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from rlcore.ops import masked_whiten, segment_std, segment_sum
from rlcore.testing import assert_close, assert_no_host_sync, grouped_scores, masks
from rlcore.testing import reference as ref
from rlcore.testing.algo_strategies import reward_batches

DISCOUNTS = st.sampled_from([1.0, 0.99, 0.95, 0.5, 0.0])
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize(
    "module",
    [
        rlcore.algos.advantages.normalize,
        rlcore.algos.advantages.outcome,
        rlcore.algos.advantages.passk,
        rlcore.algos.advantages.token,
        rlcore.testing.algo_strategies,
    ],
)
def test_doctests(module):
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def _magnitude(x: torch.Tensor) -> float:
    finite = x[torch.isfinite(x)]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


# --------------------------------------------------------------------------------- GAE


def test_gae_hand_computed():
    r = torch.tensor([[1.0, 0.0, 2.0]])
    v = torch.tensor([[0.5, 1.0, 0.0]])
    adv, ret = gae(r, v, torch.ones(1, 3), gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.875, -0.5, 2.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.375, 0.5, 2.0]]))
    # An observation token in the middle: its reward (5) and value (7) are ignored and it
    # costs no discount step.
    adv, ret = gae(
        torch.tensor([[1.0, 5.0, 2.0]]), torch.tensor([[0.5, 7.0, 0.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5, lam=0.5
    )
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0, 2.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.5, 0.0, 2.0]]))


@given(batch=reward_batches(), gamma=DISCOUNTS, lam=DISCOUNTS)
def test_gae_matches_reference(batch, gamma, lam):
    adv, ret = gae(batch["rewards"], batch["values"], batch["mask"], gamma=gamma, lam=lam)
    want_adv, want_ret = ref.gae_ref(batch["rewards"], batch["values"], batch["mask"], gamma=gamma, lam=lam)
    scale = _magnitude(batch["rewards"]) * batch["mask"].shape[1] + _magnitude(batch["values"])
    assert_close(adv, want_adv, scale=scale)
    assert_close(ret, want_ret, scale=scale)


@settings(max_examples=15)
@given(batch=reward_batches(max_len=12, dtype=torch.bfloat16), gamma=DISCOUNTS, lam=DISCOUNTS)
def test_gae_bfloat16(batch, gamma, lam):
    adv, ret = gae(batch["rewards"], batch["values"], batch["mask"], gamma=gamma, lam=lam)
    assert adv.dtype == ret.dtype == torch.bfloat16
    want_adv, want_ret = ref.gae_ref(batch["rewards"], batch["values"], batch["mask"], gamma=gamma, lam=lam)
    scale = _magnitude(batch["rewards"]) * batch["mask"].shape[1] + _magnitude(batch["values"])
    assert_close(adv, want_adv, scale=scale)
    assert_close(ret, want_ret, scale=scale)


@given(batch=reward_batches())
def test_gae_unit_discount_is_reward_to_go_minus_values(batch):
    r, v, m = batch["rewards"].double(), batch["values"].double(), batch["mask"]
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    counted = torch.where(m, r, 0.0)
    to_go = counted.flip(-1).cumsum(-1).flip(-1)
    assert_close(adv, torch.where(m, to_go - v, 0.0), scale=_magnitude(r) * r.shape[1] + _magnitude(v))
    assert_close(ret, torch.where(m, to_go, 0.0), scale=_magnitude(r) * r.shape[1])


@given(batch=reward_batches(), gamma=DISCOUNTS)
def test_gae_lambda_one_returns_do_not_depend_on_values(batch, gamma):
    r, v, m = batch["rewards"].double(), batch["values"].double(), batch["mask"]
    _, ret = gae(r, v, m, gamma=gamma, lam=1.0)
    _, ret_other = gae(r, torch.randn_like(v) * 3, m, gamma=gamma, lam=1.0)
    assert_close(ret, ret_other, scale=_magnitude(r) * r.shape[1] + _magnitude(v))


@given(batch=reward_batches(), gamma=DISCOUNTS, lam=DISCOUNTS)
def test_gae_observation_tokens_are_not_time_steps(batch, gamma, lam):
    """Deleting every mask-0 token (compacting each row) leaves the counted advantages unchanged."""
    r, v, m = batch["rewards"].double(), batch["values"].double(), batch["mask"]
    adv, _ = gae(r, v, m, gamma=gamma, lam=lam)
    for i in range(m.shape[0]):
        keep = m[i]
        if not keep.any():
            assert torch.equal(adv[i], torch.zeros_like(adv[i]))
            continue
        dense, _ = gae(
            r[i, keep][None], v[i, keep][None], torch.ones(1, int(keep.sum()), dtype=torch.bool), gamma=gamma, lam=lam
        )
        assert_close(adv[i, keep], dense[0], scale=_magnitude(r) * r.shape[1] + _magnitude(v))


def test_gae_gradcheck():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(2, 7, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 7, dtype=torch.float64, generator=g, requires_grad=True)
    m = torch.tensor([[1, 1, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda a, b: gae(a, b, m, gamma=0.9, lam=0.8), (r, v))


def test_gae_no_host_sync():
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(3, 70, generator=g), torch.randn(3, 70, generator=g)
    m = torch.rand(3, 70, generator=g) > 0.2
    assert_no_host_sync(lambda a, b, c: gae(a, b, c, gamma=0.99, lam=0.95), r, v, m)


def test_gae_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="values"):
        gae(x, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        gae(x, x, torch.ones(3, 3))
    with pytest.raises(ValueError, match="gamma"):
        gae(x, x, torch.ones(2, 3), gamma=1.5)
    with pytest.raises(ValueError, match="rewards"):
        gae(torch.zeros(3), torch.zeros(3), torch.ones(3))


# ------------------------------------------------------------------------- REINFORCE++


@given(batch=reward_batches(), gamma=DISCOUNTS)
def test_reinforce_pp_matches_reference(batch, gamma):
    got = reinforce_pp_advantages(batch["rewards"], batch["mask"], gamma=gamma)
    want = ref.reinforce_pp_advantages_ref(batch["rewards"], batch["mask"], gamma=gamma)
    # Whitening divides by a std that may be tiny: compare on the scale of the output.
    assert_close(got, want, scale=_magnitude(want) * batch["mask"].shape[1])


@given(batch=reward_batches(dtype=torch.bfloat16, max_len=12), gamma=DISCOUNTS)
@settings(max_examples=15)
def test_reinforce_pp_bfloat16(batch, gamma):
    got = reinforce_pp_advantages(batch["rewards"], batch["mask"], gamma=gamma)
    assert got.dtype == torch.bfloat16
    want = ref.reinforce_pp_advantages_ref(batch["rewards"], batch["mask"], gamma=gamma)
    assert_close(got, want, scale=_magnitude(want) * batch["mask"].shape[1])


@given(batch=reward_batches(min_batch=2), gamma=DISCOUNTS)
def test_reinforce_pp_is_whitened(batch, gamma):
    m = batch["mask"]
    got = reinforce_pp_advantages(batch["rewards"].double(), m, gamma=gamma, eps=0.0)
    vals = got[m]
    assert torch.equal(got[~m], torch.zeros_like(got[~m]))
    if vals.numel() > 1 and bool((vals != vals[0]).any()):  # returns not all equal
        assert abs(float(vals.mean())) < 1e-9
        assert abs(float(vals.std()) - 1.0) < 1e-9


@given(scores_ids=grouped_scores(), t=st.integers(1, 6), data=st.data())
def test_reinforce_pp_baseline_matches_reference(scores_ids, t, data):
    scores, ids = scores_ids
    mask = data.draw(masks(scores.shape[0], t))
    got = reinforce_pp_baseline_advantages(scores, ids, mask)
    want = ref.reinforce_pp_baseline_advantages_ref(scores, ids, mask)
    assert_close(got, want, scale=_magnitude(want) * 4)


def test_reinforce_pp_no_host_sync():
    g = torch.Generator().manual_seed(2)
    r = torch.randn(4, 9, generator=g)
    m = torch.rand(4, 9, generator=g) > 0.3
    assert_no_host_sync(lambda a, b: reinforce_pp_advantages(a, b, gamma=0.99), r, m)
    s, ids = torch.randn(4, generator=g), torch.tensor([0, 1, 0, 1])
    assert_no_host_sync(reinforce_pp_baseline_advantages, s, ids, m)


def test_reinforce_pp_gradcheck():
    g = torch.Generator().manual_seed(3)
    r = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    m = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda a: reinforce_pp_advantages(a, m, gamma=0.9), (r,))


# -------------------------------------------------------------------------------- GRPO


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@given(scores_ids=grouped_scores(), explicit=st.booleans())
def test_grpo_matches_reference(scale, scores_ids, explicit):
    scores, ids = scores_ids
    n = int(ids.max()) + 1 if explicit else None
    got = grpo_advantages(scores, ids, scale=scale, num_groups=n)
    want = ref.grpo_advantages_ref(scores, ids, scale=scale)
    assert_close(got, want, scale=_magnitude(want))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@settings(max_examples=20)
@given(scores_ids=grouped_scores(dtype=torch.bfloat16, patterns=("normal", "binary", "constant")))
def test_grpo_bfloat16(scale, scores_ids):
    scores, ids = scores_ids
    got = grpo_advantages(scores, ids, scale=scale)
    assert got.dtype == torch.bfloat16
    assert_close(got, ref.grpo_advantages_ref(scores, ids, scale=scale), scale=_magnitude(scores))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@given(scores_ids=grouped_scores(patterns=("constant", "offset", "normal")))
def test_grpo_constant_groups_and_singletons_are_exactly_zero(dtype, scale, scores_ids):
    scores, ids = scores_ids
    scores = scores.to(dtype)
    got = grpo_advantages(scores, ids, scale=scale)
    n = int(ids.max()) + 1
    hi = scores.new_zeros(n).scatter_reduce(0, ids, scores, "amax", include_self=False)
    lo = scores.new_zeros(n).scatter_reduce(0, ids, scores, "amin", include_self=False)
    flat = (hi == lo)[ids]
    assert torch.equal(got[flat], torch.zeros_like(got[flat]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@given(scores_ids=grouped_scores(dtype=torch.float64))
def test_grpo_sums_to_zero_per_group(scale, scores_ids):
    scores, ids = scores_ids
    got = grpo_advantages(scores, ids, scale=scale)
    sums = segment_sum(got, ids, num_segments=int(ids.max()) + 1)
    assert_close(sums, torch.zeros_like(sums), scale=_magnitude(got) * 10)


@pytest.mark.parametrize("scale", ["group", "none"])
@given(scores_ids=grouped_scores(dtype=torch.float64, patterns=("normal", "binary")), data=st.data())
def test_grpo_invariant_to_per_group_shift(scale, scores_ids, data):
    scores, ids = scores_ids
    n = int(ids.max()) + 1
    shift = torch.tensor(data.draw(st.lists(st.integers(-8, 8), min_size=n, max_size=n)), dtype=torch.float64)
    got = grpo_advantages(scores + shift[ids], ids, scale=scale)
    assert_close(got, grpo_advantages(scores, ids, scale=scale), scale=_magnitude(scores) * 10)


@given(scores_ids=grouped_scores(dtype=torch.float64, patterns=("normal", "binary")), data=st.data())
def test_grpo_group_scale_invariant_to_positive_per_group_scale(scores_ids, data):
    scores, ids = scores_ids
    n = int(ids.max()) + 1
    factor = torch.tensor(
        data.draw(st.lists(st.sampled_from([0.25, 0.5, 2.0, 3.0, 10.0]), min_size=n, max_size=n)), dtype=torch.float64
    )
    got = grpo_advantages(scores * factor[ids], ids, scale="group", eps=0.0)
    assert_close(got, grpo_advantages(scores, ids, scale="group", eps=0.0), scale=10.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@given(scores_ids=grouped_scores(), data=st.data())
def test_grpo_permutation_equivariant(scale, scores_ids, data):
    scores, ids = scores_ids
    perm = torch.tensor(data.draw(st.permutations(list(range(scores.shape[0])))), dtype=torch.long)
    got = grpo_advantages(scores[perm], ids[perm], scale=scale)
    assert_close(got, grpo_advantages(scores, ids, scale=scale)[perm], scale=_magnitude(got))


def test_grpo_hand_computed():
    scores = torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0, 7.0])
    ids = torch.tensor([0, 0, 0, 1, 1, 2])
    # group 0: mean 1/3, unbiased std sqrt(1/3); group 1 constant; group 2 singleton
    s = (1.0 / 3.0) ** 0.5
    want = torch.tensor([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0, 0.0, 0.0])
    torch.testing.assert_close(grpo_advantages(scores, ids, eps=0.0), want)
    torch.testing.assert_close(
        grpo_advantages(scores, ids, scale="none"), torch.tensor([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    )
    batch_std = float(scores.std())
    torch.testing.assert_close(
        grpo_advantages(scores, ids, scale="batch", eps=0.0), torch.tensor([2 / 3, -1 / 3, -1 / 3, 0, 0, 0]) / batch_std
    )


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_no_host_sync(scale):
    scores = torch.randn(16, generator=torch.Generator().manual_seed(4))
    ids = torch.arange(16) % 5
    assert_no_host_sync(lambda s, i: grpo_advantages(s, i, scale=scale), scores, ids)


def test_grpo_gradcheck():
    g = torch.Generator().manual_seed(5)
    s = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.tensor([0, 1, 0, 1, 2, 0, 1])
    for scale in ("group", "batch", "none"):
        assert torch.autograd.gradcheck(lambda x: grpo_advantages(x, ids, scale=scale), (s,))


def test_grpo_bad_input():
    s, ids = torch.zeros(4), torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="scale.*'group', 'batch', 'none'"):
        grpo_advantages(s, ids, scale="std")
    with pytest.raises(ValueError, match="group_ids.*integer"):
        grpo_advantages(s, ids.float())
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(s, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="scores"):
        grpo_advantages(torch.zeros(4, 2), ids)
    with pytest.raises(ValueError, match="num_groups"):
        grpo_advantages(s, ids, num_groups=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@settings(max_examples=20)
@given(scores_ids=grouped_scores(patterns=("constant", "binary", "normal", "offset")))
def test_grpo_declared_group_size_matches_reference(dtype, scale, scores_ids):
    """Contiguous equal groups declared with ``group_size``: the same advantages as the general path."""
    scores, ids = scores_ids
    size = int(segment_sum(torch.ones_like(scores), ids).max())
    n = int(ids.max()) + 1
    # Pad every group to the largest size with copies of its first score, then lay them out contiguously.
    rows = [scores[ids == g] for g in range(n)]
    x = torch.cat([torch.cat([r, r[:1].expand(size - len(r))]) for r in rows]).to(dtype)
    layout = torch.arange(n * size) // size
    got = grpo_advantages(x, layout, scale=scale, group_size=size)
    assert got.dtype == dtype
    assert_close(got, ref.grpo_advantages_ref(x, layout, scale=scale), dtype=dtype, scale=_magnitude(x) + 10)
    torch.testing.assert_close(got, grpo_advantages(x, layout, scale=scale), rtol=1e-6, atol=1e-6)
    assert torch.equal(grpo_advantages(x, None, scale=scale, group_size=size), got)
    flat = (x.view(n, size) == x.view(n, size)[:, :1]).all(1).repeat_interleave(size)
    assert torch.equal(got[flat], torch.zeros_like(got[flat]))


def test_grpo_group_size_bad_input_and_no_host_sync():
    s = torch.randn(8)
    with pytest.raises(ValueError, match="group_ids: got ids that are not the contiguous layout"):
        grpo_advantages(s, torch.arange(8) % 2, group_size=4)
    with pytest.raises(ValueError, match="group_size: got 3"):
        grpo_advantages(s, torch.arange(8) // 4, group_size=3)
    with pytest.raises(ValueError, match="num_groups: got 3"):
        grpo_advantages(s, torch.arange(8) // 4, group_size=4, num_groups=3)
    with pytest.raises(ValueError, match="group_ids: got None"):
        grpo_advantages(s, None)
    assert grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), group_size=4).shape == (0,)
    assert grpo_advantages(torch.zeros(0), None, group_size=4).shape == (0,)
    assert_no_host_sync(lambda a: grpo_advantages(a, torch.arange(8) // 4, group_size=4), s)
    assert_no_host_sync(lambda a: grpo_advantages(a, None, group_size=4), s)


# -------------------------------------------------------------- RLOO, GPG, OPO, ReMax


@given(scores_ids=grouped_scores())
def test_rloo_matches_leave_one_out(scores_ids):
    scores, ids = scores_ids
    got = rloo_advantages(scores, ids)
    assert_close(got, ref.rloo_advantages_ref(scores, ids), scale=_magnitude(scores) * 4)


@settings(max_examples=20)
@given(scores_ids=grouped_scores(dtype=torch.bfloat16, patterns=("normal", "binary", "constant")))
def test_rloo_bfloat16(scores_ids):
    scores, ids = scores_ids
    got = rloo_advantages(scores, ids)
    assert got.dtype == torch.bfloat16
    assert_close(got, ref.rloo_advantages_ref(scores, ids), scale=_magnitude(scores) * 4)


@given(scores_ids=grouped_scores(dtype=torch.float64))
def test_rloo_sums_to_zero_and_flat_groups_are_zero(scores_ids):
    scores, ids = scores_ids
    got = rloo_advantages(scores, ids)
    n = int(ids.max()) + 1
    sums = segment_sum(got, ids, num_segments=n)
    assert_close(sums, torch.zeros_like(sums), scale=_magnitude(scores) * 10)
    flat = (segment_std(scores, ids, num_segments=n) == 0)[ids]
    assert torch.equal(got[flat], torch.zeros_like(got[flat]))


@pytest.mark.parametrize("alpha", [1.0, 0.5, "auto"])
@given(scores_ids=grouped_scores(), f_norm=st.sampled_from([1.0, 2.5]))
def test_gpg_matches_reference(alpha, scores_ids, f_norm):
    scores, ids = scores_ids
    got = gpg_advantages(scores, ids, f_norm=f_norm, alpha=alpha)
    want = ref.gpg_advantages_ref(scores, ids, f_norm=f_norm, alpha=alpha)
    assert_close(got, want, scale=_magnitude(want))


@given(scores_ids=grouped_scores(), data=st.data())
def test_opo_matches_reference(scores_ids, data):
    scores, ids = scores_ids
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, 50), min_size=len(ids), max_size=len(ids))))
    got = opo_advantages(scores, ids, lengths)
    assert_close(got, ref.opo_advantages_ref(scores, ids, lengths), scale=_magnitude(scores) * 4)


def test_opo_equal_lengths_is_plain_centring():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    ids = torch.tensor([0, 0, 0, 1, 1])
    got = opo_advantages(scores, ids, torch.full((5,), 7))
    torch.testing.assert_close(got, grpo_advantages(scores, ids, scale="none"))


@settings(max_examples=20)
@given(scores_ids=grouped_scores(dtype=torch.bfloat16, patterns=("normal", "binary", "constant")), data=st.data())
def test_gpg_opo_remax_bfloat16(scores_ids, data):
    scores, ids = scores_ids
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, 20), min_size=len(ids), max_size=len(ids))))
    base = scores.flip(0)
    for got, want in (
        (gpg_advantages(scores, ids, alpha="auto"), ref.gpg_advantages_ref(scores, ids, alpha="auto")),
        (opo_advantages(scores, ids, lengths), ref.opo_advantages_ref(scores, ids, lengths)),
        (remax_advantages(scores, base), ref.remax_advantages_ref(scores, base)),
    ):
        assert got.dtype == torch.bfloat16
        assert_close(got, want, scale=_magnitude(want) * 4)


@given(scores_ids=grouped_scores())
def test_remax_matches_reference(scores_ids):
    scores, _ = scores_ids
    base = scores.roll(1)
    assert_close(remax_advantages(scores, base), ref.remax_advantages_ref(scores, base), scale=_magnitude(scores))


def test_outcome_estimators_no_host_sync_and_gradients():
    g = torch.Generator().manual_seed(6)
    s = torch.randn(9, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 3])
    lengths = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5])
    greedy = torch.randn(9, dtype=torch.float64, generator=g)
    fns = {
        "rloo": lambda x: rloo_advantages(x, ids),
        "gpg": lambda x: gpg_advantages(x, ids, alpha="auto"),
        "opo": lambda x: opo_advantages(x, ids, lengths),
        "remax": lambda x: remax_advantages(x, greedy.to(x.dtype)),
    }
    for fn in fns.values():
        assert torch.autograd.gradcheck(fn, (s,))
        assert_no_host_sync(fn, s.detach().float())
    assert_no_host_sync(lambda x: passk_advantages(x, ids, k=3), (s.detach() > 0).float())


def test_outcome_bad_input():
    s, ids = torch.zeros(4), torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="alpha.*'auto'"):
        gpg_advantages(s, ids, alpha="paper")
    with pytest.raises(ValueError, match="f_norm"):
        gpg_advantages(s, ids, f_norm=0.0)
    with pytest.raises(ValueError, match="lengths"):
        opo_advantages(s, ids, torch.ones(3))
    with pytest.raises(ValueError, match="baseline_scores"):
        remax_advantages(s, torch.zeros(5))
    with pytest.raises(ValueError, match="k"):
        passk_advantages(s, ids, k=0)
    with pytest.raises(ValueError, match="group_ids"):
        rloo_advantages(s, ids.to(torch.float32))


# ------------------------------------------------------------------------------ pass@k


@settings(max_examples=30)
@given(scores_ids=grouped_scores(patterns=("binary",), max_size=7), k=st.integers(1, 5))
def test_passk_matches_subset_enumeration(scores_ids, k):
    scores, ids = scores_ids
    got = passk_advantages(scores, ids, k=k)
    assert_close(got, ref.passk_advantages_ref(scores, ids, k=k), scale=4.0)


@settings(max_examples=15)
@given(scores_ids=grouped_scores(patterns=("binary",), max_size=7, dtype=torch.bfloat16), k=st.integers(1, 5))
def test_passk_bfloat16(scores_ids, k):
    scores, ids = scores_ids
    got = passk_advantages(scores, ids, k=k)
    assert got.dtype == torch.bfloat16
    assert_close(got, ref.passk_advantages_ref(scores, ids, k=k), scale=4.0)


@given(scores_ids=grouped_scores(patterns=("binary",), dtype=torch.float64))
def test_passk_with_k_one_is_grpo_with_population_std(scores_ids):
    scores, ids = scores_ids
    n = int(ids.max()) + 1
    std = segment_std(scores, ids, num_segments=n, unbiased=False)[ids]
    centred = grpo_advantages(scores, ids, scale="none")
    want = torch.where(std > 0, centred / torch.where(std > 0, std, 1.0), 0.0)
    assert_close(passk_advantages(scores, ids, k=1), want)


def test_passk_hand_computed():
    # N = 4, one correct, k = 2: q = C(3,2)/C(4,2) = 1/2, sigma = 1/2,
    # A_correct = q / sigma = 1, A_wrong = (q - C(2,1)/C(3,1)) / sigma = -1/3.
    got = passk_advantages(torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long), k=2)
    torch.testing.assert_close(got, torch.tensor([-1 / 3, 1.0, -1 / 3, -1 / 3]))
    # -1/+1 rewards count the same way; an all-correct group gets 0.
    got = passk_advantages(torch.tensor([-1.0, 1.0, -1.0, -1.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0, 1, 1]), k=2)
    torch.testing.assert_close(got, torch.tensor([-1 / 3, 1.0, -1 / 3, -1 / 3, 0.0, 0.0]))


# --------------------------------------------------------------------- batch whitening


@given(batch=reward_batches())
def test_batch_normalize_matches_reference_and_masked_whiten(batch):
    x, m = batch["values"], batch["mask"]
    got = batch_normalize(x, m)
    want = ref.batch_normalize_ref(x, m)
    assert_close(got, want, scale=_magnitude(want) * 4)
    assert_close(got, masked_whiten(x, m), scale=_magnitude(want) * 4)
    scaled_only = batch_normalize(x, m, shift_mean=False)
    assert_close(scaled_only, ref.batch_normalize_ref(x, m, shift_mean=False), scale=_magnitude(x) * 4)


@given(scores_ids=grouped_scores(dtype=torch.bfloat16))
@settings(max_examples=20)
def test_batch_normalize_without_mask_bfloat16(scores_ids):
    scores, _ = scores_ids
    got = batch_normalize(scores, torch.ones_like(scores, dtype=torch.bool))
    assert got.dtype == torch.bfloat16
    want = ref.batch_normalize_ref(scores)
    assert_close(got, want, scale=_magnitude(want))


def test_batch_normalize_no_host_sync_and_gradcheck():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    m = torch.rand(3, 6, generator=g) > 0.3
    assert torch.autograd.gradcheck(lambda a: batch_normalize(a, m), (x,))
    assert_no_host_sync(lambda a, b: batch_normalize(a, b), x.detach().float(), m)
    with pytest.raises(ValueError, match="mask"):
        batch_normalize(x, m[:, :3])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_reprobe_reinforce_pp_baseline_non_finite_score_stays_in_its_own_group(bad):
    # As grpo_advantages (issue 18, defect 4): a NaN score made every group's advantage NaN.
    scores = torch.tensor([1.0, bad, 3.0, 4.0, 0.0, 2.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    mask = torch.tensor([[1, 1, 0]] * 6)
    adv = reinforce_pp_baseline_advantages(scores, ids, mask)
    assert not torch.isfinite(adv[:2][mask[:2] != 0]).any()
    want = reinforce_pp_baseline_advantages(scores[2:], ids[2:] - 1, mask[2:])
    torch.testing.assert_close(adv[2:], want)
    assert (adv[mask == 0] == 0).all()


def test_reprobe_negative_opo_lengths_are_refused_naming_lengths():
    # A negative length passed and shifted the group's baseline: advantages 2 and 1 for scores 1 and 0.
    s, ids = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"lengths: got values in \[-1, 4\], expected counts >= 0"):
        opo_advantages(s, ids, torch.tensor([-1, 2, 3, 4]))
    nan = opo_advantages(s, ids, torch.tensor([math.nan, 2.0, 3.0, 4.0]))  # NaN stays in its own group
    assert nan[:2].isnan().all() and nan[2:].isfinite().all()
