"""The co-located vLLM deployment on a CUDA device: the phase switch runs the memory plan with vLLM's sleep mode.

Entering ``"train"`` the engine sleeps (its KV cache and weights leave the device);
entering ``"rollout"`` the trainer's parameters, gradients and optimiser state go to the
host and the engine wakes. Needs an accelerator (CI has none: skipped there). Run it in a
process of its own, apart from ``test_vllm_cuda.py`` (vLLM's sleep mode keeps one allocator
per process): ``pytest tests/test_vllm_cuda_deploy.py``.
"""

from types import SimpleNamespace

import pytest
import torch

from rlcore.train import VLLMDeployment, parse_config
from test_vllm_cuda import MODEL, VOCAB, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (vLLM's sleep mode)")

EOS, PAD = 1, 0
KV_BYTES = 1 << 30
CONFIG = {
    "model": {"model_name_or_path": {"model_type": "qwen2", **MODEL}},
    "rl": {"temperature": 1.0, "max_new_tokens": 8},
    "deploy": {"engine": "vllm", "vllm": {"kv_cache_memory_bytes": KV_BYTES, "max_num_seqs": 64, "sleep_level": 1}},
}


def _step(policy: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    ids = torch.randint(2, VOCAB, (4, 12), device="cuda")
    policy(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    opt.step()


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_the_switch_sleeps_the_engine_for_training_and_swaps_the_trainer_out_for_the_rollout():
    policy = tiny_model(0)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    _step(policy, opt)
    task = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD))
    d = VLLMDeployment(parse_config(CONFIG), policy, tiny_model(1).eval(), task, optimiser=opt)
    try:
        assert d.switch is not None and d.staging is not None
        state_bytes = sum(
            t.numel() * t.element_size()
            for p in policy.parameters()
            for t in [p, p.grad, *opt.state[p].values()]
            if t is not None and t.dim() > 0
        )
        free = {"start": _free()}
        d.switch("device", None, "train")
        free["train"] = _free()
        _step(policy, opt)
        d.publish(1)
        snapshot = {n: p.detach().clone() for n, p in policy.named_parameters()}
        moments = [v.clone() for s in opt.state.values() for v in s.values()]
        allocated = torch.cuda.memory_allocated()
        d.switch("device", "train", "rollout")
        offloaded = allocated - torch.cuda.memory_allocated()
        free["rollout"] = _free()
        d.pending.load(1)
        back = d.engine.read_weights()
        for name, p in snapshot.items():
            assert torch.equal(back[name].to(p.device), p), name
        d.switch("device", "rollout", "train")
        free["train again"] = _free()
        for name, p in policy.named_parameters():
            assert torch.equal(p.detach(), snapshot[name]), name
        assert all(torch.equal(a, b) for a, b in zip([v for s in opt.state.values() for v in s.values()], moments))
        print(
            "device free MiB: "
            + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in free.items())
            + f"; trainer state offloaded for the rollout {offloaded / 2**20:.1f} MiB of {state_bytes / 2**20:.1f} MiB"
        )
        assert free["train"] - free["start"] >= KV_BYTES  # asleep while training
        assert free["train"] - free["rollout"] >= KV_BYTES  # awake for the rollout
        # The trainer's state was on the host meanwhile (within the allocator's 512-byte rounding of a few blocks).
        assert offloaded >= state_bytes - 4096
        assert abs(free["train again"] - free["train"]) <= 64 << 20
    finally:
        d.close()
