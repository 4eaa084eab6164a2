"""DPPO (TV and binary-KL trust regions), DRO, the entropy-controlling Clip-Cov and KL-Cov, and
the adaptive entropy bonus: against their loop references, their identities with PPO and CISPO,
gradients and compilation."""

import functools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.algos import policy_losses
from rlcore.testing import assert_close
from rlcore.testing import reference as ref
from rlcore.testing.loss_strategies import policy_batches

INPUTS = ("logp", "old_logp", "advantages", "mask")
HYPER = {
    "dppo_tv": st.fixed_dictionaries(
        {
            "clip_low": st.sampled_from([0.05, 0.15]),
            "clip_high": st.sampled_from([0.1, 0.15]),
            "ratio_cap": st.sampled_from([None, 2.0, 20.0]),
        }
    ),
    "dppo_kl": st.fixed_dictionaries(
        {
            "clip_low": st.sampled_from([0.01, 0.05]),
            "clip_high": st.sampled_from([0.05, 0.2]),
            "ratio_cap": st.sampled_from([None, 2.0, 20.0]),
        }
    ),
    "dro": st.fixed_dictionaries({"beta": st.sampled_from([0.05, 1.0])}),
    "clip_cov": st.fixed_dictionaries(
        {
            "cov_fraction": st.sampled_from([2e-4, 0.1, 0.5]),
            "cov_low": st.sampled_from([0.0, 1.0]),
            "cov_high": st.sampled_from([5.0, 50.0]),
            "clip_low": st.sampled_from([0.2, 1.0]),
            "clip_high": st.sampled_from([0.28, 1.0]),
        }
    ),
    "kl_cov": st.fixed_dictionaries(
        {"cov_fraction": st.sampled_from([2e-4, 0.1, 0.5]), "kl_coef": st.sampled_from([0.1, 1.0])}
    ),
}
IMPL = {
    "dppo_tv": algos.dppo_tv_loss,
    "dppo_kl": algos.dppo_kl_loss,
    "dro": algos.dro_loss,
    "clip_cov": algos.clip_cov_loss,
    "kl_cov": algos.kl_cov_loss,
}
REF = {
    "dppo_tv": ref.dppo_tv_loss_ref,
    "dppo_kl": ref.dppo_kl_loss_ref,
    "dro": ref.dro_loss_ref,
    "clip_cov": ref.clip_cov_loss_ref,
    "kl_cov": ref.kl_cov_loss_ref,
}
DEFAULTS = {"dro": {"beta": 0.1}}


def _run(fn, batch, **kw):
    logp = batch["logp"].clone().requires_grad_(True)
    loss, metrics = fn(logp, batch["old_logp"], batch["advantages"], batch["mask"], **kw)
    loss.sum().backward()
    return loss, logp.grad, metrics


def _clear_cut(batch, fraction: float) -> bool:
    """The covariance ranking has no near-tie at KL-Cov's cut (rounding could order such tokens either way)."""
    keep = batch["mask"]
    adv, lp = batch["advantages"].double()[keep], batch["logp"].double()[keep]
    cov = ((adv - adv.mean()) * (lp - lp.mean())).sort(descending=True).values
    k = max(int(fraction * cov.numel()), 1)
    return k >= cov.numel() or float(cov[k - 1] - cov[k]) > 1e-4 * max(1.0, float(cov.abs().max()))


def _scale(x: torch.Tensor) -> float:
    return max(1.0, float(x.abs().max()) if x.numel() else 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(IMPL))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_matches_loop_reference(name, dtype, data):
    batch = data.draw(policy_batches(dtype=dtype, drifts=("none", "small", "large")), label="batch")
    kw = data.draw(HYPER[name], label="hyper")
    if name == "kl_cov":
        assume(_clear_cut(batch, kw["cov_fraction"]))
    if name == "clip_cov":
        kw["noise"] = torch.rand(
            batch["mask"].shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
        )
    loss, grad, metrics = _run(IMPL[name], batch, **kw)
    want_loss, want_grad, want_metrics = REF[name](*(batch[k] for k in INPUTS), **kw)
    assert loss.dtype == dtype and grad.dtype == dtype
    assert_close(loss, want_loss, dtype=dtype, scale=_scale(want_loss))
    assert_close(grad, want_grad, dtype=dtype, scale=_scale(want_grad))
    assert set(metrics) == set(want_metrics)
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad and value.dtype == torch.float32, key
        mscale = max(1.0, abs(want_metrics[key]))
        assert_close(value, torch.tensor(want_metrics[key]), dtype=torch.float32, scale=mscale * 10, msg=key)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "dro", "kl_cov"])
@settings(max_examples=10, deadline=None)
@given(batch=policy_batches(drifts=("none",), dtype=torch.float64))
def test_on_policy_gradient_is_the_policy_gradient(name, batch):
    """With logp == old_logp every token is inside its trust region and the penalties have zero slope."""
    batch["old_logp"] = batch["logp"]
    _, grad, _ = _run(IMPL[name], batch, **DEFAULTS.get(name, {}))
    want = torch.where(batch["mask"], -batch["advantages"], 0.0)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=15, deadline=None)
@given(batch=policy_batches(drifts=("small", "large", "extreme")))
def test_dppo_with_an_unbounded_region_is_uncapped_cispo(batch):
    """A TV bound of 1 admits every move of a probability: DPPO is then CISPO without its clip."""
    args = [batch[k] for k in INPUTS]
    dppo, dgrad, _ = _run(algos.dppo_tv_loss, batch, clip_low=1.0, clip_high=1.0, ratio_cap=None)
    cispo, cgrad, _ = _run(algos.cispo_loss, batch, clip_low=None, clip_high=math.inf)
    torch.testing.assert_close(dppo, cispo, rtol=0, atol=0)
    torch.testing.assert_close(dgrad, cgrad, rtol=0, atol=0)
    _, metrics = algos.dppo_tv_loss(*args, clip_low=1.0, clip_high=1.0)
    assert float(metrics["trust_region_frac"]) == 0.0


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
@settings(max_examples=15, deadline=None)
@given(batch=policy_batches(drifts=("small", "large"), dtype=torch.float64), data=st.data())
def test_dppo_trust_region_grows_with_its_bound(name, batch, data):
    """A token inside the region of a bound is inside the region of every larger bound, and
    a token outside has zero gradient."""
    small = data.draw(st.sampled_from([0.01, 0.05]))
    big = small + data.draw(st.sampled_from([0.01, 0.1, 0.5]))
    _, g_small, _ = _run(IMPL[name], batch, clip_low=small, clip_high=small, ratio_cap=None)
    _, g_big, _ = _run(IMPL[name], batch, clip_low=big, clip_high=big, ratio_cap=None)
    inside_small = g_small != 0
    assert torch.equal(g_big[inside_small], g_small[inside_small])
    # Moves against the advantage are never masked by the binary KL.
    if name == "dppo_kl":
        mask, adv = batch["mask"], batch["advantages"]
        against = mask & (
            ((adv > 0) & (batch["logp"] <= batch["old_logp"])) | ((adv < 0) & (batch["logp"] >= batch["old_logp"]))
        )
        assert torch.all(g_small[against] != 0)


def test_dppo_hand_computed_binary_kl_region():
    # p_old = 0.5 -> p = 0.6: KL = 0.5 log(0.5/0.6) + 0.5 log(0.5/0.4) = 0.0204 (inside 0.05, outside 0.01).
    logp = torch.log(torch.tensor([[0.6, 0.6, 0.4]], dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.full((1, 3), 0.5, dtype=torch.float64))
    adv = torch.tensor([[1.0, 2.0, 1.0]], dtype=torch.float64)
    kl = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4)
    assert 0.01 < kl < 0.05
    loss, m = algos.dppo_kl_loss(logp, old, adv, torch.ones(1, 3), clip_high=0.01)
    loss.sum().backward()
    # Tokens 0, 1 moved up by a KL of 0.0204 > 0.01 with A > 0: masked; token 2 moved down: inside.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -0.8]], dtype=torch.float64))
    assert float(m["trust_region_frac"]) == pytest.approx(2 / 3)
    # A probability of 1 from below is infinitely far; one that already was 1 is not.
    inf_kl = algos.dppo_kl_loss(
        torch.zeros(1, 2, dtype=torch.float64),
        torch.tensor([[-0.1, 0.0]], dtype=torch.float64),
        torch.ones(1, 2),
        torch.ones(1, 2),
    )[1]
    assert float(inf_kl["trust_region_frac"]) == 0.5


def test_dro_hand_computed_penalty_and_unclamped_gradient():
    # l = 30 is past the +-20 clamp of the ratio: the quadratic still pulls back with beta * l.
    logp = torch.tensor([[-1.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-31.0, -0.5]], dtype=torch.float64)
    adv = torch.tensor([[0.0, 2.0]], dtype=torch.float64)
    loss, m = algos.dro_loss(logp, old, adv, torch.ones(1, 2), beta=0.1)
    loss.sum().backward()
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.05 * 900, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(logp.grad, torch.tensor([[3.0, -2.0]], dtype=torch.float64))
    assert float(m["log_ratio_sq"]) == pytest.approx(450.0)


@settings(max_examples=15, deadline=None)
@given(batch=policy_batches())
def test_kl_cov_without_penalty_is_the_unclipped_surrogate(batch):
    kl, kgrad, _ = _run(algos.kl_cov_loss, batch, kl_coef=0.0)
    ppo, pgrad, _ = _run(algos.ppo_clip_loss, batch, clip_low=1.0, clip_high=math.inf)
    torch.testing.assert_close(kl, ppo, rtol=0, atol=0)
    torch.testing.assert_close(kgrad, pgrad, rtol=0, atol=0)


@settings(max_examples=15, deadline=None)
@given(
    batch=policy_batches(drifts=("small", "large"), dtype=torch.float64), frac=st.sampled_from([2e-4, 0.1, 0.3, 1.0])
)
def test_kl_cov_penalises_exactly_its_share_of_tokens(batch, frac):
    n = int(batch["mask"].sum())
    _, metrics = algos.kl_cov_loss(*(batch[k] for k in INPUTS), cov_fraction=frac)
    want = max(int(frac * n), 1) if n else 0
    assert round(float(metrics["cov_frac"]) * n) == want


@settings(max_examples=15, deadline=None)
@given(batch=policy_batches(drifts=("small", "large")), frac=st.sampled_from([2e-4, 0.2, 1.0]), seed=st.integers(0, 9))
def test_clip_cov_cuts_at_most_its_share_and_leaves_ppo_elsewhere(batch, frac, seed):
    noise = torch.rand(batch["mask"].shape, generator=torch.Generator().manual_seed(seed))
    loss, grad, _ = _run(algos.clip_cov_loss, batch, cov_fraction=frac, cov_low=0.0, noise=noise)
    ppo, pgrad, _ = _run(algos.ppo_clip_loss, batch, clip_low=1.0, clip_high=1.0)
    n = int(batch["mask"].sum())
    cut = batch["mask"] & (loss != ppo)
    assert int(cut.sum()) <= max(int(frac * n), 1)
    assert torch.all(loss[cut] == 0) and torch.all(grad[cut] == 0)
    torch.testing.assert_close(loss[~cut], ppo[~cut], rtol=0, atol=0)
    torch.testing.assert_close(grad[~cut], pgrad[~cut], rtol=0, atol=0)
    # An empty covariance band cuts nothing: Clip-Cov is PPO.
    none, _, m = _run(algos.clip_cov_loss, batch, cov_low=1e30, cov_high=2e30, noise=noise)
    torch.testing.assert_close(none, ppo, rtol=0, atol=0)
    assert float(m["cov_frac"]) == 0.0


def test_clip_cov_draws_uniformly_among_eligible_tokens():
    # Four tokens with covariance 4 (eligible), cut one at a time: each is cut about a quarter of the time.
    logp = torch.log(torch.tensor([[0.9, 0.9, 0.1, 0.1, 0.5, 0.5, 0.5, 0.5]]))
    adv = torch.tensor([[2.0, 2.0, -2.0, -2.0, 0.0, 0.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(8)
    for _ in range(200):
        loss, _ = algos.clip_cov_loss(
            logp, logp, adv, torch.ones(1, 8), cov_fraction=1 / 8, cov_low=0.5, noise=torch.rand(1, 8, generator=g)
        )
        counts += (loss[0] == 0) & (adv[0] != 0)
    assert counts[4:].sum() == 0 and counts.sum() == 200
    assert torch.all((counts[:4] > 30) & (counts[:4] < 70)), counts


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(
        st.sampled_from([-math.inf, -1.0, 0.0, 0.5, 2.0, math.inf]) | st.floats(-5, 5), min_size=1, max_size=90
    ),
    k=st.integers(1, 12),
    chunk=st.integers(1, 20),
)
def test_chunked_top_values_equal_topk_ties_and_infinities_included(keys, k, chunk):
    flat = torch.tensor(keys)
    k = min(k, flat.numel())
    assert torch.equal(policy_losses._top_values(flat, k, chunk=chunk), flat.topk(k).values)


def test_clip_cov_default_draw_is_uniform_over_every_position():
    # Every token eligible (the band is everything, no ratio clipped), one of 15 cut per call, drawn
    # by the loss itself: each position, the two halves of each int64 draw and the odd last one
    # alike, is cut about 1/15 of the time (100 of 1500; 60 and 140 are 4 standard deviations out).
    g = torch.Generator().manual_seed(1)
    logp = torch.rand(3, 5, generator=g).log()
    adv = torch.randn(3, 5, generator=g)
    torch.manual_seed(0)
    counts = torch.zeros(3, 5)
    for _ in range(1500):
        loss, metrics = algos.clip_cov_loss(
            logp, logp, adv, torch.ones(3, 5), cov_fraction=1 / 15, cov_low=-1e9, cov_high=1e9
        )
        counts += loss == 0
        assert metrics["cov_frac"] == pytest.approx(1 / 15)
    assert counts.sum() == 1500
    assert torch.all((counts > 60) & (counts < 140)), counts


def _compile_batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A small batch for the compiled-whole checks: ``logp``, ``old_logp``, advantages, a scattered mask."""
    logp = torch.rand(4, 6, generator=g).log()
    old = logp + 0.5 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    return logp, old, adv, torch.rand(4, 6, generator=g) > 0.3


def test_clip_cov_default_draw_compiles_whole_and_matches_eager_on_the_same_seed():
    logp, old, adv, mask = _compile_batch(torch.Generator().manual_seed(3))

    def step(lp):
        loss, metrics = algos.clip_cov_loss(lp, old, adv, mask, cov_fraction=0.2, cov_low=0.0)
        return algos.aggregate(loss, mask, mode="token-mean"), metrics["cov_frac"]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")  # a host sync would break the graph
    out = []
    for f in (step, compiled):
        torch.manual_seed(5)
        lp = logp.clone().requires_grad_(True)
        loss, frac = f(lp)
        loss.backward()
        out.append((loss, frac, lp.grad))
    assert out[0][1] > 0
    for a, b in zip(out[0], out[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(IMPL))
@settings(max_examples=10, deadline=None)
@given(batch=policy_batches(drifts=("small", "large")), seed=st.integers(0, 9))
def test_ratio_stats_off_drops_only_the_ratio_extremes(name, batch, seed):
    kw = {**DEFAULTS.get(name, {})}
    if name == "clip_cov":
        kw["noise"] = torch.rand(batch["mask"].shape, generator=torch.Generator().manual_seed(seed))
    loss, grad, metrics = _run(IMPL[name], batch, **kw)
    lean_loss, lean_grad, lean = _run(IMPL[name], batch, **kw, ratio_stats=False)
    torch.testing.assert_close(lean_loss, loss, rtol=0, atol=0)
    torch.testing.assert_close(lean_grad, grad, rtol=0, atol=0)
    assert set(lean) == set(metrics) - {"ratio_mean", "ratio_min", "ratio_max"}
    for key, value in lean.items():
        torch.testing.assert_close(value, metrics[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("frac", [0.05, 0.3, 0.5])
def test_kl_cov_selection_breaks_ties_by_position_on_both_paths(frac):
    """Equal covariances are penalised in row-major order; the top-k path (a boolean mask) and the
    whole-batch sort (a weighted mask) select the same tokens, ties included."""
    g = torch.Generator().manual_seed(0)
    b, t = 6, 10
    logp = torch.rand(b, t, generator=g).clamp(min=0.05).log()
    old = logp - 0.3 * torch.randn(b, t, generator=g)
    # Two advantage levels and two log-prob levels: four covariance values, many ties each.
    adv = torch.where(torch.rand(b, t, generator=g) > 0.5, 1.0, -1.0)
    logp = torch.where(torch.rand(b, t, generator=g) > 0.5, -0.5, -2.0)
    mask = torch.rand(b, t, generator=g) > 0.2
    loss, grad, _ = _run(algos.kl_cov_loss, {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask})
    wloss, wgrad, _ = _run(algos.kl_cov_loss, {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask.double()})
    torch.testing.assert_close(loss, wloss.float(), rtol=0, atol=0)
    torch.testing.assert_close(grad, wgrad.float(), rtol=0, atol=0)
    want_loss, want_grad, _ = ref.kl_cov_loss_ref(logp, old, adv, mask, cov_fraction=frac)
    loss, grad, _ = _run(
        algos.kl_cov_loss, {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask}, cov_fraction=frac
    )
    assert_close(loss, want_loss, dtype=torch.float32)
    assert_close(grad, want_grad, dtype=torch.float32)


# DPPO's weight is a stop-gradient ratio (as CISPO's): its loss value is not the function
# whose gradient it returns, so finite differences do not apply; the loop reference checks it.
@pytest.mark.parametrize("name", ["dro", "clip_cov", "kl_cov"])
def test_gradcheck_float64(name):
    g = torch.Generator().manual_seed(7)
    logp = torch.rand(3, 5, generator=g, dtype=torch.float64).log()
    old = logp + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [1, 0, 0, 0, 0]])
    kw = {
        "dro": {"beta": 0.5},
        "clip_cov": {"cov_fraction": 0.2, "cov_low": 0.0, "noise": torch.rand(3, 5, generator=g)},
    }
    kw["kl_cov"] = {"cov_fraction": 0.3}
    fn = functools.partial(IMPL[name], **kw.get(name, {}))
    assert torch.autograd.gradcheck(lambda lp: fn(lp, old, adv, mask)[0], (logp.requires_grad_(True),))


@pytest.mark.parametrize("name", list(IMPL))
def test_bad_inputs_raise_value_error_naming_the_argument(name):
    fn = functools.partial(IMPL[name], **DEFAULTS.get(name, {}))
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logp"):
        fn(x, torch.zeros(2, 4), x, torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        fn(x, x, torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        fn(x, x, x, torch.ones(3, 2))
    with pytest.raises(ValueError, match="logp"):
        fn(torch.zeros(2, 3, dtype=torch.long), x, x, torch.ones(2, 3))


def test_bad_hyperparameters_raise():
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    cases = [
        (algos.dppo_tv_loss, {"clip_high": -0.1}, "clip_high"),
        (algos.dppo_kl_loss, {"ratio_cap": 0.0}, "ratio_cap"),
        (algos.dro_loss, {"beta": 0.0}, "beta"),
        (algos.clip_cov_loss, {"cov_fraction": 0.0}, "cov_fraction"),
        (algos.clip_cov_loss, {"cov_low": 5.0, "cov_high": 1.0}, "cov_high"),
        (algos.clip_cov_loss, {"noise": torch.rand(2)}, "noise"),
        (algos.kl_cov_loss, {"cov_fraction": 1.5}, "cov_fraction"),
        (algos.kl_cov_loss, {"kl_coef": -1.0}, "kl_coef"),
    ]
    for fn, kw, name in cases:
        with pytest.raises(ValueError, match=name):
            fn(x, x, x, m, **kw)


@pytest.mark.parametrize("name", list(IMPL))
def test_no_host_sync_forward_and_backward(name):
    """Compiled whole (fullgraph: a host sync would break the graph), forward and backward match eager."""
    g = torch.Generator().manual_seed(3)
    logp, old, adv, mask = _compile_batch(g)
    kw = {
        **DEFAULTS.get(name, {}),
        **({"noise": torch.rand(4, 6, generator=g), "cov_low": 0.0} if name == "clip_cov" else {}),
    }
    fn = functools.partial(IMPL[name], **kw, **({"cov_fraction": 0.2} if "cov" in name else {}))

    def step(lp):
        loss, metrics = fn(lp, old, adv, mask)
        return algos.aggregate(loss, mask, mode="token-mean"), metrics

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    out = []
    for f in (step, compiled):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = f(lp)
        loss.backward()
        out.append((loss.detach(), lp.grad, metrics))
    torch.testing.assert_close(out[1][:2], out[0][:2])
    torch.testing.assert_close(out[1][2], out[0][2])


@settings(max_examples=20, deadline=None)
@given(
    entropies=st.lists(
        st.one_of(st.floats(0.0, 1.0), st.sampled_from([float("nan"), float("inf")])), min_size=1, max_size=30
    ),
    target=st.sampled_from([0.2, 0.5]),
    delta=st.sampled_from([0.005, 0.1]),
    init=st.sampled_from([0.0, 0.05]),
    cap=st.sampled_from([None, 0.2]),
)
def test_adaptive_entropy_controller_matches_loop_reference(entropies, target, delta, init, cap):
    ctrl = algos.adaptive_entropy_controller(target=target, delta=delta, init_coef=init, max_coef=cap)
    want = ref.adaptive_entropy_coefs_ref(entropies, target=target, delta=delta, init_coef=init, max_coef=cap)
    state = ctrl.init()
    for h, (alpha, coef) in zip(entropies, want):
        state = ctrl.update(torch.tensor(h), state)
        assert state.alpha.dtype == torch.float32 and state.entropy_coef.dtype == torch.float32
        assert abs(float(state.alpha) - alpha) < 1e-5 and abs(float(state.entropy_coef) - coef) < 1e-5
        assert float(state.alpha) >= 0 and (cap is None or float(state.alpha) <= cap + 1e-7)


def test_adaptive_entropy_controller_bad_inputs_and_no_host_sync():
    with pytest.raises(ValueError, match="target"):
        algos.adaptive_entropy_controller(target=0.0)
    with pytest.raises(ValueError, match="max_coef"):
        algos.adaptive_entropy_controller(init_coef=0.5, max_coef=0.1)
    ctrl = algos.adaptive_entropy_controller()
    with pytest.raises(ValueError, match="entropy"):
        ctrl.update(torch.ones(2), ctrl.init())
    with pytest.raises(ValueError, match="state"):
        ctrl.update(0.1, (0.0, 0.0))
    torch._dynamo.reset()
    compiled = torch.compile(ctrl.update, fullgraph=True, backend="eager")
    state = ctrl.init()
    for h in (0.1, 0.1, 0.3):
        want = ctrl.update(torch.tensor(h), state)
        state = compiled(torch.tensor(h), state)
        assert torch.equal(state.alpha, want.alpha) and torch.equal(state.entropy_coef, want.entropy_coef)
