"""The decoupled PPO objective: behaviour weights, the interpolated proximal policy, and recipes that carry them."""

from __future__ import annotations

import doctest
import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlcore.algos.off_policy
from rlcore import algos
from rlcore.algos import behaviour_weights, decoupled, interpolated_prox_logp
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.testing.algo_strategies import logp_batches


def test_doctests():
    result = doctest.testmod(rlcore.algos.off_policy, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0


# --- behaviour weights ------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    batch=logp_batches(),
    mode=st.sampled_from(algos.BEHAVIOUR_MODES),
    cap=st.sampled_from([0.5, 1.0, 2.0, 5.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_behaviour_weights_match_the_reference(batch, mode, cap, dtype):
    prox, behav, mask = batch["logp"].to(dtype), batch["ref_logp"].to(dtype), batch["mask"]
    got = behaviour_weights(prox, behav, mask, cap=cap, mode=mode)
    want = ref.behaviour_weights_ref(prox, behav, mask, cap=cap, mode=mode)
    assert got.dtype == dtype
    assert_close(got, want)
    assert bool((got >= 0).all()) and bool((got <= cap * (1 + 1e-2)).all()) and bool((got[~mask] == 0).all())


@settings(max_examples=20, deadline=None)
@given(batch=logp_batches(), mode=st.sampled_from(algos.BEHAVIOUR_MODES))
def test_same_policies_weigh_one_exactly(batch, mode):
    """Staleness 0: the behaviour is the proximal policy and every weight is exactly 1 (for any cap >= 1)."""
    w = behaviour_weights(batch["logp"], batch["logp"].clone(), batch["mask"], cap=1.0, mode=mode)
    assert torch.equal(w, batch["mask"].to(w.dtype))


def test_behaviour_weights_are_detached_and_refuse_bad_input():
    prox = torch.zeros(2, 3, requires_grad=True)
    w = behaviour_weights(prox, torch.full((2, 3), -0.1), torch.ones(2, 3))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap"):
        behaviour_weights(prox, prox, torch.ones(2, 3), cap=0.0)
    with pytest.raises(ValueError, match="mode"):
        behaviour_weights(prox, prox, torch.ones(2, 3), mode="clip")
    with pytest.raises(ValueError, match="rollout_logp"):
        behaviour_weights(prox, prox[:, :2], torch.ones(2, 3))
    with pytest.raises(ValueError, match="cap"):
        decoupled(algos.grpo(), cap=-1.0)


# --- the interpolated proximal policy ---------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    batch=logp_batches(min_batch=1),
    versions=st.lists(st.integers(0, 6), min_size=6, max_size=6),
    prox=st.integers(0, 8),
    cur=st.integers(0, 8),
    per_token=st.booleans(),
)
def test_interpolated_prox_logp_matches_the_reference(batch, versions, prox, cur, per_token):
    behav, logp = batch["ref_logp"].nan_to_num(0.0), batch["logp"].nan_to_num(0.0)
    b, t = logp.shape
    v = torch.tensor(versions[:b])
    if per_token:
        v = (v[:, None] + torch.arange(t)[None, :] % 2).clamp(max=8)
    got = interpolated_prox_logp(behav, logp, behav_version=v, prox_version=prox, version=cur)
    want = ref.interpolated_prox_logp_ref(behav, logp, behav_version=v, prox_version=prox, version=cur)
    assert_close(got, want)


def test_interpolation_is_exact_at_both_ends():
    behav, logp = torch.tensor([[-2.0, -0.5]]), torch.tensor([[-1.0, -0.25]], requires_grad=True)
    v = torch.tensor([3])
    first_update = interpolated_prox_logp(behav, logp, behav_version=v, prox_version=5, version=5)
    assert torch.equal(first_update, logp.detach()) and not first_update.requires_grad
    staleness_0 = interpolated_prox_logp(behav, logp, behav_version=v, prox_version=3, version=5)
    assert torch.equal(staleness_0, behav)
    with pytest.raises(ValueError, match="behav_version"):
        interpolated_prox_logp(behav, logp, behav_version=torch.tensor([1, 2]), prox_version=1, version=2)


def test_no_host_sync():
    g = torch.Generator().manual_seed(0)
    prox = torch.randn(3, 5, generator=g) - 2
    behav = prox + 0.3 * torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    for mode in algos.BEHAVIOUR_MODES:
        assert_no_host_sync(functools.partial(behaviour_weights, mode=mode), prox, behav, mask)
    v = torch.tensor([0, 1, 2])
    assert_no_host_sync(
        lambda b, lp, vb: interpolated_prox_logp(b, lp, behav_version=vb, prox_version=2, version=3), behav, prox, v
    )


# --- recipes with the decoupled objective -------------------------------------------------------------


def _batch(g: torch.Generator, b: int = 4, t: int = 6, dtype: torch.dtype = torch.float32, lag: float = 0.3):
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[:, 0] = True
    old = (torch.rand(b, t, generator=g) * 3 - 3).to(dtype)
    logp = (old.double() + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    return {
        "logp": logp,
        "old_logp": old,
        "rollout_logp": (old.double() + lag * torch.randn(b, t, generator=g, dtype=torch.float64)).to(dtype),
        "advantages": torch.randn(b, t, generator=g).to(dtype),
        "mask": mask.float(),
        "entropy": torch.rand(b, t, generator=g).to(dtype),
        "ref_logp": old - 0.05,
    }


RECIPES = {
    "grpo": algos.grpo(kl_coef=0.04),
    "dapo": algos.dapo(),
    "gspo": algos.gspo(),
    "cispo": algos.grpo(kl_coef=0.0)._replace(policy_loss=algos.cispo_loss),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_at_staleness_zero_the_decoupled_loss_is_the_recipes_exactly(name, dtype):
    """rollout_logp == old_logp: the same loss and the same gradient, bit for bit."""
    algo = RECIPES[name]
    batch = _batch(torch.Generator().manual_seed(1), dtype=dtype)
    batch["rollout_logp"] = batch["old_logp"].clone()
    grads, losses = [], []
    for recipe in (algo, decoupled(algo, cap=1.0), decoupled(algo, mode="mask", cap=1.0)):
        logp = batch["logp"].detach().clone().requires_grad_()
        loss, metrics = recipe.loss({**batch, "logp": logp}, **recipe.global_counts(batch))
        loss.backward()
        losses.append(loss.detach())
        grads.append(logp.grad)
    for loss, grad in zip(losses[1:], grads[1:]):
        assert torch.equal(loss, losses[0]) and torch.equal(grad, grads[0])
    assert float(metrics["behaviour_weight"]) == 1.0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(algos.BEHAVIOUR_MODES), cap=st.sampled_from([1.5, 3.0]))
def test_the_decoupled_loss_weighs_each_tokens_policy_loss(seed, mode, cap):
    """loss = aggregate(w_t * pg_t) with w from the loop reference, on GRPO's PPO-clip loss and aggregation."""
    algo = algos.grpo(kl_coef=0.0)
    batch = _batch(torch.Generator().manual_seed(seed), lag=0.8)
    got, metrics = decoupled(algo, cap=cap, mode=mode).loss(batch, **algo.global_counts(batch))
    got = got.detach()
    pg_t, _ = algo.policy_loss(batch["logp"].detach(), batch["old_logp"], batch["advantages"], batch["mask"])
    w = ref.behaviour_weights_ref(batch["old_logp"], batch["rollout_logp"], batch["mask"], cap=cap, mode=mode)
    keep = batch["mask"] != 0
    want = algos.aggregate((pg_t.double() * w).where(keep, 0.0), batch["mask"], mode=algo.agg_mode)
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    assert float(metrics["behaviour_weight"]) == pytest.approx(float(w[keep].mean()), rel=1e-5)


def test_gradcheck_of_the_decoupled_loss():
    batch = _batch(torch.Generator().manual_seed(3), dtype=torch.float64, lag=0.5)
    algo = decoupled(algos.grpo(kl_coef=0.0), cap=2.0)
    counts = algo.global_counts(batch)

    def f(logp: torch.Tensor) -> torch.Tensor:
        return algo.loss({**batch, "logp": logp}, **counts)[0]

    assert torch.autograd.gradcheck(f, (batch["logp"].detach().clone().requires_grad_(),))


def test_a_decoupled_recipe_without_the_samplers_log_probs_is_refused():
    batch = _batch(torch.Generator().manual_seed(0))
    del batch["rollout_logp"]
    algo = decoupled(algos.grpo())
    with pytest.raises(ValueError, match="rollout_logp"):
        algo.loss(batch, **algo.global_counts(batch))


def test_weights_reduce_the_loss_of_tokens_the_sampler_found_likelier():
    """A token the behaviour found likelier than the proximal policy does (w < 1) counts for less."""
    algo = algos.grpo(kl_coef=0.0)
    batch = {
        "logp": torch.zeros(1, 2, requires_grad=True),
        "old_logp": torch.zeros(1, 2),
        "rollout_logp": torch.tensor([[0.0, 0.5]]),
        "advantages": torch.ones(1, 2),
        "mask": torch.ones(1, 2),
    }
    loss, _ = decoupled(algo).loss(batch, **algo.global_counts(batch))
    loss.backward()
    grad = batch["logp"].grad[0]
    assert float(grad[1] / grad[0]) == pytest.approx(math.exp(-0.5), rel=1e-6)
