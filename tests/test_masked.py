import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.ops import masked_mean, masked_sum, masked_var, masked_whiten
from rlcore.testing import assert_close, assert_no_host_sync, token_batches
from rlcore.testing.reference import (
    masked_mean_ref,
    masked_sum_ref,
    masked_var_ref,
    masked_whiten_ref,
)

DTYPES = [torch.float32, torch.bfloat16]
DIMS = [None, 0, 1]


def _scale(values, mask):
    finite = values.double()[mask.bool()]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", DIMS)
@given(data=st.data())
def test_sum_mean_var_match_reference(dtype, dim, data):
    batch = data.draw(token_batches(dtype=dtype, patterns=("normal", "wide", "constant", "binary")))
    x, m = batch["values"], batch["mask"]
    scale = _scale(x, m)
    n = x.shape[1] if dim == 1 else (x.shape[0] if dim == 0 else x.numel())
    assert_close(masked_sum(x, m, dim), masked_sum_ref(x, m, dim), dtype=dtype, scale=scale * n)
    assert_close(masked_mean(x, m, dim), masked_mean_ref(x, m, dim), dtype=dtype, scale=scale)
    assert_close(masked_var(x, m, dim), masked_var_ref(x, m, dim), dtype=dtype, scale=scale * scale * 4)
    assert_close(
        masked_var(x, m, dim, unbiased=False),
        masked_var_ref(x, m, dim, unbiased=False),
        dtype=dtype,
        scale=scale**2 * 4,
    )


@pytest.mark.parametrize("dim", [None, 1])
@given(data=st.data(), shift=st.booleans())
def test_whiten_matches_reference(dim, data, shift):
    batch = data.draw(token_batches(patterns=("normal", "offset", "binary"), min_len=2))
    x, m = batch["values"], batch["mask"]
    got = masked_whiten(x, m, dim=dim, shift_mean=shift)
    want = masked_whiten_ref(x, m, dim=dim, shift_mean=shift)
    assert_close(got, want, dtype=torch.float32, scale=100.0 if not shift else 10.0)


@given(token_batches(min_len=3, patterns=("normal",), allow_empty_rows=False))
def test_whitened_values_have_zero_mean_unit_variance(batch):
    x, m = batch["values"], batch["mask"]
    if int(m.sum()) < 3:
        return
    w = masked_whiten(x, m)
    assert abs(float(masked_mean(w, m))) < 1e-4
    var = float(masked_var(x, m))
    if var > 1e-3:
        assert abs(float(masked_var(w, m)) - 1.0) < 1e-3
    assert torch.all(w[~m.bool()] == 0)


def test_padding_values_never_leak():
    x = torch.tensor([[1.0, float("nan"), float("inf")], [2.0, 4.0, -float("inf")]])
    m = torch.tensor([[1, 0, 0], [1, 1, 0]])
    for fn in (masked_sum, masked_mean, masked_var):
        assert torch.isfinite(fn(x, m)).all()
        assert torch.isfinite(fn(x, m, 1)).all()
    assert torch.isfinite(masked_whiten(x, m)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_mask_gives_zero_not_nan(dtype):
    x = torch.randn(3, 4).to(dtype)
    m = torch.zeros(3, 4, dtype=torch.bool)
    for fn in (masked_sum, masked_mean, masked_var):
        assert fn(x, m).item() == 0.0
        assert torch.equal(fn(x, m, 1), torch.zeros(3, dtype=dtype))
    assert torch.equal(masked_whiten(x, m), torch.zeros(3, 4, dtype=dtype))


def test_constant_values_with_eps_zero_whiten_to_zero():
    x = torch.full((2, 4), 3.7, requires_grad=True)
    m = torch.ones(2, 4)
    w = masked_whiten(x, m, eps=0.0)
    assert torch.equal(w, torch.zeros(2, 4))
    w.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_zero_size_inputs():
    x = torch.zeros(3, 0)
    m = torch.zeros(3, 0, dtype=torch.bool)
    assert masked_mean(x, m).item() == 0.0 and masked_var(x, m).item() == 0.0
    assert torch.equal(masked_mean(x, m, 1), torch.zeros(3))
    assert masked_whiten(x, m).shape == (3, 0)


def test_empty_mask_gradients_are_zero_not_nan():
    x = torch.randn(2, 5, requires_grad=True)
    m = torch.zeros(2, 5)
    (masked_mean(x, m) + masked_var(x, m) + masked_whiten(x, m).sum()).backward()
    assert torch.equal(x.grad, torch.zeros(2, 5))


def test_hand_computed_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    assert masked_sum(x, m).item() == 6.0
    assert masked_mean(x, m).item() == 2.0
    assert masked_var(x, m).item() == 1.0
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2.0 / 3.0)
    w = masked_whiten(x, m, eps=0.0)
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    w = masked_whiten(x, m, eps=0.0, shift_mean=False)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 3.0, 0.0]]))


def test_output_dtype_follows_input():
    x = torch.randn(4, 6).bfloat16()
    m = torch.ones(4, 6, dtype=torch.bool)
    for fn in (masked_sum, masked_mean, masked_var):
        assert fn(x, m).dtype == torch.bfloat16
    assert masked_whiten(x, m).dtype == torch.bfloat16


@settings(max_examples=15)
@given(token_batches(min_len=2, patterns=("normal",)))
def test_gradients_float64(batch):
    m = batch["mask"].double()
    x = torch.where(m.bool(), batch["values"].double(), 0.0).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: masked_mean(t, m, 1), (x,))
    assert torch.autograd.gradcheck(lambda t: masked_var(t, m, 1), (x,))
    assert torch.autograd.gradcheck(lambda t: masked_whiten(t, m, dim=1, eps=1e-2), (x,))


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"mask: got shape \(3, 4\), expected \(3, 5\) \(the shape of x\)"):
        masked_mean(torch.zeros(3, 5), torch.ones(3, 4))
    with pytest.raises(ValueError, match="values: got dtype torch.int64"):
        masked_whiten(torch.zeros(3, dtype=torch.int64), torch.ones(3))


def test_no_host_sync():
    x = torch.randn(4, 9)
    m = torch.rand(4, 9) > 0.4
    assert_no_host_sync(lambda a, b: (masked_sum(a, b), masked_mean(a, b, 1), masked_var(a, b)), x, m)
    assert_no_host_sync(lambda a, b: masked_whiten(a, b, dim=1), x, m)


# Re-probe of issue 18 ---------------------------------------------------------------------


@pytest.mark.parametrize("fn", [masked_sum, masked_mean, masked_var])
def test_reprobe_integer_values_are_rejected_not_truncated(fn):
    # masked_mean([1, 2]) came back as 1 (a float32 mean cast back to int64), and
    # masked_sum of 16777217 as 16777216 (float32 accumulation).
    with pytest.raises(ValueError, match="x: got dtype torch.int64, expected a floating-point dtype"):
        fn(torch.tensor([1, 2]), torch.tensor([1, 1]))


@pytest.mark.parametrize("fn", [masked_sum, masked_mean, masked_var, masked_whiten])
@pytest.mark.parametrize("dim", [2, -3, (0, 5)])
def test_reprobe_dim_out_of_range_names_dim(fn, dim):
    with pytest.raises(ValueError, match=r"dim: got .*, expected dimensions of a 2-D x"):
        fn(torch.ones(2, 3), torch.ones(2, 3), dim=dim)


@pytest.mark.parametrize("eps", [float("nan"), -1.0, float("inf")])
def test_reprobe_whiten_rejects_a_bad_eps(eps):
    with pytest.raises(ValueError, match="eps: got"):
        masked_whiten(torch.tensor([5.0, 6.0]), torch.ones(2), eps=eps)
