"""rlcore.models.packed_decoder: the Llama-family backbone run from its weights, against the model's own forward."""

import dataclasses

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.dataflow import pack
from rlcore.models import from_hf
from rlcore.models.llama_family import is_llama_family
from rlcore.testing.token_strategies import ragged_token_batches
from rlcore.train.stages import response_logprobs
from tiny_runs import tiny_family_lm

VOCAB = 29
KINDS = {
    "qwen2": {},
    "llama": {"attention_bias": True, "mlp_bias": True},
    "qwen3": {"head_dim": 12},
    "mistral": {"sliding_window": None},
}


def _model(kind, dtype=torch.float32, **extra):
    # pad_token_id: the embedding's padding row takes no gradient, which the native path keeps
    model = tiny_family_lm(kind, vocab=VOCAB, dtype=dtype, pad_token_id=0, **{**KINDS.get(kind, {}), **extra})
    model.set_attn_implementation("eager")  # the reference path shares no attention code with the packed one
    return model.eval()


MODELS = {kind: _model(kind) for kind in KINDS}


def _positions(mask):
    return (mask.cumsum(1) - 1).clamp(min=0)


@settings(max_examples=16, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), batch=ragged_token_batches(max_batch=4, max_len=9, vocab=VOCAB))
def test_native_forward_equals_the_models_own_padded_forward(kind, batch):
    model = MODELS[kind]
    apply, params = from_hf(model)
    assert apply.native
    packed = pack(batch)
    hidden = apply(params, packed.input_ids, position_ids=packed.position_ids, cu_seqlens=packed.cu_seqlens)
    mask = batch["attention_mask"]
    with torch.no_grad():
        padded = model.model(batch["input_ids"], attention_mask=mask, position_ids=_positions(mask)).last_hidden_state
    torch.testing.assert_close(hidden, padded[mask.bool()], rtol=1e-5, atol=1e-5)


def _grpo_batch(seed, groups=3, samples=4, width_p=5, width_r=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width_p + 1, (groups,), generator=g)
    prompt_mask = (torch.arange(width_p) >= width_p - lengths[:, None]).long()
    prompts = torch.randint(1, VOCAB, (groups, width_p), generator=g) * prompt_mask
    rows = groups * samples
    mask = (torch.arange(width_r) < torch.randint(1, width_r + 1, (rows, 1), generator=g)).long()
    responses = torch.randint(0, VOCAB, (rows, width_r), generator=g) * mask  # token 0 (padding id) included
    return {
        "prompts": prompts.repeat_interleave(samples, 0),
        "prompt_mask": prompt_mask.repeat_interleave(samples, 0),
        "responses": responses,
        "mask": mask,
    }


def _values_and_grads(apply, params, batch, share_prompts):
    weights = torch.randn(batch["mask"].shape, generator=torch.Generator().manual_seed(1))
    for p in params.values():
        p.grad = None
    logp, entropy = response_logprobs(
        (apply, params), batch, temperature=0.7, with_entropy=True, share_prompts=share_prompts
    )
    (logp * weights).sum().add(entropy.sum()).backward()
    return logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in params.items()}


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_native_and_twin_forwards_agree_in_value_and_gradient(kind, share_prompts, dtype, tol):
    model = _model(kind, dtype)
    model.train()  # as the update runs it: the twin runs without dropout, and so does the native path
    apply, params = from_hf(model)
    twin = dataclasses.replace(apply, native=False)
    batch = _grpo_batch(seed=3)
    ours = _values_and_grads(apply, params, batch, share_prompts)
    theirs = _values_and_grads(twin, params, batch, share_prompts)
    torch.testing.assert_close(ours[0], theirs[0], rtol=tol, atol=tol)
    torch.testing.assert_close(ours[1], theirs[1], rtol=tol, atol=tol)
    assert set(ours[2]) == set(theirs[2]) == set(params)
    for name in params:
        scale = max(1.0, float(theirs[2][name].abs().max()))
        torch.testing.assert_close(ours[2][name], theirs[2][name], rtol=tol, atol=tol * scale, msg=name)
    assert not ours[2]["model.embed_tokens.weight"][0].any()  # the padding row's gradient stays 0


def test_params_override_the_models_weights():
    model = MODELS["llama"]
    apply, params = from_hf(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    changed = dict(params)
    changed["model.layers.1.self_attn.q_proj.weight"] = params["model.layers.1.self_attn.q_proj.weight"] * 3
    changed["model.layers.0.mlp.up_proj.bias"] = torch.ones_like(params["model.layers.0.mlp.up_proj.bias"])
    ids = torch.tensor([3, 9, 27, 4, 8, 1])
    pos = torch.tensor([0, 1, 2, 3, 0, 1])
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    with torch.no_grad():
        plain = apply(params, ids, position_ids=pos, cu_seqlens=cu)
        ours = apply(changed, ids, position_ids=pos, cu_seqlens=cu)
        twin = dataclasses.replace(apply, native=False)(changed, ids, position_ids=pos, cu_seqlens=cu)
    assert not torch.allclose(ours, plain)
    torch.testing.assert_close(ours, twin, rtol=1e-6, atol=1e-6)
    # Weights left out of params are the model's own; the model is not modified.
    partial = {k: v for k, v in changed.items() if "layers.1" in k}
    with torch.no_grad():
        mixed = apply(partial, ids, position_ids=pos, cu_seqlens=cu)
    torch.testing.assert_close(
        mixed, dataclasses.replace(apply, native=False)(partial, ids, position_ids=pos, cu_seqlens=cu)
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_which_models_run_natively():
    assert all(from_hf(m)[0].native and is_llama_family(m) for m in MODELS.values())
    sliding = _model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert not is_llama_family(sliding) and not from_hf(sliding)[0].native
    assert not is_llama_family(_model("mistral", sliding_window=8))
    gpt2 = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)
    )
    assert not is_llama_family(gpt2)
    # A hooked module does not matter to either path: both compute from the weights, not through the modules' calls.
    hooked = _model("qwen2")
    hooked.model.layers[0].register_forward_pre_hook(lambda *a: None)
    assert from_hf(hooked)[0].native
