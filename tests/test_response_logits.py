"""The next-token logits at the response positions (full-vocabulary distillation) equal the per-row forward's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.models import from_hf, load_causal_lm, response_logits
from rlcore.testing.reference import response_logits_ref
from rlcore.train.stages import masked_logprobs, response_logprobs
from test_shared_prefix import VOCAB, _grouped, assert_same_gradients, grouped_batches
from tiny_runs import tiny_qwen2


def _model(dtype=torch.float32):
    return load_causal_lm(tiny_qwen2(VOCAB), dtype=dtype, seed=0).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@settings(max_examples=20, deadline=None)
@given(grouped_batches(), st.sampled_from([1.0, 0.7]), st.booleans())
def test_response_logits_match_the_per_row_loop_reference(model, drawn, temperature, share):
    batch, prompts, responses = drawn
    with torch.no_grad():
        logits = response_logits(*from_hf(model), batch, temperature=temperature, share_prompts=share)
    assert logits.shape == (*batch["responses"].shape, VOCAB) and logits.dtype == torch.float32
    for i, (p, r) in enumerate(zip(prompts, responses)):
        for t, want in enumerate(response_logits_ref(model, p, r, temperature=temperature)):
            torch.testing.assert_close(logits[i, t].double(), want, atol=1e-5, rtol=0)
    assert torch.all(logits[batch["mask"] == 0] == 0)  # off the response: nothing


@pytest.mark.parametrize("share", [True, False])
def test_their_log_probs_are_the_response_log_probs(model, share):
    batch = _grouped(seed=2)
    apply, params = from_hf(model)
    with torch.no_grad():
        logp, entropy = masked_logprobs(response_logits(apply, params, batch, temperature=0.8), batch)
        want, want_entropy = response_logprobs((apply, params), batch, temperature=0.8, with_entropy=True)
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_and_packed_forwards_give_the_same_gradients(dtype):
    model = _model(dtype)
    batch = _grouped()
    weights = torch.randn(*batch["mask"].shape, VOCAB, generator=torch.Generator().manual_seed(1))
    grads = []
    for share in (True, False):
        model.zero_grad()
        logits = response_logits(*from_hf(model), batch, share_prompts=share)
        assert logits.dtype == torch.float32
        (logits * weights).sum().backward()
        grads.append({k: p.grad.float().clone() for k, p in model.named_parameters()})
    assert_same_gradients(grads[0], grads[1], dtype)


def test_bfloat16_logits_follow_the_float32_ones():
    batch = _grouped(seed=4)
    with torch.no_grad():
        full = response_logits(*from_hf(_model()), batch)
        half = response_logits(*from_hf(_model(torch.bfloat16)), batch)
    keep = batch["mask"] != 0
    assert (half[keep] - full[keep]).abs().max() < 0.1 * full[keep].abs().max()


def test_a_bad_temperature_is_refused(model):
    with pytest.raises(ValueError, match="temperature: got 0"):
        response_logits(*from_hf(model), _grouped(), temperature=0)
