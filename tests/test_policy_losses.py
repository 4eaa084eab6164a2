import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.testing.loss_strategies import policy_batches

HYPER = {
    "ppo": st.fixed_dictionaries(
        {
            "clip_low": st.sampled_from([0.1, 0.2]),
            "clip_high": st.sampled_from([0.2, 0.28]),
            "dual_clip": st.sampled_from([None, 3.0]),
        }
    ),
    "gspo": st.fixed_dictionaries(
        {"clip_low": st.sampled_from([3e-4, 0.05]), "clip_high": st.sampled_from([4e-4, 0.1])}
    ),
    "cispo": st.fixed_dictionaries(
        {"clip_low": st.sampled_from([None, 0.5]), "clip_high": st.sampled_from([0.28, 1.0])}
    ),
    "reinforce": st.just({}),
    "sapo": st.fixed_dictionaries({"tau_pos": st.sampled_from([1.0, 2.0]), "tau_neg": st.sampled_from([1.05, 3.0])}),
    "gmpo": st.fixed_dictionaries({"clip_low": st.sampled_from([0.4, 0.1]), "clip_high": st.sampled_from([0.4, 0.2])}),
}
IMPL = {
    "ppo": algos.ppo_clip_loss,
    "gspo": algos.gspo_loss,
    "cispo": algos.cispo_loss,
    "reinforce": algos.reinforce_loss,
    "sapo": algos.sapo_loss,
    "gmpo": algos.gmpo_loss,
}
REF = {
    "ppo": ref.ppo_clip_loss_ref,
    "gspo": ref.gspo_loss_ref,
    "cispo": ref.cispo_loss_ref,
    "reinforce": ref.reinforce_loss_ref,
    "sapo": ref.sapo_loss_ref,
    "gmpo": ref.gmpo_loss_ref,
}
INPUTS = ("logp", "old_logp", "advantages", "mask")


def _run(fn, batch, **kw):
    logp = batch["logp"].clone().requires_grad_(True)
    loss, metrics = fn(logp, batch["old_logp"], batch["advantages"], batch["mask"], **kw)
    loss.sum().backward()
    return loss, logp.grad, metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(IMPL))
@settings(max_examples=20)
@given(data=st.data())
def test_matches_loop_reference(name, dtype, data):
    batch = data.draw(policy_batches(dtype=dtype), label="batch")
    kw = data.draw(HYPER[name], label="hyper")
    if name == "ppo" and data.draw(st.booleans(), label="is_weights"):
        kw["is_weights"] = torch.rand(batch["mask"].shape).to(dtype) + 0.5
    loss, grad, metrics = _run(IMPL[name], batch, **kw)
    want_loss, want_grad, want_metrics = REF[name](*(batch[k] for k in INPUTS), **kw)
    assert loss.dtype == dtype and grad.dtype == dtype
    # Large drifts give ratios up to e^20: scale the absolute tolerance with the values.
    scale = max(1.0, float(want_loss.abs().max()) if want_loss.numel() else 1.0)
    assert_close(loss, want_loss, dtype=dtype, scale=scale)
    gscale = max(1.0, float(want_grad.abs().max()) if want_grad.numel() else 1.0)
    assert_close(grad, want_grad, dtype=dtype, scale=gscale)
    assert set(metrics) == set(want_metrics)
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad, key
        assert value.dtype == torch.float32, key
        mscale = max(1.0, abs(want_metrics[key]))
        assert_close(value, torch.tensor(want_metrics[key]), dtype=torch.float32, scale=mscale * 10, msg=key)


@pytest.mark.parametrize("name", list(IMPL))
@settings(max_examples=15)
@given(batch=policy_batches(drifts=("none",), seq_advantages=True, dtype=torch.float64))
def test_on_policy_gradient_is_the_policy_gradient(name, batch):
    """With logp == old_logp every surrogate's gradient is -A * d logp (REINFORCE)."""
    batch["old_logp"] = batch["logp"]
    _, grad, _ = _run(IMPL[name], batch)
    mask = batch["mask"]
    want = torch.where(mask, -batch["advantages"], 0.0)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=20)
@given(batch=policy_batches(drifts=("none",)), dual=st.sampled_from([None, 3.0]))
def test_ppo_on_policy_loss_is_minus_advantage(batch, dual):
    batch["old_logp"] = batch["logp"]
    loss, grad, metrics = _run(algos.ppo_clip_loss, batch, dual_clip=dual)
    want = torch.where(batch["mask"], -batch["advantages"], 0.0)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    torch.testing.assert_close(grad, want, rtol=0, atol=0)
    assert float(metrics["clip_frac_low"]) == 0.0 and float(metrics["clip_frac_high"]) == 0.0
    assert float(metrics["approx_kl"]) == 0.0


@settings(max_examples=25)
@given(batch=policy_batches(drifts=("small", "large")), clip_high=st.sampled_from([0.2, 0.28]))
def test_ppo_clipped_tokens_have_zero_gradient(batch, clip_high):
    loss, grad, _ = _run(algos.ppo_clip_loss, batch, clip_high=clip_high)
    mask, adv = batch["mask"], batch["advantages"]
    ratio = torch.exp(batch["logp"].double() - batch["old_logp"].double())
    clipped = mask & (((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 0.8)))
    assert torch.all(grad[clipped] == 0)
    live = mask & ~clipped & (adv != 0)
    assert torch.all(grad[live] != 0)
    # A clipped token sits on the constant bound -A * (1 +- eps).
    bound = torch.where(adv > 0, -adv * (1 + clip_high), -adv * 0.8)
    assert_close(loss[clipped], bound[clipped].double())


@settings(max_examples=25)
@given(batch=policy_batches(drifts=("large", "extreme")), c=st.sampled_from([2.0, 3.0, 5.0]))
def test_ppo_dual_clip_bounds_negative_advantage_loss(batch, c):
    mask, adv = batch["mask"], batch["advantages"]
    loss, grad, metrics = _run(algos.ppo_clip_loss, batch, dual_clip=c)
    plain, _, _ = _run(algos.ppo_clip_loss, batch)
    neg = mask & (adv < 0)
    assert torch.all(loss[neg] <= (-adv[neg] * c) * (1 + 1e-6))
    ratio = torch.exp((batch["logp"].double() - batch["old_logp"].double()).clamp(-20, 20))
    dual = neg & (ratio > c)
    assert torch.all(grad[dual] == 0)
    untouched = mask & ~dual
    torch.testing.assert_close(loss[untouched], plain[untouched])
    assert_close(metrics["clip_frac_dual"], dual.sum() / mask.sum().clamp(min=1))


def test_ppo_hand_computed_clip_higher_and_dual_clip():
    # r = 1.25 with A = +1: symmetric eps 0.2 clips to -1.2 (no gradient); DAPO's
    # clip_high = 0.28 leaves it at -1.25 with gradient -1.25.
    lr = math.log(1.25)
    logp = torch.tensor([[lr, lr, math.log(4.0)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1]])
    loss, m = algos.ppo_clip_loss(logp, old, adv, mask)
    loss.sum().backward()
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 0.0, 8.0]], dtype=torch.float64))
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 8.0]], dtype=torch.float64))
    assert float(m["clip_frac_high"]) == 0.5
    logp.grad = None
    loss, _ = algos.ppo_clip_loss(logp, old, adv, mask, clip_high=0.28, dual_clip=3.0)
    loss.sum().backward()
    # r = 4 > c = 3 with A = -2: the dual clip caps the loss at -A * c = 6, gradient 0.
    torch.testing.assert_close(loss, torch.tensor([[-1.25, 0.0, 6.0]], dtype=torch.float64))
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.25, 0.0, 0.0]], dtype=torch.float64))


def test_log_ratio_is_clamped_before_exp():
    logp = torch.tensor([[0.0, -200.0]], requires_grad=True)
    old = torch.tensor([[-200.0, 0.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    for fn in IMPL.values():
        loss, metrics = fn(logp, old, adv, torch.ones(1, 2, dtype=torch.bool))
        assert torch.isfinite(loss).all()
        assert all(torch.isfinite(v) for v in metrics.values())
    loss, metrics = algos.ppo_clip_loss(logp, old, adv, torch.ones(1, 2))
    assert_close(loss, torch.tensor([[math.exp(20.0), -math.exp(-20.0)]]), scale=1e3)
    assert_close(metrics["ratio_max"], torch.tensor(math.exp(20.0)), scale=1e3)


def test_gspo_hand_computed_and_sequence_level_gradient():
    # Sequence 0: log-ratios 0.2 and -0.1 -> s = exp(0.05) ~ 1.0513 > 1 + 4e-4, A = 1: clipped.
    logp = torch.tensor([[0.2, -0.1, 9.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, m = algos.gspo_loss(logp, old, adv, mask)
    torch.testing.assert_close(loss, torch.tensor([[-1.0004, -1.0004, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64))
    assert float(m["clip_frac_high"]) == pytest.approx(0.4)

    def objective(lp):
        return algos.aggregate(
            algos.gspo_loss(lp, old, adv, mask, clip_low=0.1, clip_high=0.1)[0], mask, mode="seq-mean-token-mean"
        )

    # With sequence advantages the GSPO-token loss, averaged per sequence, is the
    # paper's sequence objective: its autograd gradient matches finite differences.
    assert torch.autograd.gradcheck(objective, (logp.clone().requires_grad_(True),))


@pytest.mark.parametrize("name", ["ppo", "sapo", "gmpo", "reinforce"])
def test_gradcheck_float64(name):
    g = torch.Generator().manual_seed(7)
    logp = torch.rand(3, 5, generator=g, dtype=torch.float64).log()
    old = logp + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [1, 0, 0, 0, 0]])
    fn = IMPL[name]
    assert torch.autograd.gradcheck(lambda lp: fn(lp, old, adv, mask)[0], (logp.requires_grad_(True),))


def test_cispo_keeps_gradient_of_clipped_tokens():
    # r = e (clipped to 1.28) and r = e^-3 (no lower bound): both tokens keep a gradient.
    logp = torch.tensor([[1.0, -3.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    loss, m = algos.cispo_loss(logp, torch.zeros(1, 2, dtype=torch.float64), adv, torch.ones(1, 2))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.28, -math.exp(-3.0)]], dtype=torch.float64))
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 3.0 * math.exp(-3.0)]], dtype=torch.float64))
    assert float(m["clip_frac_high"]) == 0.5 and float(m["clip_frac_low"]) == 0.0


def test_sapo_hand_computed_gate():
    # r = 2, A = 1, tau = 1: loss = -4 * sigmoid(1); gradient -4 s (1 - s) * 2.
    logp = torch.tensor([[math.log(2.0)]], dtype=torch.float64, requires_grad=True)
    loss, _ = algos.sapo_loss(
        logp, torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1)
    )
    loss.sum().backward()
    s = 1 / (1 + math.exp(-1.0))
    assert math.isclose(float(loss.detach()), -4 * s, rel_tol=1e-12)
    assert math.isclose(float(logp.grad), -8 * s * (1 - s), rel_tol=1e-12)


def test_gmpo_hand_computed_geometric_mean():
    # Log-ratios 0.6 (clipped to 0.4 for A > 0) and -0.2: rho = exp((0.4 - 0.2) / 2).
    logp = torch.tensor([[0.6, -0.2]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, 2.0]], dtype=torch.float64)
    loss, m = algos.gmpo_loss(logp, torch.zeros(1, 2, dtype=torch.float64), adv, torch.ones(1, 2))
    loss.sum().backward()
    rho = math.exp(0.1)
    torch.testing.assert_close(loss, torch.full((1, 2), -2 * rho, dtype=torch.float64))
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -2 * rho]], dtype=torch.float64))
    assert float(m["clip_frac_high"]) == 0.5


@settings(max_examples=10)
@given(batch=policy_batches())
def test_gpg_is_the_reinforce_surrogate(batch):
    a, _, _ = _run(algos.gpg_loss, batch)
    b, _, _ = _run(algos.reinforce_loss, batch)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(IMPL))
def test_bad_inputs_raise_value_error_naming_the_argument(name):
    fn = IMPL[name]
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logp"):
        fn(x, torch.zeros(2, 4), x, torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        fn(x, x, torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        fn(x, x, x, torch.ones(3, 2))
    with pytest.raises(ValueError, match="logp"):
        fn(torch.zeros(2, 3, dtype=torch.long), x, x, torch.ones(2, 3))
    with pytest.raises(ValueError, match="logp"):
        fn(torch.zeros(6), torch.zeros(6), torch.zeros(6), torch.ones(6))


def test_bad_hyperparameters_raise():
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="dual_clip"):
        algos.ppo_clip_loss(x, x, x, m, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        algos.ppo_clip_loss(x, x, x, m, clip_low=-0.1)
    with pytest.raises(ValueError, match="is_weights"):
        algos.ppo_clip_loss(x, x, x, m, is_weights=torch.ones(2))
    with pytest.raises(ValueError, match="tau_neg"):
        algos.sapo_loss(x, x, x, m, tau_neg=0.0)


@pytest.mark.parametrize("name", list(IMPL))
def test_no_host_sync(name):
    g = torch.Generator().manual_seed(0)
    logp = torch.rand(4, 6, generator=g).log()
    old = logp + 0.5 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    kw = {"dual_clip": 3.0, "is_weights": torch.rand(4, 6, generator=g)} if name == "ppo" else {}
    assert_no_host_sync(functools.partial(IMPL[name], **kw), logp, old, adv, mask)


@settings(max_examples=20)
@given(batch=policy_batches(), dual=st.sampled_from([None, 3.0]), weighted=st.booleans())
def test_ppo_ratio_stats_off_keeps_loss_gradient_and_other_metrics(batch, dual, weighted):
    """``ratio_stats=False`` drops only ratio_mean/min/max; the loss, gradient and other metrics are unchanged."""
    if weighted:
        batch["mask"] = batch["mask"].float() * 0.5
    loss, grad, metrics = _run(algos.ppo_clip_loss, batch, dual_clip=dual)
    loss2, grad2, metrics2 = _run(algos.ppo_clip_loss, batch, dual_clip=dual, ratio_stats=False)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    assert set(metrics) - set(metrics2) == {"ratio_mean", "ratio_min", "ratio_max"}
    for key, value in metrics2.items():
        assert torch.equal(value, metrics[key]), key


def test_ppo_ratio_stats_off_no_host_sync():
    g = torch.Generator().manual_seed(1)
    logp = torch.rand(4, 6, generator=g).log()
    old = logp + 0.5 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    fn = functools.partial(algos.ppo_clip_loss, dual_clip=3.0, ratio_stats=False)
    assert_no_host_sync(fn, logp, old, adv, mask)
