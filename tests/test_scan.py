import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.ops import discounted_cumsum, reverse_linear_scan
from rlcore.testing import assert_close, assert_no_host_sync, float_tensors
from rlcore.testing.reference import discounted_cumsum_ref, reverse_linear_scan_ref


@st.composite
def scan_inputs(draw, max_len=300):
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, max_len))
    x = draw(float_tensors((b, t), patterns=("normal", "binary", "constant")))
    kind = draw(st.sampled_from(["full", "row", "scalar-tensor", "with-zeros"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "full":
        c = torch.rand(b, t, generator=g)
    elif kind == "row":
        c = torch.rand(1, t, generator=g)
    elif kind == "scalar-tensor":
        c = torch.rand((), generator=g)
    else:
        c = torch.rand(b, t, generator=g) * (torch.rand(b, t, generator=g) > 0.2)
    return x, c


@given(scan_inputs())
def test_matches_loop_reference(inputs):
    x, c = inputs
    want = reverse_linear_scan_ref(x, c)
    assert_close(reverse_linear_scan(x, c), want, scale=max(1.0, float(want.abs().max())))


@settings(max_examples=10)
@given(scan_inputs(max_len=200))
def test_bfloat16_inputs(inputs):
    x, c = inputs
    xb = x.bfloat16()
    got = reverse_linear_scan(xb, c)
    assert got.dtype == torch.bfloat16
    want = reverse_linear_scan_ref(xb.double(), c)
    assert_close(got, want, dtype=torch.bfloat16, scale=max(1.0, float(want.abs().max())))


@pytest.mark.parametrize("gamma", [0.9, 0.99, 1.0])
def test_long_horizon_no_underflow(gamma):
    # T = 32768 with factors down to 0.9: the cumulative products underflow float32
    # long before the end, so any cumprod/divide formulation returns garbage.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 32768, generator=g)
    c = gamma - 0.1 * torch.rand(2, 32768, generator=g) * (gamma < 1.0)
    got = reverse_linear_scan(x, c)
    want = reverse_linear_scan_ref(x, c)
    rel = ((got.double() - want).abs() / want.abs().clamp_min(1.0)).max().item()
    assert rel < 1e-5, rel


def test_discounted_cumsum_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    torch.testing.assert_close(discounted_cumsum(x, 0.5), torch.tensor([[1 + 1 + 0.75, 2 + 1.5, 3.0]]))
    torch.testing.assert_close(discounted_cumsum(x, 1.0), torch.tensor([[6.0, 5.0, 3.0]]))
    torch.testing.assert_close(discounted_cumsum(x, 0.0), x)
    assert_close(discounted_cumsum(x, 0.3), discounted_cumsum_ref(x, 0.3))


@given(st.integers(1, 200), st.floats(0.0, 1.0))
def test_gamma_one_is_reverse_cumsum_and_linear(t, gamma):
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(3, t, generator=g), torch.randn(3, t, generator=g)
    torch.testing.assert_close(discounted_cumsum(x, 1.0), x.flip(-1).cumsum(-1).flip(-1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        discounted_cumsum(2 * x + y, gamma),
        2 * discounted_cumsum(x, gamma) + discounted_cumsum(y, gamma),
        rtol=1e-5,
        atol=1e-4,
    )


def test_zero_factor_cuts_the_recurrence():
    x = torch.tensor([1.0, 1.0, 1.0, 1.0])
    c = torch.tensor([1.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(reverse_linear_scan(x, c), torch.tensor([2.0, 1.0, 2.0, 1.0]))


@settings(max_examples=10)
@given(st.integers(1, 150), st.sampled_from(["full", "row"]))
def test_gradcheck_x_and_factors(t, kind):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(2, t, generator=g, dtype=torch.float64, requires_grad=True)
    shape = (2, t) if kind == "full" else (1, t)
    c = (torch.rand(shape, generator=g, dtype=torch.float64) * 0.95).requires_grad_(True)
    assert torch.autograd.gradcheck(reverse_linear_scan, (x, c))


def test_float32_gradient_matches_autograd_of_loop():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 130, generator=g, requires_grad=True)
    c = torch.rand(3, 130, generator=g, requires_grad=True)
    w = torch.randn(3, 130, generator=g)
    (reverse_linear_scan(x, c) * w).sum().backward()
    gx, gc = x.grad.clone(), c.grad.clone()
    x.grad = c.grad = None
    acc = torch.zeros(3)
    outs = []
    for t in reversed(range(130)):
        acc = x[:, t] + c[:, t] * acc
        outs.append(acc)
    (torch.stack(outs[::-1], -1) * w).sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gc, c.grad, rtol=1e-5, atol=1e-5)


def test_bad_input():
    with pytest.raises(ValueError, match=r"factors: got shape \(3,\), expected a shape broadcastable to \(2, 4\)"):
        reverse_linear_scan(torch.zeros(2, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="x: got dtype torch.int64"):
        reverse_linear_scan(torch.zeros(2, 4, dtype=torch.long), 0.5)
    assert reverse_linear_scan(torch.zeros(2, 0), 0.5).shape == (2, 0)


def test_no_host_sync():
    x = torch.randn(3, 200)
    c = torch.rand(3, 200)
    assert_no_host_sync(reverse_linear_scan, x, c)
    assert_no_host_sync(lambda a: discounted_cumsum(a, 0.97), x)


def test_inductor_compile_forward_backward():
    torch._dynamo.reset()
    x = torch.randn(2, 100, requires_grad=True)
    c = torch.rand(2, 100)
    f = torch.compile(lambda a, b: reverse_linear_scan(a, b).square().sum(), fullgraph=True)
    f(x, c).backward()
    gx = x.grad.clone()
    x.grad = None
    reverse_linear_scan(x, c).square().sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma", [float("nan"), float("inf"), -float("inf")])
def test_reprobe_non_finite_number_factors_are_rejected(gamma):
    # A NaN gamma turned every output into NaN without a word.
    x = torch.ones(1, 3)
    with pytest.raises(ValueError, match="factors: got"):
        discounted_cumsum(x, gamma)
    with pytest.raises(ValueError, match="factors: got"):
        reverse_linear_scan(x, gamma)
