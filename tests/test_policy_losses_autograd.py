"""The policy losses as autograd of their formulas: PPO's one-sided clip against the paper's
max/min form, gradients on the clip bounds, float16 saturation, and what is differentiated."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.testing import assert_close
from rlcore.testing import reference as ref
from rlcore.testing.loss_strategies import policy_batches

INPUTS = ("logp", "old_logp", "advantages", "mask")
F16_MAX = torch.finfo(torch.float16).max
LOSSES = {
    "ppo": (algos.ppo_clip_loss, ref.ppo_clip_loss_ref),
    "gspo": (algos.gspo_loss, ref.gspo_loss_ref),
    "cispo": (algos.cispo_loss, ref.cispo_loss_ref),
    "reinforce": (algos.reinforce_loss, ref.reinforce_loss_ref),
    "sapo": (algos.sapo_loss, ref.sapo_loss_ref),
    "gmpo": (algos.gmpo_loss, ref.gmpo_loss_ref),
}


def _saturate(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-F16_MAX, F16_MAX)


def _scale(x: torch.Tensor) -> float:
    return max(1.0, float(x.abs().max()) if x.numel() else 1.0)


def _ppo_max_min(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip, is_weights):
    """The paper's form, literally: max(-A r, -A clip(r)), then min(., -A c) where A < 0, in float64."""
    keep = mask.bool()
    lr = torch.where(keep, logp.double() - old_logp.double(), 0.0).clamp(-20.0, 20.0)
    r = lr.exp()
    a = torch.where(keep, advantages.double(), 0.0)
    loss = torch.maximum(-a * r, -a * r.clamp(1 - clip_low, 1 + clip_high))
    if dual_clip is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -a * dual_clip), loss)
    if is_weights is not None:
        loss = loss * torch.where(keep, is_weights.double(), 0.0)
    return loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=25, deadline=None)
@given(
    batch=policy_batches(drifts=("small", "large", "extreme")),
    data=st.data(),
)
def test_ppo_one_sided_clip_is_the_papers_max_min(dtype, batch, data):
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    kw = {
        "clip_low": data.draw(st.sampled_from([0.1, 0.2, 1.5])),
        "clip_high": data.draw(st.sampled_from([0.2, 0.28, 3.0])),
        "dual_clip": data.draw(st.sampled_from([None, 1.5, 3.0])),
        "is_weights": (torch.rand(batch["mask"].shape) + 0.5).to(dtype) if data.draw(st.booleans()) else None,
    }
    logp = batch["logp"].clone().requires_grad_(True)
    loss, _ = algos.ppo_clip_loss(logp, *(batch[k] for k in INPUTS[1:]), **kw)
    loss.sum().backward()
    lp64 = batch["logp"].double().requires_grad_(True)
    want = _ppo_max_min(lp64, *(batch[k] for k in INPUTS[1:]), **kw)
    want.sum().backward()
    want = torch.where(batch["mask"], want.detach(), 0.0)
    assert_close(loss, want, dtype=dtype, scale=_scale(want))
    assert_close(logp.grad, lp64.grad, dtype=dtype, scale=_scale(lp64.grad))


def _on_bound_batch(log_ratio: float, advantages: list[float]):
    logp = torch.full((1, len(advantages)), -0.5, dtype=torch.float64)
    old = logp - log_ratio
    adv = torch.tensor([advantages], dtype=torch.float64)
    return logp, old, adv, torch.ones_like(adv, dtype=torch.bool)


@pytest.mark.parametrize(
    ("name", "log_ratio", "advantages", "kw"),
    [
        # r = 1 exactly on both bounds of a zero-width band: A > 0 sits on the upper, A < 0 on the lower.
        ("ppo", 0.0, [2.0, -2.0], {"clip_low": 0.0, "clip_high": 0.0}),
        ("gspo", 0.0, [2.0, -2.0], {"clip_low": 0.0, "clip_high": 0.0}),
        # r = e, exactly the dual-clip constant, with A < 0.
        ("ppo", 1.0, [-2.0, -0.5], {"dual_clip": float(torch.tensor(1.0, dtype=torch.float64).exp())}),
    ],
)
def test_a_ratio_exactly_on_a_clip_bound_keeps_its_full_gradient(name, log_ratio, advantages, kw):
    """The clip zeroes the gradient only beyond a bound, as in the loop reference (torch.maximum
    and torch.minimum would halve it on the bound)."""
    fn, ref_fn = LOSSES[name]
    logp, old, adv, mask = _on_bound_batch(log_ratio, advantages)
    assert float((logp - old)[0, 0]) == log_ratio
    lp = logp.clone().requires_grad_(True)
    loss, _ = fn(lp, old, adv, mask, **kw)
    loss.sum().backward()
    want_loss, want_grad, _ = ref_fn(logp, old, adv, mask, **kw)
    assert (want_grad != 0).all()
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(lp.grad, want_grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", list(LOSSES))
@settings(max_examples=15, deadline=None)
@given(batch=policy_batches(dtype=torch.float16, drifts=("large", "extreme")), g=st.sampled_from([1.0, 4.0]))
def test_float16_loss_and_gradient_saturate_at_65504(name, batch, g):
    """Beyond float16's range a loss and its gradient are +-65504, never inf (nor a zero gradient)."""
    fn, ref_fn = LOSSES[name]
    logp = batch["logp"].clone().requires_grad_(True)
    loss, _ = fn(logp, *(batch[k] for k in INPUTS[1:]))
    loss.backward(torch.full_like(loss, g))
    want_loss, want_grad, _ = ref_fn(*(batch[k] for k in INPUTS))
    assert loss.dtype == torch.float16 and logp.grad.dtype == torch.float16
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    want_loss, want_grad = _saturate(want_loss), _saturate(g * want_grad)
    assert_close(loss, want_loss, scale=_scale(want_loss))
    assert_close(logp.grad, want_grad, scale=_scale(want_grad))


def test_float16_saturated_token_keeps_a_saturated_gradient():
    # r = e^19.5 with A = -1: the loss ~ 2.9e8 and its gradient are far beyond float16.
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.float16, requires_grad=True)
    old = torch.tensor([[-19.5, 0.0]], dtype=torch.float16)
    adv = torch.tensor([[-1.0, -1.0]], dtype=torch.float16)
    loss, _ = algos.ppo_clip_loss(logp, old, adv, torch.ones(1, 2))
    loss.sum().backward()
    assert loss.tolist() == [[F16_MAX, 1.0]]
    assert logp.grad.tolist() == [[F16_MAX, 1.0]]


@pytest.mark.parametrize("name", list(LOSSES))
def test_only_logp_is_differentiated(name):
    g = torch.Generator().manual_seed(2)
    logp = torch.rand(3, 4, generator=g).log().requires_grad_(True)
    old = (logp.detach() + 0.3 * torch.randn(3, 4, generator=g)).requires_grad_(True)
    adv = torch.randn(3, 4, generator=g).requires_grad_(True)
    kw = {"is_weights": torch.rand(3, 4, generator=g).requires_grad_(True)} if name == "ppo" else {}
    loss, metrics = LOSSES[name][0](logp, old, adv, torch.ones(3, 4), **kw)
    loss.sum().backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert old.grad is None and adv.grad is None
    assert all(w.grad is None for w in kw.values())
    assert not any(v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(LOSSES))
def test_compiled_fullgraph_forward_and_backward_match_eager(name, dtype):
    g = torch.Generator().manual_seed(3)
    logp = (torch.rand(4, 6, generator=g).log() - 2.0).to(dtype)
    old = (logp.float() + 3.0 * torch.randn(4, 6, generator=g)).to(dtype)
    adv = torch.randn(4, 6, generator=g).to(dtype)
    mask = torch.rand(4, 6, generator=g) > 0.3
    kw = {"dual_clip": 3.0} if name == "ppo" else {}
    fn = functools.partial(LOSSES[name][0], **kw)

    def step(lp):
        loss, metrics = fn(lp, old, adv, mask)
        return algos.aggregate(loss, mask, mode="token-mean"), metrics

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    grads = []
    for f in (step, compiled):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = f(lp)
        loss.backward()
        grads.append((loss.detach(), lp.grad, metrics))
    (want, want_grad, want_m), (got, got_grad, got_m) = grads
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    for key in want_m:
        torch.testing.assert_close(got_m[key], want_m[key], equal_nan=True)
