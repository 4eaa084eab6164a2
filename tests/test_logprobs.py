import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.ops import entropy_from_logits, logprobs_from_logits
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing.allocations import record_allocations
from rlcore.testing.reference import entropy_ref, logprobs_ref
from rlcore.testing.token_strategies import chunk_sizes, lm_logits_and_labels

DTYPES = [torch.float32, torch.bfloat16]
# The bar: 1e-5 in float32, 2e-2 in bfloat16, against float64 on the same (rounded) inputs.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
temperatures = st.sampled_from([1.0, 0.6, 1.7])


def _close(actual, expected, dtype, msg=""):
    tol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol, equal_nan=True, msg=msg or None)


def _plain(logits, labels, temperature):
    """The plain path: log_softmax + gather, and -sum(p log p), in float64 autograd.

    ``-inf`` logits become a finite value so low that its probability is exactly 0 in
    float64 (the plain formula would give 0 * -inf = nan in the entropy).
    """
    x = logits.double()
    finite_min = torch.where(torch.isfinite(x), x, 0.0).amin(-1, keepdim=True)
    x = torch.where(torch.isinf(x), finite_min - 1e4, x).requires_grad_()
    logsm = torch.log_softmax(x / temperature, -1)
    logp = logsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    return x, logp, ent


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=lm_logits_and_labels(), chunk=chunk_sizes(), temperature=temperatures)
def test_values_match_loop_reference(dtype, data, chunk, temperature):
    logits, labels = data
    logits = logits.to(dtype)
    logp, ent = logprobs_from_logits(logits, labels, temperature=temperature, chunk_size=chunk, with_entropy=True)
    want_logp, want_ent = logprobs_ref(logits, labels, temperature=temperature)
    assert logp.dtype == dtype and ent.dtype == dtype and logp.shape == labels.shape
    _close(logp, want_logp, dtype)
    _close(ent, want_ent, dtype)
    _close(logprobs_from_logits(logits, labels, temperature=temperature, chunk_size=chunk), want_logp, dtype)
    _close(
        entropy_from_logits(logits, temperature=temperature, chunk_size=chunk),
        entropy_ref(logits, temperature=temperature),
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outputs", ["logp", "entropy", "both"])
@given(data=lm_logits_and_labels(), chunk=chunk_sizes(), temperature=temperatures, seed=st.integers(0, 2**16))
def test_gradients_match_plain_log_softmax_gather(dtype, outputs, data, chunk, temperature, seed):
    logits, labels = data
    logits = logits.to(dtype)
    g = torch.Generator().manual_seed(seed)
    g1, g2 = torch.randn(2, *labels.shape, generator=g, dtype=torch.float64)
    x = logits.clone().requires_grad_()
    if outputs == "entropy":
        loss = (entropy_from_logits(x, temperature=temperature, chunk_size=chunk).double() * g2).sum()
    elif outputs == "logp":
        loss = (logprobs_from_logits(x, labels, temperature=temperature, chunk_size=chunk).double() * g1).sum()
    else:
        lp, h = logprobs_from_logits(x, labels, temperature=temperature, chunk_size=chunk, with_entropy=True)
        loss = (lp.double() * g1 + h.double() * g2).sum()
    loss.backward()
    xr, lp_r, h_r = _plain(logits, labels, temperature)
    ref = {"logp": lp_r * g1, "entropy": h_r * g2, "both": lp_r * g1 + h_r * g2}[outputs]
    ref.sum().backward()
    assert x.grad.dtype == dtype
    _close(x.grad, xr.grad, dtype)


@settings(max_examples=10)
@given(data=lm_logits_and_labels(max_tokens=8, max_vocab=7), chunk=chunk_sizes(5), temperature=temperatures)
def test_gradcheck_float64(data, chunk, temperature):
    logits, labels = data
    x = logits.double().nan_to_num(neginf=-30.0).requires_grad_()

    def both(a):
        return logprobs_from_logits(a, labels, temperature=temperature, chunk_size=chunk, with_entropy=True)

    assert torch.autograd.gradcheck(both, (x,))
    assert torch.autograd.gradcheck(lambda a: entropy_from_logits(a, temperature=temperature, chunk_size=chunk), (x,))


def test_hand_computed_values():
    # p = (1/4, 3/4): logp = log(1/4), log(3/4); H = -(1/4 log 1/4 + 3/4 log 3/4).
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    logp, ent = logprobs_from_logits(logits, torch.tensor([0, 1]), with_entropy=True)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(logp, torch.tensor([math.log(0.25), math.log(0.75)], dtype=torch.float64))
    assert_close(ent, torch.tensor([h, h], dtype=torch.float64))
    # Temperature 2 on doubled logits is the same distribution.
    logp_t = logprobs_from_logits(2 * logits, torch.tensor([0, 1]), temperature=2.0)
    assert_close(logp_t, torch.tensor([math.log(0.25), math.log(0.75)], dtype=torch.float64))
    # A masked vocabulary entry has probability 0 and adds nothing to the entropy.
    masked = torch.tensor([[0.0, math.log(3.0), -math.inf]])
    lp, e = logprobs_from_logits(masked, torch.tensor([1]), with_entropy=True)
    assert_close(lp, torch.tensor([math.log(0.75)], dtype=torch.float64))
    assert_close(e, torch.tensor([h], dtype=torch.float64))


@given(
    data=lm_logits_and_labels(max_lead=1, max_tokens=12, max_vocab=20), chunk=chunk_sizes(), temperature=temperatures
)
def test_distribution_properties(data, chunk, temperature):
    logits, labels = data
    n, vocab = logits.shape
    logp, ent = logprobs_from_logits(logits, labels, temperature=temperature, chunk_size=chunk, with_entropy=True)
    assert torch.all(logp <= 1e-6)
    assert torch.all(ent >= -1e-5) and torch.all(ent <= math.log(vocab) + 1e-5)
    # Summed over every possible label, the probabilities are 1.
    every = torch.arange(vocab).expand(n, vocab)
    all_logp = logprobs_from_logits(logits.unsqueeze(1).expand(n, vocab, vocab), every, temperature=temperature)
    torch.testing.assert_close(all_logp.double().exp().sum(-1), torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-5)
    # Invariant to a per-token shift of the logits; temperature is division of the logits.
    shift = torch.randn(n, 1) * 5
    logp_s, ent_s = logprobs_from_logits(
        logits + shift, labels, temperature=temperature, chunk_size=chunk, with_entropy=True
    )
    assert_close(logp_s, logp.double(), scale=50)
    assert_close(ent_s, ent.double(), scale=50)
    assert_close(logprobs_from_logits(logits / temperature, labels), logp.double(), scale=10)


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=lm_logits_and_labels(), chunk=chunk_sizes())
def test_chunk_size_does_not_change_results(dtype, data, chunk):
    logits, labels = data
    x1 = logits.to(dtype).requires_grad_()
    x2 = logits.to(dtype).requires_grad_()
    a = logprobs_from_logits(x1, labels, chunk_size=chunk, with_entropy=True)
    b = logprobs_from_logits(x2, labels, chunk_size=10**6, with_entropy=True)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)
    (a[0].float().sum() + a[1].float().sum()).backward()
    (b[0].float().sum() + b[1].float().sum()).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)


def test_caller_logits_untouched_and_one_gradient_buffer():
    torch.manual_seed(0)
    for dtype, temperature in [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.0)]:
        logits = torch.randn(9, 13).to(dtype).requires_grad_()
        before = logits.detach().clone()
        labels = torch.randint(0, 13, (9,))
        lp, h = logprobs_from_logits(logits, labels, temperature=temperature, chunk_size=4, with_entropy=True)
        (lp.sum() + h.sum()).backward()
        assert torch.equal(logits.detach(), before)
        assert logits.grad.dtype == dtype and logits.grad.data_ptr() != logits.data_ptr()


def test_backward_saves_nothing_vocab_sized():
    n, vocab = 64, 1000
    logits = torch.randn(n, vocab, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, h = logprobs_from_logits(logits, labels, chunk_size=16, with_entropy=True)
    # The logits themselves (already alive) plus O(tokens): never a [tokens, vocab] softmax.
    others = [t for t in saved if t.data_ptr() != logits.data_ptr()]
    assert any(t.data_ptr() == logits.data_ptr() for t in saved)
    assert sum(t.numel() for t in others) <= 8 * n
    (lp.sum() + h.sum()).backward()
    assert logits.grad.shape == (n, vocab)


def test_bfloat16_accumulates_in_float32():
    # A bfloat16 softmax of 2000 equal logits sums 2000 rounded terms; float32 accumulation
    # gets log(1/2000) to bfloat16 output precision.
    logits = torch.full((3, 2000), 100.0, dtype=torch.bfloat16)
    lp, h = logprobs_from_logits(logits, torch.tensor([0, 5, 1999]), with_entropy=True)
    assert_close(lp, torch.full((3,), -math.log(2000.0), dtype=torch.float64), dtype=torch.bfloat16)
    assert_close(h, torch.full((3,), math.log(2000.0), dtype=torch.float64), dtype=torch.bfloat16)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_no_host_sync(with_entropy):
    torch.manual_seed(1)
    logits = torch.randn(2, 7, 11)
    labels = torch.randint(0, 11, (2, 7))

    def fn(x, y):
        return logprobs_from_logits(x, y, temperature=0.8, chunk_size=5, with_entropy=with_entropy)

    assert_no_host_sync(fn, logits, labels)
    assert_no_host_sync(lambda x: entropy_from_logits(x, chunk_size=3), logits)


def test_compiled_backward_matches_eager():
    torch.manual_seed(2)
    logits = torch.randn(10, 9)
    labels = torch.randint(0, 9, (10,))

    def loss(x):
        lp, h = logprobs_from_logits(x, labels, chunk_size=4, with_entropy=True)
        return (lp * torch.arange(10.0)).sum() + h.sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    xa, xb = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    compiled(xa).backward()
    loss(xb).backward()
    torch.testing.assert_close(xa.grad, xb.grad)


def test_out_of_range_label_is_nan_without_sync_when_compiled():
    logits = torch.randn(4, 6)
    labels = torch.tensor([0, 6, 2, -1])
    torch._dynamo.reset()
    got = torch.compile(lambda x, y: logprobs_from_logits(x, y, chunk_size=3), fullgraph=True, backend="eager")(
        logits, labels
    )
    assert torch.isnan(got[1]) and torch.isnan(got[3])
    assert torch.isfinite(got[0]) and torch.isfinite(got[2])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda x, y: logprobs_from_logits(x, torch.tensor([0, 1, 6])),
            r"labels: got values in \[0, 6\], expected token ids in \[0, 5\]",
        ),
        (lambda x, y: logprobs_from_logits(x, torch.tensor([0, -1, 2])), r"labels: got values in \[-1, 2\]"),
        (lambda x, y: logprobs_from_logits(x, y[:2]), r"labels: got shape \(2,\), expected \(3,\)"),
        (lambda x, y: logprobs_from_logits(x, y.float()), r"labels: got dtype torch.float32, expected an integer"),
        (lambda x, y: logprobs_from_logits(x.long(), y), r"logits: got dtype torch.int64, expected a floating"),
        (lambda x, y: logprobs_from_logits(x, y, temperature=0.0), r"temperature: got 0.0, expected a number > 0"),
        (lambda x, y: logprobs_from_logits(x, y, chunk_size=0), r"chunk_size: got 0, expected a positive int"),
        (lambda x, y: entropy_from_logits(x, chunk_size=2.5), r"chunk_size: got 2.5"),
        (lambda x, y: entropy_from_logits(x[:, :0]), r"logits: got shape \(3, 0\), expected \[\.\.\., V\]"),
        (lambda x, y: logprobs_from_logits(x, [0, 1, 2]), r"labels: got list, expected a torch.Tensor"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    x, y = torch.randn(3, 6), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=match):
        call(x, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_tokens_by_vocab_allocation_the_gradient(dtype):
    n, vocab, chunk = 48, 70, 16
    logits = torch.randn(n, vocab).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    with record_allocations() as shapes:
        lp, h = logprobs_from_logits(logits, labels, temperature=0.9, chunk_size=chunk, with_entropy=True)
        (lp.float().sum() + h.float().sum()).backward()
    assert shapes.count((n, vocab)) == 1
    assert max(math.prod(s) for s in shapes if s != (n, vocab)) <= chunk * vocab
