import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.ops import linear_logprobs, logprobs_from_logits
from rlcore.testing import assert_no_host_sync
from rlcore.testing.allocations import record_allocations
from rlcore.testing.reference import linear_logprobs_ref
from rlcore.testing.token_strategies import chunk_sizes, hidden_weight_labels

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
temperatures = st.sampled_from([1.0, 0.6, 1.7])


def _close(actual, expected, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=hidden_weight_labels(), chunk=chunk_sizes(), vchunk=chunk_sizes(48), temperature=temperatures)
def test_values_match_loop_reference(dtype, data, chunk, vchunk, temperature):
    hidden, weight, labels = (t.to(dtype) if t.is_floating_point() else t for t in data)
    logp, ent = linear_logprobs(
        hidden, weight, labels, temperature=temperature, chunk_size=chunk, vocab_chunk_size=vchunk, with_entropy=True
    )
    want_logp, want_ent = linear_logprobs_ref(hidden, weight, labels, temperature=temperature)
    assert logp.dtype == dtype and ent.dtype == dtype
    _close(logp, want_logp, dtype)
    _close(ent, want_ent, dtype)
    only = linear_logprobs(hidden, weight, labels, temperature=temperature, chunk_size=chunk, vocab_chunk_size=vchunk)
    _close(only, want_logp, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", [False, True])
@given(
    data=hidden_weight_labels(),
    chunk=chunk_sizes(),
    vchunk=chunk_sizes(48),
    temperature=temperatures,
    seed=st.integers(0, 2**16),
)
def test_gradients_match_matmul_then_log_softmax(dtype, with_entropy, data, chunk, vchunk, temperature, seed):
    hidden, weight, labels = data
    g = torch.Generator().manual_seed(seed)
    g1, g2 = torch.randn(2, labels.shape[0], generator=g, dtype=torch.float64)
    h = hidden.to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    out = linear_logprobs(
        h, w, labels, temperature=temperature, chunk_size=chunk, vocab_chunk_size=vchunk, with_entropy=with_entropy
    )
    lp, ent = out if with_entropy else (out, None)
    loss = (lp.double() * g1).sum() + ((ent.double() * g2).sum() if with_entropy else 0.0)
    loss.backward()
    hr = h.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    logsm = torch.log_softmax(hr @ wr.T / temperature, -1)
    ref = (logsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1) * g1).sum()
    if with_entropy:
        ref = ref + (-(logsm.exp() * logsm).sum(-1) * g2).sum()
    ref.backward()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    _close(h.grad, hr.grad, dtype)
    _close(w.grad, wr.grad, dtype)


@settings(max_examples=10)
@given(data=hidden_weight_labels(max_tokens=6, max_hidden=4, max_vocab=9), chunk=chunk_sizes(4), vchunk=chunk_sizes(9))
def test_gradcheck_float64(data, chunk, vchunk):
    hidden, weight, labels = (t.double() if t.is_floating_point() else t for t in data)
    h, w = hidden.requires_grad_(), weight.requires_grad_()

    def fn(a, b):
        return linear_logprobs(
            a, b, labels, temperature=0.8, chunk_size=chunk, vocab_chunk_size=vchunk, with_entropy=True
        )

    assert torch.autograd.gradcheck(fn, (h, w))


@given(data=hidden_weight_labels(), chunk=chunk_sizes(), vchunk=chunk_sizes(48), temperature=temperatures)
def test_equals_logprobs_of_the_logits(data, chunk, vchunk, temperature):
    hidden, weight, labels = (t.double() if t.is_floating_point() else t for t in data)
    fused = linear_logprobs(
        hidden, weight, labels, temperature=temperature, chunk_size=chunk, vocab_chunk_size=vchunk, with_entropy=True
    )
    plain = logprobs_from_logits(hidden @ weight.T, labels, temperature=temperature, with_entropy=True)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_hand_computed_values():
    # Logits [0, 1, 0] and [0, 0, 2]: logp = 1 - log(2 + e), 2 - log(2 + e^2).
    hidden = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    weight = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    logp, ent = linear_logprobs(hidden, weight, torch.tensor([1, 2]), vocab_chunk_size=1, with_entropy=True)
    want = torch.tensor([1 - math.log(2 + math.e), 2 - math.log(2 + math.e**2)])
    torch.testing.assert_close(logp, want)
    p = torch.tensor([[1.0, math.e, 1.0], [1.0, 1.0, math.e**2]])
    p = p / p.sum(-1, keepdim=True)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))


def test_never_allocates_tokens_by_vocab():
    n, hsize, vocab, chunk, vchunk = 96, 8, 120, 32, 40
    torch.manual_seed(0)
    h = torch.randn(n, hsize, requires_grad=True)
    w = torch.randn(vocab, hsize, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    with record_allocations() as shapes:
        lp, ent = linear_logprobs(h, w, labels, chunk_size=chunk, vocab_chunk_size=vchunk, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    sizes = [math.prod(s) for s in shapes]
    # Nothing larger than one block or the weight (its gradient): never [N, V] nor [chunk, V].
    assert max(sizes) <= max(chunk * vchunk, vocab * hsize)
    assert (n, vocab) not in shapes and (chunk, vocab) not in shapes
    assert h.grad.shape == h.shape and w.grad.shape == w.shape


def test_backward_saves_only_inputs_and_per_token_stats():
    n, hsize, vocab = 40, 6, 50
    h = torch.randn(n, hsize, requires_grad=True)
    w = torch.randn(vocab, hsize, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        linear_logprobs(h, w, torch.randint(0, vocab, (n,)), chunk_size=16, vocab_chunk_size=16, with_entropy=True)
    inputs = {h.data_ptr(), w.data_ptr()}
    assert sum(t.numel() for t in saved if t.data_ptr() not in inputs) <= 5 * n


def test_frozen_weight_or_hidden_gets_no_gradient():
    torch.manual_seed(3)
    h = torch.randn(7, 4, requires_grad=True)
    w = torch.randn(11, 4)
    linear_logprobs(h, w, torch.randint(0, 11, (7,)), chunk_size=3, vocab_chunk_size=4).sum().backward()
    assert h.grad is not None and w.grad is None
    h2, w2 = torch.randn(7, 4), torch.randn(11, 4, requires_grad=True)
    linear_logprobs(h2, w2, torch.randint(0, 11, (7,)), chunk_size=3, vocab_chunk_size=4).sum().backward()
    assert w2.grad is not None and h2.grad is None


def test_leading_dimensions():
    torch.manual_seed(4)
    h, w = torch.randn(2, 3, 5), torch.randn(13, 5)
    labels = torch.randint(0, 13, (2, 3))
    got = linear_logprobs(h, w, labels, chunk_size=4, vocab_chunk_size=5)
    want = linear_logprobs(h.reshape(6, 5), w, labels.reshape(6), chunk_size=4, vocab_chunk_size=5)
    assert got.shape == (2, 3)
    torch.testing.assert_close(got.reshape(6), want)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_no_host_sync(with_entropy):
    torch.manual_seed(5)
    h, w = torch.randn(10, 6), torch.randn(17, 6)
    labels = torch.randint(0, 17, (10,))

    def fn(a, b, y):
        return linear_logprobs(a, b, y, temperature=0.9, chunk_size=4, vocab_chunk_size=5, with_entropy=with_entropy)

    assert_no_host_sync(fn, h, w, labels)


def test_out_of_range_label_is_nan_when_compiled():
    h, w = torch.randn(3, 4), torch.randn(5, 4)
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, y: linear_logprobs(a, b, y, vocab_chunk_size=2), fullgraph=True, backend="eager")
    got = fn(h, w, torch.tensor([0, 5, 4]))
    assert torch.isnan(got[1]) and torch.isfinite(got[0]) and torch.isfinite(got[2])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda h, w, y: linear_logprobs(h, w[:, :3], y),
            r"weight: got shape \(5, 3\), expected \(V, 4\) \(the hidden size of hidden",
        ),
        (lambda h, w, y: linear_logprobs(h, w.double(), y), r"weight: got dtype torch.float64, expected torch.float32"),
        (lambda h, w, y: linear_logprobs(h, w[0], y), r"weight: got shape \(4\) \(1-D\), expected 2-D"),
        (
            lambda h, w, y: linear_logprobs(h, w, torch.tensor([0, 5, 1])),
            r"labels: got values in \[0, 5\], expected token ids in \[0, 4\]",
        ),
        (lambda h, w, y: linear_logprobs(h, w, y[:2]), r"labels: got shape \(2,\), expected \(3,\)"),
        (
            lambda h, w, y: linear_logprobs(h, w, y, vocab_chunk_size=0),
            r"vocab_chunk_size: got 0, expected a positive int",
        ),
        (lambda h, w, y: linear_logprobs(h, w, y, temperature=-1.0), r"temperature: got -1.0"),
        (lambda h, w, y: linear_logprobs(h.long(), w, y), r"hidden: got dtype torch.int64"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    h, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 4])
    with pytest.raises(ValueError, match=match):
        call(h, w, y)
