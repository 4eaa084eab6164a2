"""VLLMEngine on a CUDA device: sleep and wake-up free and restore the engine's memory; sampling and weights as on the CPU.

vLLM's sleep mode exists only on an accelerator, so these tests need one (CI has none:
they are skipped there, and run on a GPU machine with vLLM's CUDA build). One engine for
the module: vLLM's sleep mode keeps one allocator per process. The device's free bytes
(``torch.cuda.mem_get_info``) measure what vLLM holds: its weights and KV cache live in
its own pool, outside torch's allocator statistics.
"""

import pytest
import torch

from rlcore.dataflow import WeightSync
from rlcore.models import load_causal_lm
from rlcore.train import TorchEngine, VLLMEngine, VLLMOptions, left_pad

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (vLLM's sleep mode)")

EOS, PAD, VOCAB = 1, 0, 1000
KV_BYTES = 1 << 30  # large beside the weights, so its release is plain in the device's free bytes
PROMPTS = [[2, 3, 4, 5, 6], [7, 8], [9, 10, 11], [12, 13, 14, 15]]


MODEL = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def tiny_model(seed: int) -> torch.nn.Module:
    """A random Qwen2 of :data:`MODEL` on the GPU, float32."""
    return load_causal_lm({"model_type": "qwen2", **MODEL}, dtype=torch.float32, seed=seed, device="cuda")


@pytest.fixture(scope="module")
def policy():
    return tiny_model(0).eval()


@pytest.fixture(scope="module")
def engine(policy):
    e = VLLMEngine.from_module(
        policy,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_new_tokens=16,
        temperature=0.0,
        options=VLLMOptions(kv_cache_memory_bytes=KV_BYTES, max_num_seqs=64),
        sleep_mode=True,
    )
    yield e
    e.close()


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _greedy(engine):
    ids, mask = left_pad(PROMPTS, PAD)
    return engine.generate(ids, mask, n=2, generator=None).responses


def _assert_weights_equal(engine, params):
    back = engine.read_weights()
    assert set(back) == set(params)
    for name, p in params.items():
        assert torch.equal(back[name].to(p.device), p.detach()), name


def test_greedy_tokens_equal_torch_engine_for_16_tokens_in_float32(engine, policy):
    ids, mask = (t.cuda() for t in left_pad(PROMPTS, PAD))
    got = engine.generate(ids, mask, n=2, generator=None)
    want = TorchEngine(policy, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=16, temperature=0.0).generate(
        ids, mask, n=2, generator=None
    )
    same = (got.responses.cpu() == want.responses.cpu()).all(1)
    print(f"greedy rows equal to the torch engine's: {int(same.sum())} of {len(same)}")
    assert got.responses.shape == (8, 16)
    assert torch.equal(got.responses.cpu(), want.responses.cpu())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_engines_memory_and_wake_up_restores_it(engine, policy, level):
    before = _greedy(engine)
    awake = _free()
    engine.sleep(level)
    asleep = _free()
    engine.wake_up()
    woken = _free()
    if level == 2:  # the weights were dropped: they come back through the sync path
        WeightSync(dict(policy.named_parameters()), bucket_bytes=1 << 20).sync(1, engine.receiver())
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    print(
        f"level {level}: sleep freed {(asleep - awake) / 2**20:.1f} MiB "
        f"(KV cache {KV_BYTES / 2**20:.0f} MiB, weights {weights / 2**20:.1f} MiB); "
        f"wake-up took back {(asleep - woken) / 2**20:.1f} MiB"
    )
    assert asleep - awake >= KV_BYTES  # the KV cache at least (level 1 moves the weights to the host too)
    assert abs(woken - awake) <= 64 << 20  # all of it back, within a few of vLLM's small buffers
    _assert_weights_equal(engine, dict(policy.named_parameters()))
    assert torch.equal(_greedy(engine), before)


def test_weights_synced_after_a_wake_up_reach_the_engine_bit_for_bit(engine, policy):
    other = tiny_model(1)
    engine.sleep(1)
    engine.wake_up()
    WeightSync(dict(other.named_parameters()), bucket_bytes=1 << 20).sync(2, engine.receiver())
    _assert_weights_equal(engine, dict(other.named_parameters()))
    engine.load_weights(dict(policy.named_parameters()))
    _assert_weights_equal(engine, dict(policy.named_parameters()))
