"""Preference losses: DPO family, SimPO / CPO / ORPO, KTO and sequence log-probs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.algos import (
    DIVERGENCES,
    DPO_LOSS_TYPES,
    cpo_loss,
    dpo_loss,
    kto_loss,
    orpo_loss,
    sequence_logps,
    simpo_loss,
)
from rlcore.testing import assert_close, assert_no_host_sync, token_batches
from rlcore.testing.preference_strategies import preference_pairs, unpaired_samples
from rlcore.testing.reference import (
    cpo_loss_ref,
    dpo_loss_ref,
    kto_loss_ref,
    orpo_loss_ref,
    sequence_logps_ref,
    simpo_loss_ref,
)

DTYPES = [torch.float32, torch.bfloat16]
SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_pair")
LOG2 = math.log(2.0)


def _args(p):
    return p["pi_chosen"], p["pi_rejected"], p["ref_chosen"], p["ref_rejected"]


def _pairs(lc, lr, *, ref=(-40.0, -60.0), dtype=torch.float64, grad=False):
    """Pairs with given chosen / rejected log-ratios against a fixed reference."""
    lc = torch.as_tensor(lc, dtype=torch.float64)
    lr = torch.as_tensor(lr, dtype=torch.float64)
    rc = torch.full_like(lc, ref[0])
    rr = torch.full_like(lr, ref[1])
    pc = (rc + lc).to(dtype).requires_grad_(grad)
    pr = (rr + lr).to(dtype).requires_grad_(grad)
    return pc, pr, rc.to(dtype), rr.to(dtype)


def _draw_options(data, loss_type, *, divergences=DIVERGENCES):
    opts = {"beta": data.draw(st.sampled_from([0.05, 0.1, 0.5, 1.0, 2.0]), label="beta")}
    if loss_type != "aot":
        opts["divergence"] = data.draw(st.sampled_from(divergences), label="divergence")
    if loss_type == "exo_pair":
        opts["label_smoothing"] = data.draw(st.sampled_from([1e-3, 0.1, 0.3]), label="eps")
    elif loss_type in SMOOTHED:
        opts["label_smoothing"] = data.draw(st.sampled_from([0.0, 0.1, 0.3]), label="eps")
    if loss_type == "discopop":
        opts["discopop_tau"] = data.draw(st.sampled_from([0.05, 0.5, 2.0]), label="tau")
    return opts


# ---------------------------------------------------------------- sequence_logps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@settings(max_examples=20)
@given(batch=token_batches(max_len=16, patterns=("normal", "wide", "constant")))
def test_sequence_logps_matches_reference(dtype, reduce, batch):
    logp, mask = batch["values"].to(dtype), batch["mask"]
    want = sequence_logps_ref(logp, mask, reduce=reduce)
    got = sequence_logps(logp, mask, reduce=reduce)
    assert got.dtype == dtype and got.shape == (logp.shape[0],)
    finite = logp.double().nan_to_num(0.0).abs()
    scale = max(1.0, float(finite.max())) * (logp.shape[1] if reduce == "sum" else 1)
    assert_close(got, want, dtype=dtype, scale=scale)


def test_sequence_logps_mean_is_sum_over_count_and_empty_row_is_zero():
    logp = torch.tensor([[-1.0, -3.0, float("nan")], [-2.0, float("nan"), float("nan")]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert torch.equal(sequence_logps(logp, mask), torch.tensor([-4.0, 0.0]))
    assert torch.equal(sequence_logps(logp, mask, reduce="mean"), torch.tensor([-2.0, 0.0]))


def test_sequence_logps_bad_input():
    with pytest.raises(ValueError, match="reduce.*'sum', 'mean'"):
        sequence_logps(torch.zeros(2, 3), torch.ones(2, 3), reduce="max")
    with pytest.raises(ValueError, match="mask: got shape \\(2, 4\\)"):
        sequence_logps(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="logp"):
        sequence_logps(torch.zeros(3), torch.ones(3))


# ---------------------------------------------------------------- dpo_loss against the reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
@settings(max_examples=25)
@given(data=st.data())
def test_dpo_loss_matches_reference(loss_type, dtype, data):
    p = data.draw(preference_pairs(dtype=dtype, scale=3.0), label="pairs")
    opts = _draw_options(data, loss_type)
    loss, metrics = dpo_loss(*_args(p), loss_type=loss_type, **opts)
    want, chosen, rejected = dpo_loss_ref(*_args(p), loss_type=loss_type, **opts)
    assert loss.dtype == dtype and loss.shape == want.shape
    assert_close(loss, want, dtype=dtype, scale=max(1.0, float(want.abs().max())))
    reward_scale = max(1.0, float(chosen.abs().max()), float(rejected.abs().max()))
    assert_close(metrics["chosen_rewards"], chosen, dtype=dtype, scale=reward_scale)
    assert_close(metrics["rejected_rewards"], rejected, dtype=dtype, scale=reward_scale)
    for value in metrics.values():
        assert value.dtype == dtype and not value.requires_grad


@pytest.mark.parametrize(
    ("loss_type", "options", "expected"),
    [
        # Every loss at policy == reference (all log-ratios 0), from its formula by hand.
        ("sigmoid", {}, LOG2),
        ("sigmoid", {"label_smoothing": 0.2}, LOG2),
        ("robust", {"label_smoothing": 0.2}, LOG2),
        ("hinge", {}, 1.0),
        ("ipo", {}, 25.0),  # (0 - 1 / (2 * 0.1))^2
        ("exo_pair", {"label_smoothing": 0.1}, -LOG2 - 0.5 * math.log(0.1 * 0.9)),
        ("nca_pair", {}, 2 * LOG2),
        ("bco_pair", {}, 2 * LOG2),
        ("sppo_hard", {}, 50.0),  # 2 * (0.5 / 0.1)^2
        ("aot", {}, LOG2),
        ("aot_pair", {}, LOG2),
        ("apo_zero", {}, 1.0),
        ("apo_down", {}, 1.0),
        ("discopop", {}, 0.5 * LOG2 + 0.5),
    ],
)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_every_loss_at_the_reference_point(loss_type, options, expected, divergence):
    args = _pairs([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    if loss_type == "aot" and divergence != "reverse_kl":
        with pytest.raises(ValueError, match="divergence"):
            dpo_loss(*args, loss_type=loss_type, divergence=divergence, **options)
        return
    loss, metrics = dpo_loss(*args, loss_type=loss_type, divergence=divergence, **options)
    assert_close(loss, torch.full((3,), expected, dtype=torch.float64), dtype=torch.float32)
    assert torch.equal(metrics["margins"], torch.zeros(3, dtype=torch.float64))
    assert torch.equal(metrics["accuracies"], torch.zeros(3, dtype=torch.float64))


def test_dpo_hand_computed_values():
    # beta h = 0.1 * 10 = 1: -log sigmoid(1) = log(1 + e^-1).
    loss, metrics = dpo_loss(*_pairs([5.0], [-5.0]))
    assert_close(loss, torch.tensor([math.log1p(math.exp(-1.0))], dtype=torch.float64), dtype=torch.float64)
    assert_close(metrics["chosen_rewards"], torch.tensor([0.5], dtype=torch.float64), dtype=torch.float64)
    assert metrics["accuracies"].tolist() == [1.0]
    # IPO, beta 0.5: (h - 1)^2 with h = 3.
    loss, _ = dpo_loss(*_pairs([1.0], [-2.0]), loss_type="ipo", beta=0.5)
    assert_close(loss, torch.tensor([4.0], dtype=torch.float64), dtype=torch.float64)
    # JS score at u = 3: log(2 * 3 / 4) = log 1.5; alpha = 0.5 at u = 4: (1 - 4^-0.5) / 0.5 = 1.
    _, m = dpo_loss(*_pairs([math.log(3.0)], [0.0]), beta=1.0, divergence="js")
    assert_close(m["chosen_rewards"], torch.tensor([math.log(1.5)], dtype=torch.float64), dtype=torch.float64)
    _, m = dpo_loss(*_pairs([math.log(4.0)], [0.0]), beta=1.0, divergence="alpha", alpha=0.5)
    assert_close(m["chosen_rewards"], torch.tensor([1.0], dtype=torch.float64), dtype=torch.float64)


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("divergence", DIVERGENCES)
@given(p=preference_pairs(patterns=("equal",)), beta=st.floats(0.01, 10.0))
def test_sigmoid_dpo_is_log2_when_policy_equals_reference(divergence, p, beta):
    _pi_c, _pi_r, ref_c, ref_r = _args(p)
    loss, _ = dpo_loss(ref_c, ref_r, ref_c, ref_r, beta=beta, divergence=divergence)
    assert torch.equal(loss, torch.full_like(loss, LOG2))


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
@settings(max_examples=15)
@given(data=st.data())
def test_swapping_chosen_and_rejected_mirrors_the_margin(loss_type, data):
    p = data.draw(preference_pairs(dtype=torch.float64, scale=3.0), label="pairs")
    opts = _draw_options(data, loss_type)
    pc, pr, rc, rr = _args(p)
    _, m = dpo_loss(pc, pr, rc, rr, loss_type=loss_type, **opts)
    _, s = dpo_loss(pr, pc, rr, rc, loss_type=loss_type, **opts)
    assert torch.equal(s["margins"], -m["margins"])
    assert torch.equal(s["chosen_rewards"], m["rejected_rewards"])
    assert torch.equal(s["accuracies"], (m["margins"] < 0).double())


@given(p=preference_pairs(dtype=torch.float64), beta=st.sampled_from([0.05, 0.1, 1.0]))
def test_sigmoid_loss_of_the_swapped_pair_differs_by_the_margin(p, beta):
    # softplus(x) - softplus(-x) = x.
    loss, m = dpo_loss(*_args(p), beta=beta)
    pc, pr, rc, rr = _args(p)
    swapped, _ = dpo_loss(pr, pc, rr, rc, beta=beta)
    assert_close(swapped - loss, m["margins"], dtype=torch.float64, scale=100.0)


@given(beta=st.floats(0.01, 5.0), offset=st.floats(0.01, 3.0))
def test_ipo_minimum_sits_at_margin_one_over_two_beta(beta, offset):
    target = 1.0 / (2.0 * beta)
    pc, pr, rc, rr = _pairs([target, target + offset, target - offset], [0.0, 0.0, 0.0], grad=True)
    loss, _ = dpo_loss(pc, pr, rc, rr, loss_type="ipo", beta=beta)
    assert abs(float(loss[0].detach())) < 1e-9 * max(1.0, target**2)
    assert_close(loss[1:], torch.tensor([offset**2, offset**2], dtype=torch.float64), dtype=torch.float32, scale=target)
    (grad,) = torch.autograd.grad(loss[0], pc)
    assert abs(float(grad[0])) < 1e-6 * max(1.0, target)


def _margin_slope(loss_type, lc, lr, **opts):
    """Directional derivative of the summed loss as every margin grows (chosen up, rejected down)."""
    pc, pr, rc, rr = _pairs(lc, lr, grad=True)
    loss, _ = dpo_loss(pc, pr, rc, rr, loss_type=loss_type, **opts)
    gc, gr = torch.autograd.grad(loss.sum(), (pc, pr))
    return float((gc - gr).sum())


@pytest.mark.parametrize("loss_type", [t for t in DPO_LOSS_TYPES if t != "discopop"])
@settings(max_examples=30)
@given(data=st.data())
def test_gradient_descent_grows_the_margin_of_misranked_pairs(loss_type, data):
    opts = _draw_options(data, loss_type)
    opts["label_smoothing"] = min(opts.get("label_smoothing", 0.0), 0.1) or (1e-3 if loss_type == "exo_pair" else 0.0)
    opts["beta"] = min(opts["beta"], 1.0)
    # Within |beta l| <= 0.5 (and |l| <= 0.5 for the non-log scores), every loss pulls a
    # misranked or tied pair toward a larger margin; APO-down only holds that locally.
    radius = 0.5 / opts["beta"] if opts.get("divergence", "reverse_kl") == "reverse_kl" else 0.5
    n = data.draw(st.integers(1, 6), label="n")
    a = data.draw(st.lists(st.floats(-radius, radius), min_size=n, max_size=n), label="a")
    b = data.draw(st.lists(st.floats(-radius, radius), min_size=n, max_size=n), label="b")
    lc, lr = [min(x, y) for x, y in zip(a, b)], [max(x, y) for x, y in zip(a, b)]
    assert _margin_slope(loss_type, lc, lr, **opts) < 0


@given(x=st.floats(0.2, 200.0), beta=st.sampled_from([0.1, 1.0]))
def test_discopop_grows_the_margin_outside_its_nonconvex_window(x, beta):
    assert _margin_slope("discopop", [0.0], [x / beta], beta=beta) < 0


def test_discopop_slope_at_zero_margin_points_the_wrong_way():
    # d/dh of DiscoPOP at h = 0 is beta * ((1 - log 2) / (4 tau) - 3/4), > 0 for tau = 0.05.
    tau, beta = 0.05, 0.1
    pc, pr, rc, rr = _pairs([0.0], [0.0], grad=True)
    loss, _ = dpo_loss(pc, pr, rc, rr, loss_type="discopop", beta=beta, discopop_tau=tau)
    (grad,) = torch.autograd.grad(loss.sum(), pc)
    expected = beta * ((1 - LOG2) / (4 * tau) - 0.75)
    assert expected > 0
    assert_close(grad, torch.tensor([expected], dtype=torch.float64), dtype=torch.float32)


@given(p=preference_pairs(dtype=torch.float64), beta=st.sampled_from([0.1, 0.5]))
def test_label_smoothing_zero_reduces_robust_and_aot_to_sigmoid(p, beta):
    sigmoid, _ = dpo_loss(*_args(p), beta=beta)
    robust, _ = dpo_loss(*_args(p), beta=beta, loss_type="robust", label_smoothing=0.0)
    assert torch.equal(robust, sigmoid)
    first = [t[:1] for t in _args(p)]
    for loss_type in ("aot", "aot_pair"):
        one, _ = dpo_loss(*first, beta=beta, loss_type=loss_type)
        assert_close(one, sigmoid[:1], dtype=torch.float64)


@given(p=preference_pairs(dtype=torch.float64), eps=st.floats(0.0, 0.45))
def test_robust_dpo_is_unbiased_and_cdpo_is_the_expected_loss(p, eps):
    # rDPO: E_noise[L_rob] = (1 - eps) L_rob(h) + eps L_rob(-h) equals the clean DPO loss.
    pc, pr, rc, rr = _args(p)
    clean, _ = dpo_loss(pc, pr, rc, rr)
    flipped, _ = dpo_loss(pr, pc, rr, rc)
    rob, _ = dpo_loss(pc, pr, rc, rr, loss_type="robust", label_smoothing=eps)
    rob_flipped, _ = dpo_loss(pr, pc, rr, rc, loss_type="robust", label_smoothing=eps)
    scale = 1.0 / (1.0 - 2.0 * eps) * max(1.0, float(clean.abs().max()), float(flipped.abs().max()))
    assert_close((1 - eps) * rob + eps * rob_flipped, clean, dtype=torch.float32, scale=scale)
    cdpo, _ = dpo_loss(pc, pr, rc, rr, label_smoothing=eps)
    assert_close(cdpo, (1 - eps) * clean + eps * flipped, dtype=torch.float64, scale=scale)


@given(p=preference_pairs(dtype=torch.float64, min_batch=2), perm_seed=st.integers(0, 1000))
def test_aot_losses_do_not_depend_on_batch_order(p, perm_seed):
    perm = torch.randperm(p["pi_chosen"].shape[0], generator=torch.Generator().manual_seed(perm_seed))
    for loss_type in ("aot", "aot_pair"):
        loss, _ = dpo_loss(*_args(p), loss_type=loss_type)
        permuted, _ = dpo_loss(*[t[perm] for t in _args(p)], loss_type=loss_type)
        assert torch.equal(loss, permuted)


def test_bco_delta_defaults_to_the_batch_mean_reward():
    args = _pairs([1.0, -2.0, 3.0], [0.5, 0.0, -1.0])
    loss, m = dpo_loss(*args, loss_type="bco_pair")
    mean_reward = torch.cat([m["chosen_rewards"], m["rejected_rewards"]]).mean()
    explicit, _ = dpo_loss(*args, loss_type="bco_pair", bco_delta=mean_reward)
    assert torch.equal(loss, explicit)
    shifted, _ = dpo_loss(*args, loss_type="bco_pair", bco_delta=0.0)
    assert not torch.allclose(shifted, loss)


def test_alpha_divergence_limits():
    args = _pairs([1.5, -0.7, 3.0], [0.2, 0.4, -2.0])
    forward, _ = dpo_loss(*args, divergence="forward_kl")
    alpha_one, _ = dpo_loss(*args, divergence="alpha", alpha=1.0)
    assert_close(alpha_one, forward, dtype=torch.float64)
    reverse, _ = dpo_loss(*args)
    alpha_small, _ = dpo_loss(*args, divergence="alpha", alpha=1e-6)
    assert_close(alpha_small, reverse, dtype=torch.float32, scale=10.0)


# ---------------------------------------------------------------- numerics at extreme margins


EXTREME = [-1e4, -5e3, -100.0, 0.0, 100.0, 5e3, 1e4]


def _extreme_grid(dtype):
    lc = torch.tensor([a for a in EXTREME for _ in EXTREME], dtype=torch.float64)
    lr = torch.tensor([b for _ in EXTREME for b in EXTREME], dtype=torch.float64)
    return _pairs(lc, lr, dtype=dtype, grad=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_extreme_margins_give_finite_losses_and_gradients(loss_type, dtype):
    divergences = ("reverse_kl",) if loss_type == "aot" else DIVERGENCES
    eps = 0.1 if loss_type in SMOOTHED else 0.0
    for divergence in divergences:
        for beta in (0.1, 1.0):
            pc, pr, rc, rr = _extreme_grid(dtype)
            loss, _ = dpo_loss(
                pc, pr, rc, rr, loss_type=loss_type, divergence=divergence, beta=beta, label_smoothing=eps
            )
            gc, gr = torch.autograd.grad(loss.float().sum(), (pc, pr))
            assert torch.isfinite(loss).all(), (divergence, beta)
            assert torch.isfinite(gc).all() and torch.isfinite(gr).all(), (divergence, beta)


def test_extreme_margin_asymptotes():
    # h = -1e4, beta = 0.1: -log sigmoid(-1000) = 1000, d/dpi_chosen = -beta.
    pc, pr, rc, rr = _pairs([-5e3], [5e3], dtype=torch.float32, grad=True)
    loss, _ = dpo_loss(pc, pr, rc, rr)
    (g,) = torch.autograd.grad(loss.sum(), pc)
    assert loss.tolist() == [1000.0] and g.tolist() == [pytest.approx(-0.1)]
    # DiscoPOP at beta h = -100: the modulation is 0 and the loss is softplus(100) = 100
    # (TRL's sigmoid(-2000) * exp(100) form is 0 * inf = nan in float32).
    loss, _ = dpo_loss(*_pairs([-500.0], [500.0], dtype=torch.float32), loss_type="discopop")
    assert loss.tolist() == [100.0]


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_gradcheck(loss_type):
    g = torch.Generator().manual_seed(len(loss_type))
    inputs = [(-20 + 3 * torch.randn(4, generator=g, dtype=torch.float64)).requires_grad_() for _ in range(4)]
    divergences = ("reverse_kl",) if loss_type == "aot" else DIVERGENCES
    eps = 0.1 if loss_type in SMOOTHED else 0.0
    # BCO's default shift is a detached batch statistic, which finite differences would see.
    extra = {"bco_delta": 0.3} if loss_type == "bco_pair" else {}
    for divergence in divergences:

        def fn(*a, divergence=divergence):
            return dpo_loss(*a, beta=0.5, loss_type=loss_type, divergence=divergence, label_smoothing=eps, **extra)[0]

        assert torch.autograd.gradcheck(fn, inputs)


# ---------------------------------------------------------------- bad input


def test_dpo_bad_input_names_argument_and_allowed_values():
    a = torch.zeros(3)
    with pytest.raises(ValueError, match=r"pi_rejected: got shape \(4\), expected \(3\)"):
        dpo_loss(a, torch.zeros(4), a, a)
    with pytest.raises(ValueError, match=r"ref_rejected: got shape \(2\)"):
        dpo_loss(a, a, a, torch.zeros(2))
    with pytest.raises(ValueError) as err:
        dpo_loss(a, a, a, a, loss_type="kto_pair")
    assert "loss_type: got 'kto_pair'" in str(err.value)
    assert all(repr(name) in str(err.value) for name in DPO_LOSS_TYPES)
    with pytest.raises(ValueError, match="divergence.*'reverse_kl', 'forward_kl', 'js', 'alpha'"):
        dpo_loss(a, a, a, a, divergence="chi2")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(a, a, a, a, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="label_smoothing.*exo_pair"):
        dpo_loss(a, a, a, a, loss_type="exo_pair")
    with pytest.raises(ValueError, match="divergence.*aot"):
        dpo_loss(a, a, a, a, loss_type="aot", divergence="js")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(a, a, a, a, beta=0.0)
    with pytest.raises(ValueError, match="pi_chosen.*1-D"):
        dpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="ref_chosen.*floating"):
        dpo_loss(a, a, torch.zeros(3, dtype=torch.long), a)


# ---------------------------------------------------------------- reference-free losses


@pytest.mark.parametrize("dtype", DTYPES)
@given(
    p=preference_pairs(scale=1.0),
    beta=st.sampled_from([0.1, 2.0, 2.5]),
    gamma=st.sampled_from([0.0, 0.5, 1.4]),
    eps=st.sampled_from([0.0, 0.2]),
)
def test_simpo_matches_reference(dtype, p, beta, gamma, eps):
    # Length-normalised log-probs are O(1): use the per-sequence values / 50.
    pc, pr = (p["pi_chosen"].double() / 50).to(dtype), (p["pi_rejected"].double() / 50).to(dtype)
    loss, m = simpo_loss(pc, pr, beta=beta, gamma=gamma, label_smoothing=eps)
    want = simpo_loss_ref(pc, pr, beta=beta, gamma=gamma, label_smoothing=eps)
    assert loss.dtype == dtype
    assert_close(loss, want, dtype=dtype, scale=max(1.0, float(want.abs().max())))
    assert_close(m["margins"], beta * (pc.double() - pr.double()), dtype=dtype, scale=beta * 4)


@given(p=preference_pairs(dtype=torch.float64), beta=st.sampled_from([0.1, 2.0]), gamma=st.floats(0.0, 2.0))
def test_simpo_is_reference_free_dpo_with_a_shifted_margin(p, beta, gamma):
    pc, pr = p["pi_chosen"], p["pi_rejected"]
    zero = torch.zeros_like(pc)
    loss, _ = simpo_loss(pc, pr, beta=beta, gamma=gamma)
    dpo, _ = dpo_loss(pc - gamma / beta, pr, zero, zero, beta=beta)
    assert_close(loss, dpo, dtype=torch.float64, scale=100.0)


@pytest.mark.parametrize("dtype", DTYPES)
@given(p=preference_pairs(), alpha=st.sampled_from([0.0, 1.0, 0.3]), eps=st.sampled_from([0.0, 0.1]))
def test_cpo_matches_reference_and_adds_the_nll(dtype, p, alpha, eps):
    pc, pr = p["pi_chosen"].to(dtype), p["pi_rejected"].to(dtype)
    nll = (-pc.double() / 20).to(dtype)
    loss, m = cpo_loss(pc, pr, nll, alpha=alpha, label_smoothing=eps)
    want = cpo_loss_ref(pc, pr, nll, alpha=alpha, label_smoothing=eps)
    assert_close(loss, want, dtype=dtype, scale=max(1.0, float(want.abs().max())))
    assert torch.equal(m["nll"], nll)
    zero = torch.zeros_like(pc)
    dpo, _ = dpo_loss(pc, pr, zero, zero, label_smoothing=eps)
    assert_close(loss - alpha * nll, dpo, dtype=dtype, scale=max(1.0, float(want.abs().max())))


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data(), lam=st.sampled_from([0.1, 1.0]))
def test_orpo_matches_reference(dtype, data, lam):
    n = data.draw(st.integers(1, 6))
    pw = torch.tensor(data.draw(st.lists(st.floats(-6.0, -0.01), min_size=n, max_size=n)), dtype=dtype)
    pl = torch.tensor(data.draw(st.lists(st.floats(-6.0, -0.01), min_size=n, max_size=n)), dtype=dtype)
    nll = -pw
    loss, m = orpo_loss(pw, pl, nll, lam=lam)
    want, ratio = orpo_loss_ref(pw, pl, nll, lam=lam)
    assert_close(loss, want, dtype=dtype, scale=10.0)
    assert_close(m["log_odds_ratio"], ratio, dtype=dtype, scale=10.0)
    _swapped, s = orpo_loss(pl, pw, nll, lam=lam)
    assert torch.equal(s["log_odds_ratio"], -m["log_odds_ratio"])


def test_orpo_hand_computed_and_stable_near_certainty():
    # P_w = 0.5, P_l = 0.2: odds 1 and 1/4, log odds ratio log 4, loss = nll + lam log(1 + 1/4).
    loss, m = orpo_loss(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.2)]), torch.tensor([0.7]), lam=0.1)
    assert_close(loss, torch.tensor([0.7 + 0.1 * math.log(1.25)]), dtype=torch.float32)
    # p = -1e-6: log odds = p - log(1 - e^p) = p - log(-expm1(p)) exactly; the float32
    # log1p(-exp(p)) form is off by 6 % there.
    p = -1e-6
    exact = p - math.log(-math.expm1(p))
    _, m = orpo_loss(torch.tensor([p]), torch.tensor([math.log(0.5)]), torch.zeros(1))
    assert_close(m["log_odds_ratio"], torch.tensor([exact], dtype=torch.float64), dtype=torch.float32, scale=10.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_orpo_and_simpo_finite_at_extremes(dtype):
    values = [0.0, -1e-30, -1e-7, -0.5, -100.0, -1e4]
    pw = torch.tensor([a for a in values for _ in values], dtype=dtype, requires_grad=True)
    pl = torch.tensor([b for _ in values for b in values], dtype=dtype, requires_grad=True)
    for fn in (lambda: orpo_loss(pw, pl, -pw)[0], lambda: simpo_loss(pw, pl)[0], lambda: cpo_loss(pw, pl, -pw)[0]):
        loss = fn()
        grads = torch.autograd.grad(loss.float().sum(), (pw, pl))
        assert torch.isfinite(loss).all() and all(torch.isfinite(g).all() for g in grads)


def test_reference_free_gradchecks():
    g = torch.Generator().manual_seed(0)
    pw = (-torch.rand(5, generator=g, dtype=torch.float64) * 3 - 1e-3).requires_grad_()
    pl = (-torch.rand(5, generator=g, dtype=torch.float64) * 3 - 1e-3).requires_grad_()
    nll = torch.rand(5, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: simpo_loss(a, b, label_smoothing=0.1)[0], (pw, pl))
    assert torch.autograd.gradcheck(lambda a, b, c: cpo_loss(a, b, c)[0], (pw, pl, nll))
    assert torch.autograd.gradcheck(lambda a, b, c: orpo_loss(a, b, c)[0], (pw, pl, nll))


def test_reference_free_bad_input():
    a = torch.zeros(3)
    with pytest.raises(ValueError, match=r"pi_rejected: got shape \(2\)"):
        simpo_loss(a, torch.zeros(2))
    with pytest.raises(ValueError, match=r"chosen_nll: got shape \(4\)"):
        cpo_loss(a, a, torch.zeros(4))
    with pytest.raises(ValueError, match=r"chosen_nll: got shape \(1\)"):
        orpo_loss(a, a, torch.zeros(1))
    with pytest.raises(ValueError, match="gamma"):
        simpo_loss(a, a, gamma=-1.0)


# ---------------------------------------------------------------- KTO


@pytest.mark.parametrize("dtype", DTYPES)
@given(s=unpaired_samples(scale=3.0), beta=st.sampled_from([0.1, 1.0]), w=st.sampled_from([(1.0, 1.0), (1.33, 1.0)]))
def test_kto_matches_reference(dtype, s, beta, w):
    s = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in s.items()}
    args = (s["logp"], s["ref_logp"], s["desirable"], s["kl_logp"], s["kl_ref_logp"])
    loss, m = kto_loss(*args, beta=beta, desirable_weight=w[0], undesirable_weight=w[1])
    want, z = kto_loss_ref(*args, beta=beta, desirable_weight=w[0], undesirable_weight=w[1])
    assert loss.dtype == dtype
    assert_close(loss, want, dtype=dtype, scale=2.0)
    assert_close(m["kl"], torch.tensor(z, dtype=torch.float64), dtype=dtype, scale=10.0)
    assert float(m["kl"]) >= 0


def test_kto_hand_computed_and_reference_point():
    logp, ref = torch.tensor([-4.0, -9.0, -7.0]), torch.tensor([-5.0, -8.0, -7.0])
    desirable = torch.tensor([True, False, True])
    # KL estimate 2 (> 0): z = 2, r = (1, -1, 0), beta = 1.
    loss, m = kto_loss(
        logp, ref, desirable, torch.tensor([-1.0, -3.0]), torch.tensor([-3.0, -5.0]), beta=1.0, desirable_weight=2.0
    )
    want = [2 / (1 + math.exp(1 - 2)), 1 / (1 + math.exp(2 + 1)), 2 / (1 + math.exp(0 - 2))]  # w (1 - sigmoid(u))
    assert_close(loss, torch.tensor(want), dtype=torch.float32)
    assert m["kl"].tolist() == 2.0
    assert m["accuracies"].tolist() == pytest.approx(1 / 3)  # only the undesirable one is past z
    assert m["chosen_rewards"].tolist() == 0.5 and m["rejected_rewards"].tolist() == -1.0
    # A negative KL estimate is clamped to 0.
    _, m = kto_loss(logp, ref, desirable, torch.tensor([-5.0]), torch.tensor([-3.0]))
    assert m["kl"].tolist() == 0.0


def test_kto_gradients_follow_the_labels_and_skip_the_reference_point():
    logp = torch.tensor([-4.0, -9.0], requires_grad=True)
    kl_logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref, desirable = torch.tensor([-5.0, -8.0]), torch.tensor([True, False])
    loss, _ = kto_loss(logp, ref, desirable, kl_logp, torch.tensor([-3.0, -3.0]))
    g_logp, g_kl = torch.autograd.grad(loss.sum(), (logp, kl_logp), allow_unused=True)
    assert g_logp[0] < 0 < g_logp[1]  # descent raises the desirable, lowers the undesirable
    assert g_kl is None
    assert torch.autograd.gradcheck(
        lambda a: kto_loss(
            a,
            torch.tensor([-5.0, -8.0], dtype=torch.float64),
            torch.tensor([True, False]),
            torch.tensor([-1.0], dtype=torch.float64),
            torch.tensor([-3.0], dtype=torch.float64),
        )[0],
        (logp.detach().double().requires_grad_(),),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_kto_finite_at_extremes(dtype):
    logp = torch.tensor([1e4, -1e4, 1e4, -1e4], dtype=dtype, requires_grad=True)
    ref = torch.zeros(4, dtype=dtype)
    loss, _ = kto_loss(
        logp,
        ref,
        torch.tensor([True, True, False, False]),
        torch.tensor([5e3], dtype=dtype),
        torch.zeros(1, dtype=dtype),
    )
    (g,) = torch.autograd.grad(loss.float().sum(), logp)
    assert torch.isfinite(loss).all() and torch.isfinite(g).all()


def test_kto_bad_input():
    a = torch.zeros(3)
    with pytest.raises(ValueError, match=r"desirable: got shape \(2\)"):
        kto_loss(a, a, torch.ones(2, dtype=torch.bool), a, a)
    with pytest.raises(ValueError, match=r"kl_ref_logp: got shape \(2\)"):
        kto_loss(a, a, torch.ones(3, dtype=torch.bool), a, torch.zeros(2))
    with pytest.raises(ValueError, match="kl_logp.*M >= 1"):
        kto_loss(a, a, torch.ones(3, dtype=torch.bool), torch.zeros(0), torch.zeros(0))


# ---------------------------------------------------------------- no host sync


def test_preference_losses_have_no_host_sync():
    def all_losses(pc, pr, rc, rr, logp, mask, desirable):
        out = {}
        for loss_type in DPO_LOSS_TYPES:
            eps = 0.1 if loss_type in SMOOTHED else 0.0
            out[loss_type] = dpo_loss(pc, pr, rc, rr, loss_type=loss_type, label_smoothing=eps)
        for divergence in DIVERGENCES:
            out[divergence] = dpo_loss(pc, pr, rc, rr, divergence=divergence)
        out["simpo"] = simpo_loss(pc / 10, pr / 10)
        out["cpo"] = cpo_loss(pc, pr, -pc / 10)
        out["orpo"] = orpo_loss(pc / 100, pr / 100, -pc / 100)
        out["kto"] = kto_loss(pc, rc, desirable, pr, rr)
        out["seq"] = sequence_logps(logp, mask, reduce="mean")
        return out

    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(6, generator=g) * 50 for _ in range(4))
    logp, mask = -torch.rand(6, 5, generator=g), torch.rand(6, 5, generator=g) > 0.3
    assert_no_host_sync(all_losses, pc, pr, rc, rr, logp, mask, torch.rand(6, generator=g) > 0.5)


@pytest.mark.parametrize("delta", [float("nan"), torch.zeros(3), torch.zeros(2), "0.1"])
def test_reprobe_bco_delta_must_be_a_finite_scalar(delta):
    # A [3] delta raised torch's size error, a [2] one broadcast per pair, NaN made every loss NaN.
    z = torch.zeros(2)
    with pytest.raises(ValueError, match="bco_delta: got"):
        dpo_loss(z, z, z, z, loss_type="bco_pair", bco_delta=delta)
    loss, _ = dpo_loss(z, z, z, z, loss_type="bco_pair", bco_delta=torch.tensor(0.0))
    assert torch.isfinite(loss).all()
