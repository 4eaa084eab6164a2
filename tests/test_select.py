"""rlcore.ops.masked_zero: torch.where(keep, x, 0) bit for bit, as a bitwise and, forward and backward."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.ops import keep_bits, masked_zero, masked_zero_
from rlcore.testing.reference import masked_zero_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -2.5, 1e-40, 3e38]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])


@st.composite
def _inputs(draw, dtypes=DTYPES):
    dtype = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    n = math.prod(shape)
    values = draw(st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(-1e4, 1e4)), min_size=n, max_size=n))
    x = torch.tensor(values, dtype=torch.float64).to(dtype).view(shape)
    # keep: the full shape, or broadcast along the last dimension (a per-row flag).
    kshape = shape if draw(st.booleans()) else (*shape[:-1], 1)
    flags = draw(st.lists(st.booleans(), min_size=math.prod(kshape), max_size=math.prod(kshape)))
    return x, torch.tensor(flags, dtype=torch.bool).view(kshape)


@settings(max_examples=80, deadline=None)
@given(_inputs())
def test_equals_the_loop_reference_and_torch_where_bit_for_bit(inputs):
    x, keep = inputs
    got = masked_zero(x, keep)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(_bits(got), _bits(masked_zero_ref(x, keep)))
    assert torch.equal(_bits(got), _bits(torch.where(keep, x, torch.zeros((), dtype=x.dtype))))
    # The bit pattern made once serves as well as the mask; in place gives the same bits.
    bits = keep_bits(keep, x.dtype)
    assert torch.equal(_bits(masked_zero(x, bits)), _bits(got))
    y = x.clone()
    assert masked_zero_(y, bits) is y
    assert torch.equal(_bits(y), _bits(got))


@settings(max_examples=40, deadline=None)
@given(_inputs())
def test_dropped_elements_are_positive_zero_kept_ones_untouched_and_it_is_idempotent(inputs):
    x, keep = inputs
    got = masked_zero(x, keep)
    full = keep.expand(x.shape)
    assert torch.all(_bits(got)[~full] == 0)  # +0.0 whatever was there: nan, inf, -0.0
    assert torch.equal(_bits(got)[full], _bits(x)[full])  # nan and -0.0 kept as they are
    assert torch.equal(_bits(masked_zero(got, keep)), _bits(got))
    assert torch.equal(_bits(x), _bits(x.clone()))  # x itself unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_gradient_equals_torch_wheres_and_nan_gradients_at_dropped_elements_vanish(dtype, data):
    x, keep = data.draw(_inputs(dtypes=[dtype]))
    g = torch.randn(x.shape, dtype=torch.float64).to(dtype)
    g[~keep.expand(x.shape)] = math.nan  # an upstream nan at padding does not come through
    a = x.clone().requires_grad_()
    masked_zero(a, keep).backward(g)
    b = x.clone().requires_grad_()
    torch.where(keep, b, torch.zeros((), dtype=dtype)).backward(g)
    assert torch.equal(_bits(a.grad), _bits(b.grad))


def test_gradcheck_in_float64():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(3, 5) > 0.4
    assert torch.autograd.gradcheck(lambda t: masked_zero(t, keep), (x,))
    assert torch.autograd.gradgradcheck(lambda t: masked_zero(t, keep) ** 2, (x,))


def test_an_expanded_gradient_is_zeroed_too():
    # A sum's backward hands on a stride-0 gradient: it is masked as it is.
    x = torch.randn(4, 6, requires_grad=True)
    keep = torch.rand(4, 6) > 0.5
    masked_zero(x, keep).sum().backward()
    assert torch.equal(x.grad, keep.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_host_sync_forward_and_backward(dtype):
    x = torch.randn(8, 16).to(dtype)
    keep = torch.rand(8, 16) > 0.3

    def step(t):
        return masked_zero(t, keep) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")  # a host sync would break the graph
    grads = []
    for f in (step, compiled):
        t = x.clone().requires_grad_()
        out = f(t)
        out.float().sum().backward()
        grads.append((out.detach(), t.grad))
    assert torch.equal(_bits(grads[0][0]), _bits(grads[1][0]))
    assert torch.equal(_bits(grads[0][1]), _bits(grads[1][1]))


def test_a_dtype_without_an_integer_view_falls_back_to_where():
    x = torch.tensor([1.0, math.nan, 2.0]).to(torch.float8_e4m3fn)
    keep = torch.tensor([True, False, False])
    assert keep_bits(keep, x.dtype) is keep
    assert masked_zero(x, keep).float().tolist() == [1.0, 0.0, 0.0]
    assert masked_zero_(x, keep).float().tolist() == [1.0, 0.0, 0.0]


def test_bad_input_is_a_value_error_naming_the_argument():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="keep: got dtype torch.float32, expected torch.bool"):
        keep_bits(torch.ones(2, 3), torch.float32)
    with pytest.raises(ValueError, match="x: got dtype torch.int64"):
        masked_zero(torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"keep: got dtype torch.int16, expected torch.bool or keep_bits"):
        masked_zero(x, keep_bits(torch.ones(2, 3, dtype=torch.bool), torch.bfloat16))
    with pytest.raises(ValueError, match=r"keep: got shape \(4, 3\), expected one broadcastable to x's \(2, 3\)"):
        masked_zero(x, torch.ones(4, 3, dtype=torch.bool))
    before = x.clone()
    with pytest.raises(ValueError, match="keep: got dtype torch.int64"):
        masked_zero_(x, torch.ones(2, 3, dtype=torch.int64))
    assert torch.equal(x, before)  # left unchanged
