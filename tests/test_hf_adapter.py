import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.dataflow import pack
from rlcore.models import from_hf, load_causal_lm, packed_causal_attention, token_logprobs
from rlcore.models.attention import _flex_document
from rlcore.testing.allocations import record_allocations
from rlcore.testing.reference import packed_attention_ref
from rlcore.testing.token_strategies import ragged_token_batches, token_lengths

VOCAB = 61
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
FAMILIES = ["qwen2", "llama"]


def _model(family="qwen2", dtype=torch.float32, **extra):
    # Eager attention: the padded reference path shares no attention code with the packed one.
    model = load_causal_lm({"model_type": family, **TINY, **extra}, dtype=dtype, seed=0)
    model.set_attn_implementation("eager")
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return _model(request.param)


def _positions(mask):
    return (mask.cumsum(1) - 1).clamp(min=0)


def _plain_logprobs(model, batch, temperature=1.0):
    """The plain path: padded HF forward, full logits, log_softmax + gather, aligned to the scored token."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(ids, attention_mask=mask, position_ids=_positions(mask)).logits.float() / temperature
    logsm = torch.log_softmax(logits, -1)
    lp = torch.zeros(ids.shape, dtype=logsm.dtype)
    lp[:, 1:] = logsm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = torch.zeros(ids.shape, dtype=logsm.dtype)
    ent[:, 1:] = -(logsm.exp() * logsm).sum(-1)[:, :-1]
    scored = (mask != 0) & (_positions(mask) > 0)
    return torch.where(scored, lp, 0.0), torch.where(scored, ent, 0.0)


@settings(max_examples=12)
@given(batch=ragged_token_batches(max_batch=4, max_len=10, vocab=VOCAB))
def test_packed_forward_equals_padded_forward(family_model, batch):
    apply, params = from_hf(family_model)
    packed = pack(batch)
    hidden = apply(params, packed.input_ids, position_ids=packed.position_ids, cu_seqlens=packed.cu_seqlens)
    mask = batch["attention_mask"]
    with torch.no_grad():
        padded = getattr(family_model, family_model.base_model_prefix)(
            batch["input_ids"], attention_mask=mask, position_ids=_positions(mask)
        ).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(hidden, padded[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("family", FAMILIES)
def test_token_logprobs_values_and_gradients_match_plain_path(family, dtype, tol):
    model = _model(family, dtype)
    apply, params = from_hf(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.int64)
    mask[1, 7:] = 0
    mask[2, :4] = 0
    mask[3, 1:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    weights = torch.randn(4, 12, generator=g)
    lp, ent = token_logprobs(
        apply, params, batch, temperature=0.8, chunk_size=5, vocab_chunk_size=16, with_entropy=True
    )
    assert lp.shape == ids.shape and lp.dtype == dtype
    (lp.float() * weights).sum().add(ent.float().sum()).backward()
    ours = {n: p.grad.clone() for n, p in params.items()}
    model.zero_grad()
    ref_lp, ref_ent = _plain_logprobs(model, batch, temperature=0.8)
    (ref_lp * weights).sum().add(ref_ent.sum()).backward()
    torch.testing.assert_close(lp.float(), ref_lp.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ent.float(), ref_ent.detach(), rtol=tol, atol=tol)
    for name, p in params.items():
        scale = max(1.0, float(p.grad.abs().max()))
        torch.testing.assert_close(ours[name].float(), p.grad.float(), rtol=tol, atol=tol * scale, msg=name)


def test_tied_embeddings_get_both_gradients():
    model = _model("qwen2", tie_word_embeddings=True)
    apply, params = from_hf(model)
    assert apply.output_weight_name == "model.embed_tokens.weight" and "lm_head.weight" not in params
    batch = [torch.tensor([3, 9, 27, 4]), torch.tensor([8, 1])]
    token_logprobs(apply, params, batch).sum().backward()
    ours = params["model.embed_tokens.weight"].grad.clone()
    model.zero_grad()
    ids = torch.tensor([[3, 9, 27, 4], [8, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    _plain_logprobs(model, {"input_ids": ids, "attention_mask": mask})[0].sum().backward()
    torch.testing.assert_close(ours, model.model.embed_tokens.weight.grad, rtol=1e-5, atol=1e-5)


def test_model_left_unchanged_and_params_override():
    model = _model("llama")
    before = model.config._attn_implementation
    apply, params = from_hf(model)
    batch = [torch.tensor([5, 6, 7])]
    lp = token_logprobs(apply, params, batch)
    assert model.config._attn_implementation == before
    # Parameters passed in are the ones used: a doubled output embedding doubles the logits.
    doubled = dict(params)
    doubled["lm_head.weight"] = params["lm_head.weight"] * 2
    lp2 = token_logprobs(apply, doubled, batch, temperature=2.0)
    torch.testing.assert_close(lp, lp2, rtol=1e-5, atol=1e-6)


def test_no_tokens_by_tokens_tensor_on_a_long_pack():
    model = _model("qwen2")
    apply, params = from_hf(model)
    seqs = [torch.randint(0, VOCAB, (length,)) for length in (50, 30, 50, 40, 50, 30)]
    packed = pack(seqs)
    n = packed.input_ids.shape[0]
    with torch.no_grad(), record_allocations() as shapes:
        apply(params, packed.input_ids, position_ids=packed.position_ids, cu_seqlens=packed.cu_seqlens)
    assert not [s for s in shapes if sum(d >= n for d in s) >= 2]
    # Attention ran once per distinct length, over the sequences of that length: [G, heads, L, head_dim] outputs.
    for group in ((3, 4, 50, 8), (2, 4, 30, 8), (1, 4, 40, 8)):
        assert shapes.count(group) == TINY["num_hidden_layers"], group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(
    lengths=token_lengths(max_len=7, max_batch=4),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    seed=st.integers(0, 2**16),
)
def test_packed_causal_attention_matches_loop_reference(dtype, lengths, heads, seed):
    hq, hkv = heads
    n, d = sum(lengths), 4
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = packed_causal_attention(q, k, v, cu, scale=0.7)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), packed_attention_ref(q, k, v, cu, 0.7), rtol=tol, atol=tol)


def test_packed_causal_attention_gradcheck():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, h, 3, generator=g, dtype=torch.float64, requires_grad=True) for h in (2, 1, 1))
    # An empty sequence and two of length 2, which share one attention call.
    cu = torch.tensor([0, 2, 2, 6, 8], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, b, c: packed_causal_attention(a, b, c, cu), (q, k, v))


def test_flex_document_mask_matches_per_segment():
    # The FlexAttention document mask of the CUDA float32 branch, run forward on the CPU
    # through FlexAttention's eager implementation: what is tested is the mask. (Inductor's
    # CPU FlexAttention kernel of torch 2.13 returns wrong rows on CPUs without AVX-512.)
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, h, 8, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 10, 10, 25, 40], dtype=torch.int32)
    torch.testing.assert_close(
        _flex_document(q, k, v, cu, 0.3, flex=flex_attention),
        packed_causal_attention(q, k, v, cu, scale=0.3),
        rtol=1e-5,
        atol=1e-5,
    )


def test_load_causal_lm_from_config_and_local_path(tmp_path):
    a = load_causal_lm({"model_type": "qwen2", **TINY}, seed=3)
    b = load_causal_lm({"model_type": "qwen2", **TINY}, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    a.save_pretrained(tmp_path)
    c = load_causal_lm(tmp_path)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
    assert isinstance(load_causal_lm(a.config), type(a))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: load_causal_lm("Qwen/Qwen2-0.5B"), r"source: got 'Qwen/Qwen2-0.5B', expected a local model directory"),
        (
            lambda: load_causal_lm({"hidden_size": 8}),
            r"source: got config keys \['hidden_size'\], expected a 'model_type'",
        ),
        (lambda: load_causal_lm(3), r"source: got int, expected a PretrainedConfig"),
        (lambda: from_hf(torch.nn.Linear(2, 2)), r"model: got Linear, expected a transformers causal LM"),
        (
            lambda: token_logprobs(lambda *a, **k: None, {}, [torch.tensor([1, 2])]),
            r"apply: got function without an output_weight",
        ),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        ([0, 2, 4], r"cu_seqlens: got \[0, 2, 4\], expected non-decreasing boundaries from 0 to 5"),
        ([0, 3, 2, 5], r"cu_seqlens: got \[0, 3, 2, 5\], expected non-decreasing"),
        ([1, 5], r"cu_seqlens: got \[1, 5\]"),
    ],
)
def test_cu_seqlens_not_ending_at_n_raises(family_model, cu, match):
    apply, params = from_hf(family_model)
    ids = torch.tensor([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=match):
        apply(params, ids, position_ids=torch.arange(5), cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    with pytest.raises(ValueError, match=match):
        q = torch.randn(5, 2, 4)
        packed_causal_attention(q, q, q, torch.tensor(cu, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens: got dtype torch.float32, expected an integer"):
        apply(params, ids, position_ids=torch.arange(5), cu_seqlens=torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match=r"position_ids: got shape \(4\), expected \(5\)"):
        apply(params, ids, position_ids=torch.arange(4), cu_seqlens=torch.tensor([0, 5]))
