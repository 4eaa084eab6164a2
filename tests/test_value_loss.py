import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.algos import value_loss
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.testing.loss_strategies import policy_batches


def _run(batch, **kw):
    values = batch["values"].clone().requires_grad_(True)
    loss, metrics = value_loss(values, batch["old_values"], batch["returns"], batch["mask"], **kw)
    loss.sum().backward()
    return loss, values.grad, metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=30)
@given(batch=policy_batches(), clip=st.sampled_from([None, 0.0, 0.2, 0.5]), data=st.data())
def test_matches_loop_reference(dtype, batch, clip, data):
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    loss, grad, metrics = _run(batch, clip=clip)
    want_loss, want_grad, want_metrics = ref.value_loss_ref(
        batch["values"], batch["old_values"], batch["returns"], batch["mask"], clip=clip
    )
    assert loss.dtype == dtype and grad.dtype == dtype
    assert_close(loss, want_loss, dtype=dtype, scale=10.0)
    assert_close(grad, want_grad, dtype=dtype, scale=10.0)
    assert set(metrics) == set(want_metrics)
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad
        assert_close(value, torch.tensor(want_metrics[key]), dtype=torch.float32, scale=10.0, msg=key)


@settings(max_examples=30)
@given(batch=policy_batches(dtype=torch.float64), clip=st.sampled_from([0.0, 0.1, 0.2]))
def test_clipped_loss_bounds_the_plain_loss(batch, clip):
    clipped, grad, metrics = _run(batch, clip=clip)
    plain, plain_grad, _ = _run(batch, clip=None)
    mask = batch["mask"]
    # The max makes the clipped loss pessimistic: never below 0.5 (v - R)^2.
    assert torch.all(clipped[mask] >= plain[mask])
    # Where the clipped error is the larger one, the token has no gradient.
    larger = mask & (clipped > plain)
    assert torch.all(grad[larger] == 0)
    torch.testing.assert_close(grad[mask & ~larger], plain_grad[mask & ~larger])
    assert_close(metrics["clip_frac"], larger.sum() / mask.sum().clamp(min=1))


@settings(max_examples=20)
@given(batch=policy_batches(dtype=torch.float64))
def test_unchanged_values_give_the_plain_squared_error(batch):
    batch["values"] = batch["old_values"]
    loss, _, metrics = _run(batch, clip=0.2)
    want = torch.where(batch["mask"], 0.5 * (batch["old_values"] - batch["returns"]) ** 2, 0.0)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    assert float(metrics["clip_frac"]) == 0.0


def test_hand_computed():
    # v moves from 0 to 1 (clipped to 0.2) with R = 2: 0.5 * max(1, 3.24) = 1.62, no gradient.
    # v moves from 0 to -0.5 (clipped to -0.2) with R = -1: 0.5 * max(0.25, 0.64) = 0.32.
    # v = 3, old 2.9, R = 0: inside the band, 0.5 * 9 = 4.5 with gradient v - R = 3.
    values = torch.tensor([[1.0, -0.5, 3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 2.9]], dtype=torch.float64)
    returns = torch.tensor([[2.0, -1.0, 0.0]], dtype=torch.float64)
    loss, m = value_loss(values, old, returns, torch.ones(1, 3))
    loss.sum().backward()
    torch.testing.assert_close(loss, torch.tensor([[1.62, 0.32, 4.5]], dtype=torch.float64))
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, 3.0]], dtype=torch.float64))
    assert float(m["clip_frac"]) == pytest.approx(2 / 3)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    values = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    old = values.detach() + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    returns = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    assert torch.autograd.gradcheck(lambda v: value_loss(v, old, returns, mask, clip=0.2)[0], (values,))


def test_bad_inputs_raise_value_error():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_values"):
        value_loss(x, torch.zeros(3, 2), x, torch.ones(2, 3))
    with pytest.raises(ValueError, match="returns"):
        value_loss(x, x, torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        value_loss(x, x, x, torch.ones(2, 2))
    with pytest.raises(ValueError, match="clip"):
        value_loss(x, x, x, torch.ones(2, 3), clip=-1.0)


def test_no_host_sync():
    g = torch.Generator().manual_seed(1)
    v, old, ret = (torch.randn(4, 5, generator=g) for _ in range(3))
    mask = torch.rand(4, 5, generator=g) > 0.3
    assert_no_host_sync(functools.partial(value_loss, clip=0.2), v, old, ret, mask)
