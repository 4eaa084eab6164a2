"""rlcore.models.static_cache: the preallocated-cache decode step against the model's own cached forward."""

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.models import CachedDecoder
from rlcore.models.static_cache import StaticDecodeStep, supports_static_decode
from rlcore.train import generate, left_pad
from tiny_runs import tiny_family_lm

VOCAB = 20


def _model(kind: str, dtype=torch.float32, seed=0, **extra):
    return tiny_family_lm(kind, vocab=VOCAB, dtype=dtype, seed=seed, **extra)


KINDS = {
    "qwen2": {},
    "llama": {"attention_bias": True},
    "qwen3": {"head_dim": 8},
    "mistral": {"sliding_window": None},
}
MODELS = {kind: _model(kind, **extra) for kind, extra in KINDS.items()}


def _decode_logits(model, prompts, steps, drop_at, static, seed):
    """Each step's logits of the active rows, feeding seeded random tokens and dropping rows once."""
    ids, attention = left_pad(prompts, 0)
    gen = torch.Generator().manual_seed(seed)
    decoder = CachedDecoder(model, ids, attention, static=static)
    out = [decoder.logits]
    for step in range(steps):
        token = torch.randint(1, VOCAB, (len(prompts),), generator=gen)
        if step == drop_at:
            done = torch.zeros(len(prompts), dtype=torch.bool)
            done[::2] = True
            decoder.drop(done)
        decoder.feed(token)
        out.append(decoder.logits)
    return out


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(sorted(KINDS)),
    prompts=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=7), min_size=2, max_size=6),
    steps=st.integers(1, 24),  # past the buffers' first 16 spare columns: they grow
    drop_at=st.integers(-1, 10),
    seed=st.integers(0, 2**16),
)
def test_static_steps_equal_the_models_own_forward(kind, prompts, steps, drop_at, seed):
    model = MODELS[kind]
    with torch.no_grad():
        ours = _decode_logits(model, prompts, steps, drop_at, None, seed)
        theirs = _decode_logits(model, prompts, steps, drop_at, False, seed)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bfloat16_steps_match():
    model = _model("qwen2", torch.bfloat16)
    prompts = [[3, 4, 5], [6], [7, 8, 9, 10, 11]]
    with torch.no_grad():
        ours = _decode_logits(model, prompts, 6, 2, None, 0)
        theirs = _decode_logits(model, prompts, 6, 2, False, 0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_generate_draws_the_same_tokens(kind, monkeypatch):
    model = MODELS[kind]
    ids, mask = left_pad([[2, 3, 4], [5, 6], [7]], 0)

    def run():
        return generate(
            model,
            ids,
            mask,
            eos_token_id=1,
            max_new_tokens=12,
            n=4,
            temperature=1.3,
            generator=torch.Generator().manual_seed(5),
        )

    ours = run()
    monkeypatch.setattr("rlcore.models.decoding.supports_static_decode", lambda model: False)
    theirs = run()
    assert torch.equal(ours.responses, theirs.responses)
    torch.testing.assert_close(ours.logp, theirs.logp, atol=1e-5, rtol=1e-5)


def test_weights_changed_in_place_are_used():
    model = _model("qwen2", seed=1)
    ids, attention = left_pad([[2, 3], [4, 5, 6]], 0)
    with torch.no_grad():
        ours = CachedDecoder(model, ids, attention)
        theirs = CachedDecoder(model, ids, attention, static=False)
        model.model.layers[1].mlp.down_proj.weight.mul_(-2.0)  # a weight load between steps
        token = torch.tensor([7, 8])
        ours.feed(token)
        theirs.feed(token)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=1e-5)


def test_which_models_are_supported():
    assert all(supports_static_decode(m) for m in MODELS.values())
    sliding = _model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert not supports_static_decode(sliding)
    assert not supports_static_decode(_model("mistral", sliding_window=8))
    hooked = _model("qwen2")
    hooked.model.layers[0].register_forward_pre_hook(lambda *a: None)
    assert not supports_static_decode(hooked)
    assert not supports_static_decode(torch.nn.Linear(2, 2))
    gpt2 = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)
    )
    assert not supports_static_decode(gpt2)
    ids, attention = left_pad([[2, 3]], 0)
    with torch.no_grad():
        decoder = CachedDecoder(gpt2, ids, attention)  # the model's own forward
        decoder.feed(torch.tensor([4]))
    assert decoder.logits.shape == (1, VOCAB)


def test_forcing_the_static_step_on_an_unsupported_model_is_refused():
    ids, attention = left_pad([[2, 3]], 0)
    sliding = _model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(ValueError, match="static: got True"):
        CachedDecoder(sliding, ids, attention, static=True)


def test_an_unknown_cache_is_refused():
    model = MODELS["qwen2"]
    with pytest.raises(ValueError, match="cache: got object"):
        StaticDecodeStep(model, object(), torch.ones(1, 2))


def test_lora_adapters_are_applied():
    from rlcore.models import apply_lora

    model = apply_lora(_model("qwen2", seed=2), r=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the output
    model.eval()
    assert supports_static_decode(model)
    prompts = [[3, 4, 5], [6, 7]]
    with torch.no_grad():
        ours = _decode_logits(model, prompts, 4, -1, None, 0)
        theirs = _decode_logits(model, prompts, 4, -1, False, 0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours[-1], _decode_logits(_model("qwen2", seed=2), prompts, 4, -1, None, 0)[-1])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_shared_prompt_prefill_equals_the_models_own_forward(kind):
    """GRPO groups (rows repeating a left-padded prompt) share one static prefill; every row's logits and
    later steps equal the model's own forward, and no cached key or value is left non-finite (padding included)."""
    model = MODELS[kind]
    prompts = [[3, 4, 5, 6], [7], [8, 9]]
    ids, attention = left_pad(prompts, 0)
    ids, attention = ids.repeat_interleave(3, 0), attention.repeat_interleave(3, 0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        ours = CachedDecoder(model, ids, attention)
        theirs = CachedDecoder(model, ids, attention, static=False)
        assert ours._step is not None and theirs._step is None
        filled = ours._step.length
        assert all(torch.isfinite(t[:, :, :filled]).all() for t in ours._step.keys + ours._step.values)
        for _ in range(3):
            torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=1e-5)
            token = torch.randint(1, VOCAB, (ids.shape[0],), generator=gen)
            ours.feed(token)
            theirs.feed(token)
        torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_rope_table_is_the_models_own_rotary_embedding_bit_for_bit(kind):
    from rlcore.models.static_cache import _rope_table

    inner = MODELS[kind].model
    cos, sin = _rope_table(inner, 40)
    positions = torch.tensor([[0], [7], [39], [3]])
    want_cos, want_sin = inner.rotary_emb(inner.embed_tokens.weight[:4], positions)
    assert torch.equal(cos[positions], want_cos) and torch.equal(sin[positions], want_sin)


def test_a_rotary_embedding_that_follows_the_length_keeps_its_own_call():
    from rlcore.models.static_cache import _rope_table

    model = _model("qwen2", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert _rope_table(model.model, 16) is None
