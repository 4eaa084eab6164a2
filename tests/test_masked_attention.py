"""masked_attention: the loop reference, SDPA, its gradients, its invariants, no host sync; the models' dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.models import attention as model_attention
from rlcore.ops import masked_attention
from rlcore.testing import assert_no_host_sync
from rlcore.testing.reference import masked_attention_ref

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@st.composite
def problems(draw, *, every_query_attends=False):
    """``(q, k, v, mask, scale)``: grouped heads, a mask of any broadcast shape, random keys allowed."""
    b, kv, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    t, s, d = draw(st.integers(1, 6)), draw(st.integers(1, 7)), draw(st.integers(1, 8))
    h = kv * group
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(b, h, t, d, generator=g) * draw(st.sampled_from([0.5, 1.0, 3.0]))
    k, v = torch.randn(2, b, kv, s, d, generator=g)
    shape = (draw(st.sampled_from([1, b])), draw(st.sampled_from([1, h])), t, s)
    mask = torch.rand(shape, generator=g) < draw(st.sampled_from([0.3, 0.7, 1.0]))
    if every_query_attends:
        mask[..., draw(st.integers(0, s - 1))] = True
    return q, k, v, mask, draw(st.sampled_from([d**-0.5, 1.0, 0.2]))


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40, deadline=None)
@given(problems())
def test_matches_loop_reference(dtype, problem):
    q, k, v, mask, scale = problem
    got = masked_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, scale=scale)
    assert got.dtype == dtype and got.shape == q.shape
    want = masked_attention_ref(q.to(dtype), k.to(dtype), v.to(dtype), mask, scale)
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@settings(max_examples=30, deadline=None)
@given(problems(every_query_attends=True))
def test_equals_sdpa_in_value_and_gradient_when_every_query_attends(problem):
    q, k, v, mask, scale = problem
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    theirs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = masked_attention(*ours, mask, scale=scale)
    want = F.scaled_dot_product_attention(*theirs, attn_mask=mask, scale=scale, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn_like(out)
    out.backward(cotangent)
    want.backward(cotangent)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(problems())
def test_gradcheck_float64(problem):
    q, k, v = (x.double().requires_grad_() for x in problem[:3])
    mask, scale = problem[3], problem[4]
    assert torch.autograd.gradcheck(lambda a, b, c: masked_attention(a, b, c, mask, scale=scale), (q, k, v))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bfloat16_gradients_follow_float32(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), *torch.randn(2, 2, 2, 6, 8, generator=g)
    mask = torch.rand(2, 1, 5, 6, generator=g) < 0.6
    mask[..., 0] = True
    grads = []
    for kind in (torch.float32, dtype):
        xs = [x.to(kind).clone().requires_grad_() for x in (q, k, v)]
        masked_attention(*xs, mask, scale=0.35).float().square().sum().backward()
        assert all(x.grad.dtype == kind for x in xs)
        grads.append([x.grad.float() for x in xs])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=TOL[dtype] * 2, atol=TOL[dtype] * 2)


@settings(max_examples=25, deadline=None)
@given(problems(), st.data())
def test_permuting_keys_with_the_mask_changes_nothing(problem, data):
    q, k, v, mask, scale = problem
    order = torch.tensor(data.draw(st.permutations(range(k.shape[2]))))
    got = masked_attention(q, k[:, :, order], v[:, :, order], mask[..., order], scale=scale)
    torch.testing.assert_close(got, masked_attention(q, k, v, mask, scale=scale), rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(problems())
def test_outputs_are_convex_combinations_of_the_allowed_values(problem):
    q, k, v, mask, scale = problem
    out = masked_attention(q, k, v, mask, scale=scale)
    b, h, t, s = out.shape[0], out.shape[1], out.shape[2], k.shape[2]
    allowed = mask.expand(b, h, t, s)
    values = v.repeat_interleave(h // k.shape[1], 1)[:, :, None]  # [B, H, 1, S, D]
    big = torch.finfo(v.dtype).max
    low = torch.where(allowed[..., None], values, big).amin(3)
    high = torch.where(allowed[..., None], values, -big).amax(3)
    some = allowed.any(-1, keepdim=True)
    assert bool(((out >= low - 1e-5) & (out <= high + 1e-5) | ~some).all())
    assert bool((out[~some.expand_as(out)] == 0).all())  # a query with no key: zeros


def test_a_query_with_no_key_gets_zeros_and_passes_no_gradient():
    q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = masked_attention(q, k, v, mask, scale=0.5)
    assert bool((out[:, :, 1] == 0).all()) and torch.isfinite(out).all()
    out.sum().backward()
    assert bool((q.grad[:, :, 1] == 0).all())
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_no_host_sync():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), *torch.randn(2, 2, 2, 6, 8, generator=g)
    mask = torch.rand(2, 4, 5, 6, generator=g) < 0.5
    assert_no_host_sync(lambda a, b, c: masked_attention(a, b, c, mask, scale=0.3), q, k, v)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda q, k, v, m: (q[0], k, v, m), r"query: got shape .*expected 4-D"),
        (lambda q, k, v, m: (q, k.double(), v, m), r"key, value: got torch.float64 and torch.float32, expected"),
        (lambda q, k, v, m: (q, k[:, :, :, :3], v, m), r"key: got shape \(2, 2, 6, 3\), expected \[2, KV, S, 8\]"),
        (lambda q, k, v, m: (q[:, :3], k, v, m), r"with KV dividing the query's 3 heads"),
        (
            lambda q, k, v, m: (q, k, v[:, :, :5], m),
            r"value: got shape \(2, 2, 5, 8\), expected \(2, 2, 6, 8\) \(the shape of key\)",
        ),
        (lambda q, k, v, m: (q, k, v, m.float()), r"mask: got dtype torch.float32, expected torch.bool"),
        (
            lambda q, k, v, m: (q, k, v, m[..., :5]),
            r"mask: got shape \(2, 1, 5, 5\), expected \[2 or 1, 1 or 4, 5, 6\]",
        ),
        (lambda q, k, v, m: (q.long(), k, v, m), r"query: got dtype torch.int64, expected a floating-point dtype"),
    ],
)
def test_bad_input_is_refused_clearly(change, match):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=match):
        masked_attention(*change(q, k, v, mask), scale=0.3)


@pytest.mark.parametrize("keys", [model_attention.CPU_SMALL_KEYS, model_attention.CPU_SMALL_KEYS + 1])
def test_models_dispatch_small_problems_to_masked_attention_and_others_to_sdpa(keys, monkeypatch):
    calls = []
    monkeypatch.setattr(model_attention, "masked_attention", lambda *a, **kw: calls.append("ours") or a[0])
    monkeypatch.setattr(
        model_attention.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append("sdpa") or a[0]
    )
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, keys, 4)
    model_attention.attend_masked(q, k, k, torch.ones(1, 1, 3, keys, dtype=torch.bool), scale=0.5)
    assert calls == (["ours"] if keys <= model_attention.CPU_SMALL_KEYS else ["sdpa"])
