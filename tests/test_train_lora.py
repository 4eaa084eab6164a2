"""LoRA in the trainer: only the adapters train and are checkpointed, the reference is the base model, resume is exact."""

from dataclasses import replace

import pytest
import torch

from rlcore.models import base_view, from_hf, is_lora, load_policy
from rlcore.testing.hf_fixtures import build_tiny_qwen2, write_prompt_files
from rlcore.train import adapter_modules, check_lora_launch, load_checkpoint, logprob_stage, parse_config, train
from rlcore.train.cli import main

TARGETS = ["q_proj", "v_proj"]
R = 4


def _config(user, out, **trainer):
    return parse_config(
        {
            "model": {
                "model_name_or_path": str(user["model"]),
                "lora": {"r": R, "alpha": 8, "target_modules": TARGETS},
            },
            "rl": {
                "algo": "grpo",
                "batch_size": 2,
                "mini_batch_size": 2,
                "num_rollouts": 2,
                "max_new_tokens": 3,
                "beta": 0.05,
                "lr": 0.01,
            },
            "data": {"path": str(user["train"])},
            "trainer": {
                "output_dir": str(out),
                "steps": 2,
                "warmup_steps": 1,
                "warmup_batch_size": 4,
                "reward_workers": 0,
                "threads": 1,
                "progress": False,
                "plot": False,
                **trainer,
            },
        }
    )


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = build_tiny_qwen2(root / "model", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    train_file, _ = write_prompt_files(root / "data", num_train=16, num_val=2)
    return {"root": root, "model": model, "train": train_file}


@pytest.fixture(scope="module")
def run(user):
    out = user["root"] / "run"
    return out, train(_config(user, out))


def _adapters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def test_only_the_adapters_train_and_the_checkpoint_holds_them_alone(user, run):
    out, result = run
    policy = result.policy
    assert is_lora(policy)
    original, _ = load_policy(user["model"])
    expected = sum(
        R * (m.in_features + m.out_features)
        for name, m in original.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    )
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(p.numel() for p in trainable.values()) == expected
    # the adapters moved (warm-up and RL); the base weights did not
    assert any(p.abs().sum() > 0 for n, p in trainable.items() if ".lora_B." in n)
    with torch.no_grad():
        base = base_view(policy).state_dict()
    for name, value in original.state_dict().items():
        assert torch.equal(base[name], value), name

    state = load_checkpoint(out)
    assert "reference" not in state
    saved = state["policy"]["model"]
    assert saved and all("/lora_A" in k or "/lora_B" in k for k in saved)
    assert sum(t.numel() for t in saved.values()) == expected
    full = sum(t.numel() for t in original.state_dict().values())
    assert sum(t.numel() for t in saved.values()) < 0.05 * full
    # the optimiser holds the adapters alone: one AdamW state per adapter tensor
    assert len(state["policy"]["optim"]["state"]) == len(trainable)


def test_the_reference_is_the_base_model_without_a_copy(user, run):
    _, result = run
    policy = result.policy
    reference = base_view(policy)
    base_tensors = {p.data_ptr() for n, p in policy.named_parameters() if not p.requires_grad}
    assert all(p.data_ptr() in base_tensors for p in reference.parameters())  # shared, not copied
    original, _ = load_policy(user["model"])
    g = torch.Generator().manual_seed(0)
    batch = {
        "prompts": torch.randint(0, 300, (3, 5), generator=g),
        "prompt_mask": torch.ones(3, 5),
        "responses": torch.randint(0, 300, (3, 4), generator=g),
        "mask": torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]),
    }
    ref = logprob_stage(reference, outputs=("ref_logp",)).fn(batch)["ref_logp"]
    base = logprob_stage(original, outputs=("ref_logp",)).fn(batch)["ref_logp"]
    torch.testing.assert_close(ref, base, atol=1e-6, rtol=0)
    trained = logprob_stage(policy, outputs=("logp",)).fn(batch)["logp"]
    assert (trained - ref).abs().max() > 1e-4  # the adapters change the policy, not the reference
    # the policy's packed forward is the peft model's own forward with its adapters on
    apply, params = from_hf(policy)
    ids = batch["prompts"][0]
    hidden = apply(params, ids, position_ids=torch.arange(5), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with torch.no_grad():
        logits = policy(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(hidden @ apply.output_weight(params).T, logits, atol=1e-5, rtol=0)


def test_resume_continues_the_adapters_exactly(user, run, tmp_path):
    straight = train(_config(user, tmp_path / "straight", steps=3)).policy
    out = tmp_path / "resumed"
    train(_config(user, out, steps=2))
    resumed = train(_config(user, out, steps=3), resume=True)
    assert [r["step"] for r in resumed.records] == [2]
    a, b = _adapters(straight), _adapters(resumed.policy)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


def test_export_writes_merged_weights(user, run, tmp_path):
    from transformers import AutoModelForCausalLM

    out, result = run
    exported = tmp_path / "exported"
    assert main(["export", str(out), str(exported)]) == 0
    for directory in (out / "hf", exported):
        loaded = AutoModelForCausalLM.from_pretrained(directory)
        assert not any("lora" in n for n, _ in loaded.named_parameters())
        ids = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            torch.testing.assert_close(
                loaded(input_ids=ids).logits, result.policy(input_ids=ids).logits, atol=1e-5, rtol=0
            )


def test_lora_config_errors_name_the_key(user, tmp_path):
    cfg = _config(user, tmp_path / "x")
    with pytest.raises(ValueError, match=r"model\.lora: got the keys \['rank'\]"):
        check_lora_launch(replace(cfg, model=replace(cfg.model, lora={"rank": 4})), 1)
    with pytest.raises(ValueError, match=r"model\.lora\.dropout: got 0\.1, expected 0"):
        check_lora_launch(replace(cfg, model=replace(cfg.model, lora={"r": 4, "dropout": 0.1})), 1)
    check_lora_launch(replace(cfg, parallel=replace(cfg.parallel, data_parallel=2)), 2)  # FSDP2 over dp: served
    for key in ("tensor_parallel", "context_parallel"):
        bad = replace(cfg, parallel=replace(cfg.parallel, **{key: 2}))
        with pytest.raises(ValueError, match=rf"^model\.lora: got LoRA with parallel\.{key}=2 \(world size 2\)"):
            check_lora_launch(bad, 2)
    with pytest.raises(ValueError, match="expected a peft.PeftModel"):
        adapter_modules(torch.nn.Linear(2, 2))
