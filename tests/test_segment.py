import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.ops import segment_count, segment_mean, segment_mean_std, segment_std, segment_sum, segment_zscore
from rlcore.testing import assert_close, assert_no_host_sync, grouped_scores
from rlcore.testing.reference import segment_mean_ref, segment_std_ref, segment_sum_ref

DTYPES = [torch.float32, torch.bfloat16]


def _scale(x):
    return max(1.0, float(x.double().abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=grouped_scores(), unbiased=st.booleans())
def test_match_reference(dtype, data, unbiased):
    scores, ids = data
    x = scores.to(dtype)
    s = _scale(x)
    assert_close(segment_sum(x, ids), segment_sum_ref(x, ids), dtype=dtype, scale=s * len(x))
    assert_close(segment_mean(x, ids), segment_mean_ref(x, ids), dtype=dtype, scale=s)
    got = segment_std(x, ids, unbiased=unbiased)
    assert_close(got, segment_std_ref(x, ids, unbiased=unbiased), dtype=dtype, scale=s)
    mean, std = segment_mean_std(x, ids, unbiased=unbiased)
    assert torch.equal(mean, segment_mean(x, ids)) and torch.equal(std, got)


@given(data=grouped_scores(max_groups=4), width=st.integers(1, 3))
def test_trailing_dimensions(data, width):
    scores, ids = data
    x = torch.stack([scores * (k + 1) for k in range(width)], dim=1)
    assert segment_std(x, ids).shape == (int(ids.max()) + 1, width)
    assert_close(segment_std(x, ids), segment_std_ref(x, ids), scale=_scale(x))
    assert_close(segment_mean(x, ids), segment_mean_ref(x, ids), scale=_scale(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [0.1, 100.7, 1e6 + 0.3, -3.3e-5, 7.0])
@pytest.mark.parametrize("size", [2, 3, 16, 1000])
def test_constant_group_has_exactly_zero_std(dtype, value, size):
    other = torch.linspace(-1, 1, 5)
    x = torch.cat([torch.full((size,), value), other]).to(dtype)
    ids = torch.cat([torch.zeros(size, dtype=torch.long), torch.ones(5, dtype=torch.long)])
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(size))
    x, ids = x[perm], ids[perm]
    std = segment_std(x, ids)
    assert std[0].item() == 0.0
    assert std[1].item() > 0.0
    mean = segment_mean(x, ids)
    assert mean[0] == x[ids == 0][0]
    assert torch.all(x[ids == 0] - mean[ids[ids == 0]] == 0)


@given(grouped_scores(patterns=("constant",)))
def test_all_constant_groups_exact_zero(data):
    scores, ids = data
    assert torch.all(segment_std(scores, ids) == 0)
    assert torch.all(segment_std(scores.bfloat16(), ids) == 0)


def test_empty_and_singleton_segments():
    x = torch.tensor([5.0, 1.0, 3.0])
    ids = torch.tensor([3, 1, 1])
    assert segment_count(ids).tolist() == [0, 2, 0, 1]
    assert segment_sum(x, ids).tolist() == [0.0, 4.0, 0.0, 5.0]
    assert segment_mean(x, ids).tolist() == [0.0, 2.0, 0.0, 5.0]
    std = segment_std(x, ids)
    assert std[0] == 0 and std[2] == 0 and std[3] == 0  # empty, empty, one sample
    assert std[1].item() == pytest.approx(2**0.5)
    assert segment_std(x, ids, unbiased=False)[1].item() == pytest.approx(1.0)
    assert segment_std(x, ids, num_segments=6).shape == (6,)


def test_int32_group_ids_and_dtype():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).bfloat16()
    ids = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    out = segment_mean(x, ids)
    assert out.dtype == torch.bfloat16 and out.tolist() == [2.0, 3.0]


@settings(max_examples=15)
@given(grouped_scores(patterns=("normal",), max_groups=4, max_size=5))
def test_gradients(data):
    scores, ids = data
    x = scores.double().requires_grad_(True)
    n = int(ids.max()) + 1
    assert torch.autograd.gradcheck(lambda t: segment_mean(t, ids, num_segments=n), (x,))
    counts = segment_count(ids, num_segments=n)
    if bool((counts >= 2).all()):
        assert torch.autograd.gradcheck(lambda t: segment_std(t, ids, num_segments=n), (x,))


def test_gradient_of_constant_group_std_is_zero_not_nan():
    x = torch.tensor([2.0, 2.0, 1.0, 3.0], requires_grad=True)
    segment_std(x, torch.tensor([0, 0, 1, 1])).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[:2].tolist() == [0.0, 0.0]


def test_bad_input():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="group_ids: got dtype torch.float32, expected an integer dtype"):
        segment_mean(x, torch.zeros(4))
    with pytest.raises(ValueError, match=r"group_ids: got shape \(3,\), expected \(4,\)"):
        segment_sum(x, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"group_ids: got shape \(2, 2\) \(2-D\), expected 1-D"):
        segment_std(x, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="num_segments: got -1"):
        segment_std(x, torch.zeros(4, dtype=torch.long), num_segments=-1)


def test_no_host_sync_with_num_segments():
    x = torch.randn(12)
    ids = torch.arange(12) % 5
    assert_no_host_sync(
        lambda a: (
            segment_sum(a, ids, num_segments=5),
            segment_mean(a, ids, num_segments=5),
            segment_std(a, ids, num_segments=5),
        ),
        x,
    )


# ------------------------------------------------------------------ segment_zscore


def _zscore_ref(x, ids, eps, unbiased):
    """(x - mean) / (std + eps) from the loop references; 0 where the std is 0 and eps is 0."""
    n = int(ids.max()) + 1 if ids.numel() else 0
    mean = segment_mean_ref(x, ids, num_segments=n)[ids]
    std = segment_std_ref(x, ids, num_segments=n, unbiased=unbiased)[ids]
    dev = x.double() - mean
    return torch.where(std + eps > 0, dev / torch.where(std + eps > 0, std + eps, 1.0), 0.0)


def _layout(data, dtype):
    """Scores regrouped contiguously in equal groups: ``(x, ids, group_size)``."""
    size = data.draw(st.integers(1, 5), label="group_size")
    groups = data.draw(st.integers(1, 6), label="groups")  # the empty batch: its own test
    patterns = data.draw(st.lists(st.sampled_from(["normal", "constant", "binary"]), min_size=groups, max_size=groups))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    rows = []
    for p in patterns:
        row = {
            "normal": torch.randn(size, generator=g) * 3 + 100.7,
            "binary": torch.randint(0, 2, (size,), generator=g),
        }
        rows.append(row.get(p, torch.full((size,), 0.1)).double())
    x = (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float64)).to(dtype)
    return x, torch.arange(groups * size) // size, size


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25)
@given(data=grouped_scores(), unbiased=st.booleans(), eps=st.sampled_from([0.0, 1e-6, 0.5]))
def test_zscore_matches_reference(dtype, data, unbiased, eps):
    scores, ids = data
    x = scores.to(dtype)
    got = segment_zscore(x, ids, eps=eps, unbiased=unbiased)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, _zscore_ref(x, ids, eps, unbiased), dtype=dtype, scale=10.0)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25)
@given(data=st.data(), unbiased=st.booleans(), eps=st.sampled_from([0.0, 1e-6]))
def test_zscore_declared_layout_matches_reference_and_general_path(dtype, data, unbiased, eps):
    x, ids, size = _layout(data, dtype)
    got = segment_zscore(x, ids, group_size=size, eps=eps, unbiased=unbiased)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, _zscore_ref(x, ids, eps, unbiased), dtype=dtype, scale=10.0)
    general = segment_zscore(x, ids, eps=eps, unbiased=unbiased)
    torch.testing.assert_close(got, general, rtol=1e-6, atol=1e-6)
    assert torch.equal(segment_zscore(x, None, group_size=size, eps=eps, unbiased=unbiased), got)
    # Constant groups (and single-sample groups when unbiased) give exactly 0.
    rows = x.view(-1, size)
    flat = (rows == rows[:, :1]).all(1).repeat_interleave(size)
    assert torch.equal(got[flat], torch.zeros_like(got[flat]))


@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zscore_constant_group_exact_zero_non_finite_confined_large_spread(group_size, dtype):
    x = torch.tensor([100.7] * 4 + [1.0, 3.0, float("nan"), 2.0] + [1e30, -1e30, 5e29, 0.0]).to(dtype)
    ids = torch.arange(12) // 4
    got = segment_zscore(x, ids, group_size=group_size, eps=0.0)
    assert torch.equal(got[:4], torch.zeros(4, dtype=dtype))
    assert torch.isnan(got[4:8]).all()
    want = _zscore_ref(x[8:], torch.zeros(4, dtype=torch.long), 0.0, True)
    assert torch.isfinite(got[8:]).all() and got[8:].abs().max() > 0.5
    assert_close(got[8:], want, dtype=dtype, scale=2.0)


def test_zscore_empty_batch_and_gradients():
    empty = torch.zeros(0)
    assert segment_zscore(empty, torch.zeros(0, dtype=torch.long), num_segments=0).shape == (0,)
    assert segment_zscore(empty, torch.zeros(0, dtype=torch.long), group_size=4).shape == (0,)
    assert segment_zscore(empty, None, group_size=4).shape == (0,)
    x = torch.tensor([1.0, 2.0, 4.0, 3.0, 3.5, 0.5], dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([0, 0, 0, 1, 1, 2])
    assert torch.autograd.gradcheck(lambda t: segment_zscore(t, ids, num_segments=3), (x,))
    y = torch.tensor([1.0, 2.0, 4.0, 3.0, 3.0, 0.5], requires_grad=True)
    segment_zscore(y, ids, eps=0.0).sum().backward()
    assert torch.isfinite(y.grad).all()  # constant and single-sample groups: no inf/NaN gradient
    assert y.grad[3:].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(segment_zscore(x.detach(), ids), segment_zscore(x.detach().float(), ids).double())


def test_zscore_bad_input_and_layout_check():
    x = torch.zeros(6)
    with pytest.raises(ValueError, match="group_ids: got ids that are not the contiguous layout"):
        segment_zscore(x, torch.tensor([0, 0, 1, 1, 2, 2]), group_size=3)
    with pytest.raises(ValueError, match="group_size: got 4"):
        segment_zscore(x, torch.zeros(6, dtype=torch.long), group_size=4)
    with pytest.raises(ValueError, match="group_size: got 0"):
        segment_zscore(x, torch.zeros(6, dtype=torch.long), group_size=0)
    with pytest.raises(ValueError, match="num_segments: got 3"):
        segment_zscore(x, torch.arange(6) // 3, group_size=3, num_segments=3)
    with pytest.raises(ValueError, match="group_ids: got None"):
        segment_zscore(x, None)
    with pytest.raises(ValueError, match="eps: got -1"):
        segment_zscore(x, torch.arange(6) // 3, eps=-1.0)
    with pytest.raises(ValueError, match="x: got dtype torch.int64"):
        segment_zscore(torch.zeros(6, dtype=torch.long), torch.arange(6) // 3)


def test_zscore_no_host_sync():
    x = torch.randn(12)
    assert_no_host_sync(lambda a: segment_zscore(a, torch.arange(12) % 5, num_segments=5), x)
    assert_no_host_sync(lambda a: segment_zscore(a, torch.arange(12) // 4, group_size=4), x)
    assert_no_host_sync(lambda a: segment_zscore(a, None, group_size=4), x)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16])
def test_reprobe_narrow_integer_group_ids_work_like_int64(dtype):
    # uint8 ids passed the dtype check and then failed inside scatter with a raw torch error.
    x = torch.tensor([1.0, 2.0, 4.0])
    ids = torch.tensor([0, 1, 1])
    for fn in (segment_sum, segment_mean, segment_std):
        torch.testing.assert_close(fn(x, ids.to(dtype)), fn(x, ids))
        torch.testing.assert_close(fn(x, ids.to(dtype), num_segments=2), fn(x, ids))
    torch.testing.assert_close(segment_count(ids.to(dtype)), segment_count(ids))
