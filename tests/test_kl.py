"""KL estimators, KL folded into rewards, and the KL controllers."""

from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import rlcore.algos.kl
from rlcore.algos import (
    KL_ESTIMATORS,
    KLControllerState,
    adaptive_kl_controller,
    fixed_kl_controller,
    kl_in_reward,
    kl_penalty,
)
from rlcore.pytree import tree_leaves, tree_map
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.testing.algo_strategies import logp_batches

ESTIMATORS = list(KL_ESTIMATORS)


def test_doctests():
    result = doctest.testmod(rlcore.algos.kl, extraglobs={"torch": torch}, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=25)
@given(data=st.data())
def test_kl_penalty_matches_reference(estimator, dtype, data):
    batch = data.draw(logp_batches(dtype=dtype))
    got = kl_penalty(batch["logp"], batch["ref_logp"], estimator=estimator)
    assert got.dtype == dtype
    want = ref.kl_penalty_ref(batch["logp"], batch["ref_logp"], estimator=estimator)
    finite = want[torch.isfinite(want)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    assert_close(got, want, scale=scale)


def test_kl_penalty_hand_computed():
    lp, rp = torch.tensor([-1.0, -2.0, -30.0]), torch.tensor([-2.0, -1.0, 0.0])
    d = lp - rp  # [1, -1, -30]
    torch.testing.assert_close(kl_penalty(lp, rp), d)
    torch.testing.assert_close(kl_penalty(lp, rp, estimator="abs"), d.abs())
    torch.testing.assert_close(kl_penalty(lp, rp, estimator="k2"), torch.tensor([0.5, 0.5, 450.0]))
    e = torch.e
    # k3 = exp(-d) + d - 1; the last token's -d = 30 is clamped to 20 and the value to 10.
    torch.testing.assert_close(kl_penalty(lp, rp, estimator="k3"), torch.tensor([1 / e, e - 2, 10.0]))


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(batch=logp_batches(scales=("zero",)))
def test_kl_penalty_is_zero_for_identical_policies(estimator, dtype, batch):
    lp = batch["logp"].to(dtype)
    got = kl_penalty(lp, lp.clone(), estimator=estimator)
    m = batch["mask"]
    assert torch.equal(got[m], torch.zeros_like(got[m]))


@pytest.mark.parametrize("estimator", ["k2", "k3", "abs"])
@given(batch=logp_batches())
def test_kl_penalty_nonnegative_estimators(estimator, batch):
    got = kl_penalty(batch["logp"], batch["ref_logp"], estimator=estimator)
    vals = got[batch["mask"]]
    assert bool((vals >= 0).all())
    if estimator == "k3":
        assert bool((vals <= 10).all())


def _categorical(seed: int, vocab: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(vocab, dtype=torch.float64, generator=g, requires_grad=True)
    ref_logp = torch.log_softmax(torch.randn(vocab, dtype=torch.float64, generator=g), -1)
    return theta, ref_logp


@given(seed=st.integers(0, 2**20))
@settings(max_examples=20)
def test_k1_and_k3_are_unbiased_and_k2_has_the_reverse_kl_gradient(seed):
    """Exact expectations over a categorical policy: E[k1] = E[k3] = KL(pi || ref);
    the expected gradient of k2 (and of any estimator with straight_through) is grad KL(pi || ref),
    k3's is grad KL(ref || pi) and k1's is 0."""
    theta, rp = _categorical(seed)
    lp = torch.log_softmax(theta, -1)
    # k3's value is clamped to 10 (as verl and TRL do): unbiased only where the clamp does not bind.
    assume(bool((torch.exp(rp - lp) + (lp - rp) - 1 < 10).all()))
    pi = lp.exp()
    reverse = (pi * (lp - rp)).sum()
    forward = (rp.exp() * (rp - lp)).sum()
    for est in ("k1", "k3"):
        torch.testing.assert_close((pi * kl_penalty(lp, rp, estimator=est)).sum(), reverse)
    (g_rev,) = torch.autograd.grad(reverse, theta, retain_graph=True)
    (g_fwd,) = torch.autograd.grad(forward, theta, retain_graph=True)

    def expected_grad(est: str, st_: bool) -> torch.Tensor:
        surrogate = (pi.detach() * kl_penalty(lp, rp, estimator=est, straight_through=st_)).sum()
        return torch.autograd.grad(surrogate, theta, retain_graph=True)[0]

    torch.testing.assert_close(expected_grad("k2", False), g_rev)
    torch.testing.assert_close(expected_grad("k3", False), g_fwd)
    torch.testing.assert_close(expected_grad("k1", False), torch.zeros_like(g_rev), atol=1e-12, rtol=0)
    for est in ESTIMATORS:
        torch.testing.assert_close(expected_grad(est, True), g_rev)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@given(batch=logp_batches(scales=("small", "large", "extreme")))
@settings(max_examples=20)
def test_straight_through_keeps_value_and_takes_k2_gradient(estimator, batch):
    m = batch["mask"]
    lp = torch.where(m, batch["logp"], -1.0).double().requires_grad_(True)
    rp = torch.where(m, batch["ref_logp"], -1.0).double()
    value = kl_penalty(lp, rp, estimator=estimator, straight_through=True)
    torch.testing.assert_close(value, kl_penalty(lp, rp, estimator=estimator))
    (grad,) = torch.autograd.grad(value.sum(), lp)
    torch.testing.assert_close(grad, (lp - rp).detach())


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kl_penalty_gradcheck(estimator):
    g = torch.Generator().manual_seed(11)
    lp = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    rp = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: kl_penalty(a, b, estimator=estimator), (lp, rp))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kl_penalty_no_host_sync(estimator):
    g = torch.Generator().manual_seed(12)
    lp, rp = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    assert_no_host_sync(lambda a, b: kl_penalty(a, b, estimator=estimator, straight_through=True), lp, rp)


def test_kl_penalty_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="estimator.*'k1', 'k2', 'k3', 'abs'"):
        kl_penalty(x, x, estimator="low_var")
    with pytest.raises(ValueError, match="ref_logp"):
        kl_penalty(x, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="logp"):
        kl_penalty(torch.zeros(2, 3, dtype=torch.long), x)


# ---------------------------------------------------------------------- KL in reward


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=20)
@given(batch=logp_batches(scales=("zero", "small", "large")), coef=st.sampled_from([0.0, 0.05, 0.2]), data=st.data())
def test_kl_in_reward_matches_reference(estimator, dtype, batch, coef, data):
    m = batch["mask"]
    seed = data.draw(st.integers(0, 2**20))
    rewards = torch.where(m, torch.randn(m.shape, generator=torch.Generator().manual_seed(seed)), float("nan")).to(
        dtype
    )
    lp, rp = batch["logp"].to(dtype), batch["ref_logp"].to(dtype)
    got, metrics = kl_in_reward(rewards, lp, rp, m, kl_coef=coef, estimator=estimator)
    want, want_metrics = ref.kl_in_reward_ref(rewards, lp, rp, m, kl_coef=coef, estimator=estimator)
    assert got.dtype == dtype
    assert_close(got, want, scale=10.0)
    for key in ("kl", "kl_per_token"):
        assert not metrics[key].requires_grad
        assert_close(metrics[key], torch.tensor(want_metrics[key]), dtype=dtype, scale=10 * m.shape[1])


def test_kl_in_reward_takes_a_tensor_coefficient_and_no_gradient():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    rp = torch.tensor([[-1.5, -2.0, -0.5]])
    mask = torch.tensor([[1, 1, 0]])
    rewards = torch.tensor([[0.0, 1.0, float("nan")]])
    got, metrics = kl_in_reward(rewards, lp, rp, mask, kl_coef=torch.tensor(0.5))
    torch.testing.assert_close(got, torch.tensor([[-0.25, 1.0, 0.0]]))
    assert not got.requires_grad
    torch.testing.assert_close(metrics["kl"], torch.tensor(0.5))
    torch.testing.assert_close(metrics["kl_per_token"], torch.tensor(0.25))


def test_kl_in_reward_no_host_sync():
    g = torch.Generator().manual_seed(13)
    r, lp, rp = (torch.randn(3, 5, generator=g) for _ in range(3))
    m = torch.rand(3, 5, generator=g) > 0.3
    assert_no_host_sync(lambda *a: kl_in_reward(*a, kl_coef=torch.tensor(0.1), estimator="k3"), r, lp, rp, m)


def test_kl_in_reward_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="kl_coef"):
        kl_in_reward(x, x, x, x, kl_coef=-1.0)
    with pytest.raises(ValueError, match="mask"):
        kl_in_reward(x, x, x, torch.ones(2, 2), kl_coef=0.1)


# ----------------------------------------------------------------------- controllers


@given(
    kls=st.lists(st.floats(0.0, 20.0), min_size=1, max_size=8),
    n=st.integers(1, 512),
    init=st.sampled_from([0.2, 0.05]),
    target=st.sampled_from([6.0, 0.1]),
)
def test_adaptive_controller_matches_reference(kls, n, init, target):
    ctrl = adaptive_kl_controller(init_kl_coef=init, target=target, horizon=1000)
    state = ctrl.init()
    got = []
    for kl in kls:
        state = ctrl.update(torch.tensor(kl), state, n_steps=n)
        got.append(state.kl_coef)
    want = ref.adaptive_kl_coefs_ref(kls, [n] * len(kls), init_kl_coef=init, target=target, horizon=1000)
    assert_close(torch.stack(got), torch.tensor(want))


def test_adaptive_controller_direction_and_bounds():
    ctrl = adaptive_kl_controller()  # beta 0.2, target 6, horizon 10000
    s0 = ctrl.init()
    torch.testing.assert_close(s0.kl_coef, torch.tensor(0.2))
    up = ctrl.update(torch.tensor(100.0), s0, n_steps=10000)  # error clipped to +0.2
    down = ctrl.update(torch.tensor(0.0), s0, n_steps=10000)  # error clipped to -0.2
    same = ctrl.update(torch.tensor(6.0), s0, n_steps=10000)
    torch.testing.assert_close(up.kl_coef, torch.tensor(0.24))
    torch.testing.assert_close(down.kl_coef, torch.tensor(0.16))
    torch.testing.assert_close(same.kl_coef, torch.tensor(0.2))


def test_controllers_are_pure_pytrees_without_host_sync():
    fixed = fixed_kl_controller(kl_coef=0.05)
    adaptive = adaptive_kl_controller(init_kl_coef=0.1, target=1.0, horizon=64)
    for ctrl in (fixed, adaptive):
        state = ctrl.init()
        assert isinstance(state, KLControllerState)
        before = state.kl_coef.clone()
        new = assert_no_host_sync(lambda kl, s: ctrl.update(kl, s, n_steps=16), torch.tensor(3.0), state)
        assert torch.equal(state.kl_coef, before)  # the input state is not mutated
        assert len(tree_leaves(new)) == 1
        assert isinstance(tree_map(lambda x: x * 2, new), KLControllerState)
    torch.testing.assert_close(fixed.update(torch.tensor(9.0), fixed.init(), n_steps=4).kl_coef, torch.tensor(0.05))


def test_controller_bad_input():
    with pytest.raises(ValueError, match="target"):
        adaptive_kl_controller(target=0.0)
    with pytest.raises(ValueError, match="horizon"):
        adaptive_kl_controller(horizon=-1.0)
    with pytest.raises(ValueError, match="kl_coef"):
        fixed_kl_controller(kl_coef=-0.1)


# Re-probe of issue 18 ---------------------------------------------------------------------


@pytest.mark.parametrize("kl", [torch.tensor([1.0, 2.0]), torch.ones(2, 1), "3.0", [1.0]])
def test_reprobe_adaptive_update_rejects_a_non_scalar_kl_and_keeps_the_state(kl):
    # A [2] KL turned the coefficient into a [2] tensor; a string gave torch's raw TypeError.
    ctrl = adaptive_kl_controller()
    state = ctrl.init()
    with pytest.raises(ValueError, match="kl: got"):
        ctrl.update(kl, state, n_steps=1)
    assert state.kl_coef.shape == () and state.kl_coef.item() == pytest.approx(0.2)


@pytest.mark.parametrize("n_steps", [10**5, 10**6, torch.tensor(10**9)])
@pytest.mark.parametrize("kl", [0.0, 1e6])
def test_reprobe_adaptive_coefficient_stays_positive_and_bounded_when_n_steps_exceeds_the_horizon(n_steps, kl):
    # n_steps = 100 horizons made beta * (1 - 0.2 * 100) negative: a reward for diverging.
    ctrl = adaptive_kl_controller(init_kl_coef=0.2, target=6.0, horizon=1000)
    new = ctrl.update(torch.tensor(kl), ctrl.init(), n_steps=n_steps).kl_coef
    assert 0.2 * 0.8 - 1e-7 <= new.item() <= 0.2 * 1.2 + 1e-7
    # Up to one horizon the formula is the paper's, unchanged.
    small = ctrl.update(torch.tensor(kl), ctrl.init(), n_steps=500).kl_coef
    want = 0.2 * (1 + (-0.2 if kl == 0.0 else 0.2) * 500 / 1000)
    assert small.item() == pytest.approx(want)


def test_reprobe_update_rejects_a_state_of_another_type():
    ctrl = adaptive_kl_controller()
    with pytest.raises(ValueError, match="state: got tuple, expected a KLControllerState"):
        ctrl.update(torch.tensor(1.0), (0.2,), n_steps=1)


@pytest.mark.parametrize("kl_coef", [float("inf")])
def test_reprobe_controllers_reject_an_infinite_coefficient(kl_coef):
    with pytest.raises(ValueError, match="kl_coef: got inf"):
        fixed_kl_controller(kl_coef=kl_coef)
    with pytest.raises(ValueError, match="init_kl_coef: got inf"):
        adaptive_kl_controller(init_kl_coef=kl_coef)


def test_reprobe_kl_in_reward_names_a_bad_kl_coef():
    z = torch.zeros(2, 3)
    ctrl = adaptive_kl_controller()
    # The controller's state instead of its coefficient: a raw "'>=' not supported" TypeError.
    with pytest.raises(ValueError, match="kl_coef: got KLControllerState"):
        kl_in_reward(z, z, z, torch.ones(2, 3), kl_coef=ctrl.init())
    # A tensor that is not a scalar broadcast silently ([2, 1]) or raised torch's size error ([2]).
    for bad in (torch.ones(2), torch.ones(2, 1)):
        with pytest.raises(ValueError, match=r"kl_coef: got a tensor of shape"):
            kl_in_reward(z, z, z, torch.ones(2, 3), kl_coef=bad)
    shaped, _ = kl_in_reward(z, z - 1, z, torch.ones(2, 3), kl_coef=ctrl.init().kl_coef)
    torch.testing.assert_close(shaped, torch.full((2, 3), 0.2))  # r - beta * (logp - ref_logp)
