"""LoRA through peft (adapters only trainable, reference = adapters off, merged weights, adapter checkpoints) and HF export."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist

from rlcore.models import (
    AdaptersOff,
    adapter_state_dict,
    adapters_disabled,
    apply_lora,
    base_view,
    export_hf,
    from_hf,
    load_adapter_state_dict,
    load_policy,
    merged_state_dict,
)
from rlcore.testing.hf_fixtures import build_tiny_qwen2
from tiny_runs import TINY_MODEL

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("qwen2"), seed=3)


def _lora(model_dir, *, r=4, seed=0):
    base, tokenizer = load_policy(model_dir)
    original = copy.deepcopy(base)
    model = apply_lora(base, r=r, alpha=8, target_modules=TARGETS)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # as after some training: B starts at 0
                p.normal_(0, 0.5)
    return model, original, tokenizer


def _logp(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.double(), dim=-1)


def test_only_adapters_train_and_their_count_is_r_times_in_plus_out(model_dir):
    model, original, _ = _lora(model_dir)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    expected = sum(
        4 * (m.in_features + m.out_features)
        for name, m in original.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    )
    assert sum(p.numel() for p in trainable.values()) == expected


def test_reference_logprobs_are_the_base_models(model_dir):
    model, original, _ = _lora(model_dir)
    ids = torch.randint(0, original.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with adapters_disabled(model):
        ref = _logp(model, ids)
    torch.testing.assert_close(ref, _logp(original, ids), atol=1e-6, rtol=0)
    assert (_logp(model, ids) - ref).abs().max() > 1e-3  # the adapters are on again outside the block


def test_merged_weights_reproduce_the_adapted_model_and_carry_gradients(model_dir):
    model, original, _ = _lora(model_dir)
    ids = torch.randint(0, original.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        merged = merged_state_dict(model)
    assert set(merged) == set(original.state_dict())
    rollout = copy.deepcopy(original)
    rollout.load_state_dict(merged)
    torch.testing.assert_close(_logp(rollout, ids), _logp(model, ids), atol=1e-5, rtol=0)
    with adapters_disabled(model), torch.no_grad():
        for name, value in merged_state_dict(model).items():
            assert torch.equal(value, original.state_dict()[name]), name

    # the packed functional forward on merged weights trains the adapters
    apply, _ = from_hf(original)
    params = merged_state_dict(model)
    n = ids.shape[1]
    hidden = apply(params, ids[0], position_ids=torch.arange(n), cu_seqlens=torch.tensor([0, n], dtype=torch.int32))
    logits = hidden @ apply.output_weight(params).T
    torch.testing.assert_close(torch.log_softmax(logits.double(), -1), _logp(model, ids)[0], atol=1e-5, rtol=0)
    logits.square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_from_hf_of_a_lora_model_forwards_on_the_current_merged_weights(model_dir):
    model, original, _ = _lora(model_dir)
    apply, params = from_hf(model)
    ids = torch.randint(0, original.config.vocab_size, (9,), generator=torch.Generator().manual_seed(4))
    packing = {"position_ids": torch.arange(9), "cu_seqlens": torch.tensor([0, 9], dtype=torch.int32)}

    def logp():
        return torch.log_softmax((apply(params, ids, **packing) @ apply.output_weight(params).T).double(), -1)

    torch.testing.assert_close(logp(), _logp(model, ids[None])[0], atol=1e-5, rtol=0)
    with torch.no_grad():  # an optimiser step on the adapters: the same params see it
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.mul_(2.0)
    torch.testing.assert_close(logp(), _logp(model, ids[None])[0], atol=1e-5, rtol=0)
    logp().exp().square().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    with adapters_disabled(model):
        torch.testing.assert_close(logp(), _logp(original, ids[None])[0], atol=1e-6, rtol=0)
    view = base_view(model)  # the base model's own tensors, frozen, no adapter modules
    assert not any(p.requires_grad for p in view.parameters())
    assert "lora" not in " ".join(n for n, _ in view.named_parameters())
    torch.testing.assert_close(_logp(view, ids[None]), _logp(original, ids[None]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merging_given_tensors_is_merging_the_modules_own_bit_for_bit(model_dir, dtype):
    from rlcore.train import full_state_dict

    model, _, _ = _lora(model_dir)
    model.to(dtype)
    with torch.no_grad():
        own = merged_state_dict(model)
        given = {k: v.detach().clone() for k, v in model.get_base_model().state_dict().items()}
        merged = merged_state_dict(model, state=given)
    assert merged.keys() == own.keys()
    for name, value in own.items():
        assert value.dtype == dtype and torch.equal(merged[name], value), name
    # the gathered-state path (what a sharded model gives) merges the same way
    gathered = full_state_dict(model)
    assert all(torch.equal(gathered[name], value) for name, value in own.items())
    # only the given entries come back (a rank without the gathered state gets nothing)
    assert merged_state_dict(model, state={}) == {}
    one = "model.layers.0.self_attn.q_proj.base_layer.weight"
    assert one in given
    with pytest.raises(ValueError, match=r"state: holds .*q_proj\.base_layer\.weight.* lora_A / lora_B"):
        merged_state_dict(model, state={one: given[one]})


def test_adapters_off_is_the_base_model_on_the_same_tensors(model_dir):
    from rlcore.train import device_mesh, parallelize

    model, original, _ = _lora(model_dir)
    reference = AdaptersOff(model)
    assert {id(p) for p in reference.parameters()} == {id(p) for p in model.parameters()}  # no copy
    ids = torch.randint(0, original.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(_logp(reference, ids), _logp(original, ids), atol=1e-6, rtol=0)
    assert (_logp(model, ids) - _logp(original, ids)).abs().max() > 1e-3  # adapters on again after the call
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)
    reference.eval()
    assert not model.training
    reference.train()
    assert model.training
    apply, params = from_hf(reference)
    n = ids.shape[1]
    hidden = apply(params, ids[0], position_ids=torch.arange(n), cu_seqlens=torch.tensor([0, n], dtype=torch.int32))
    logp = torch.log_softmax((hidden @ apply.output_weight(params).T).double(), -1)
    torch.testing.assert_close(logp, _logp(original, ids[:1])[0], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="expected a peft.PeftModel"):
        AdaptersOff(original)
    # A one-process mesh leaves a LoRA model as it is (the decoder check sees through peft's layers).
    owned = not dist.is_initialized()
    try:
        assert parallelize(model, device_mesh(1, 1, device="cpu")) is model
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())


def test_adapter_checkpoint_is_small_and_round_trips(model_dir):
    model, original, _ = _lora(model_dir)
    state = adapter_state_dict(model)
    adapter_bytes = sum(t.numel() * t.element_size() for t in state.values())
    full_bytes = sum(t.numel() * t.element_size() for t in original.state_dict().values())
    assert adapter_bytes < 0.1 * full_bytes, (adapter_bytes, full_bytes)
    fresh, _, _ = _lora(model_dir, seed=9)
    load_adapter_state_dict(fresh, state)
    ids = torch.randint(0, original.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logp(fresh, ids), _logp(model, ids), atol=1e-6, rtol=0)


def test_apply_lora_rejects_bad_settings(model_dir):
    base, _ = load_policy(model_dir)
    with pytest.raises(ValueError, match=r"model\.lora\.r: got 0"):
        apply_lora(base, r=0)
    with pytest.raises(ValueError, match=r"model\.lora\.dropout: got 1\.5"):
        apply_lora(base, dropout=1.5)
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules: got \['nope_proj'\]"):
        apply_lora(base, target_modules=["nope_proj"])
    with pytest.raises(ValueError, match="expected a peft.PeftModel"):
        merged_state_dict(base)


@pytest.mark.parametrize("lora", [False, True])
def test_export_loads_with_transformers_and_generates(tmp_path, model_dir, lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if lora:
        model, _, tokenizer = _lora(model_dir)
    else:
        model, tokenizer = load_policy(model_dir)
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)  # as after training
    out = export_hf(model, tmp_path / "export", tokenizer=tokenizer)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.chat_template == tokenizer.chat_template
    assert "lora" not in " ".join(n for n, _ in loaded.named_parameters())
    ids = torch.tensor(
        [
            tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True)[
                "input_ids"
            ]
        ]
    )
    torch.testing.assert_close(_logp(loaded, ids), _logp(model, ids), atol=1e-5, rtol=0)
    generated = loaded.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert generated.shape[1] > ids.shape[1]
    half = export_hf(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert next(AutoModelForCausalLM.from_pretrained(half, dtype="auto").parameters()).dtype == torch.bfloat16
    assert math.isfinite(float(_logp(loaded, ids).sum()))


# --- issue 30: a built-in task's run writes its character tokenizer -------------------------


def test_reprobe30_a_built_in_task_run_writes_a_loadable_tokenizer_and_special_ids(tmp_path):
    # hf/ of a built-in-task run had no tokenizer and `eos_token_id: null`.
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore.train import generate, left_pad, load_config, make_task, train

    root = Path(__file__).resolve().parents[1]
    overrides = [
        *TINY_MODEL,
        "rl.batch_size=2",
        "rl.mini_batch_size=2",
        "rl.num_rollouts=2",
        "trainer.warmup_steps=40",  # enough for greedy outputs of several letters
        "trainer.warmup_batch_size=16",
        "trainer.threads=1",
        "trainer.reward_workers=0",
        "trainer.progress=false",
        "trainer.plot=false",
        "trainer.steps=1",
        f"trainer.output_dir={tmp_path}",
    ]
    cfg = load_config(root / "configs" / "grpo_tiny.yaml", overrides)
    run = train(cfg)
    hf = tmp_path / "hf"
    assert (hf / "tokenizer.json").is_file() and (hf / "tokenizer_config.json").is_file()
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((hf / name).read_text())
        assert (saved["eos_token_id"], saved["pad_token_id"], saved.get("bos_token_id")) == (1, 0, None), name
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    task = make_task("reversal", length=4, min_length=2, letters="abcdef")
    prompts = [s["prompt"] for s in task.sample(16, torch.Generator().manual_seed(1))]
    ids = [task.tokenizer.encode(p) for p in prompts]
    assert [tok(p)["input_ids"] for p in prompts] == ids  # the run's encoding
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (1, 0, task.tokenizer.vocab_size)
    # The model's greedy output, through transformers' generate, is the run's own.
    policy = run.policy.eval()
    padded, mask = left_pad(ids, 0)
    ours = generate(policy, padded, mask, eos_token_id=1, max_new_tokens=5, temperature=0.0)
    texts = []
    with torch.no_grad():
        for row, p in enumerate(ids):
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=5)[0, len(p) :].tolist()
            want = ours.responses[row][ours.mask[row].bool()].tolist()
            assert out == want, (prompts[row], out, want)
            texts.append(tok.decode(out, skip_special_tokens=True))
            assert texts[-1] == task.tokenizer.decode(want)
    # The outputs compared are letters, some several, not a bare <eos> each.
    assert sum(map(bool, texts)) >= 8 and max(map(len, texts)) >= 3, repr(texts)


def test_reprobe30_special_words_of_the_agent_tokenizer_keep_their_ids(tmp_path):
    from transformers import AutoTokenizer

    from rlcore.agent import Multiplication

    tok = Multiplication().tokenizer
    model = build_tiny_qwen2(tmp_path / "m", seed=0, vocab_size=tok.vocab_size, with_tokenizer=False)
    from transformers import AutoModelForCausalLM

    export_hf(AutoModelForCausalLM.from_pretrained(model), tmp_path / "hf", tokenizer=tok)
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = '<tool_call>{"name":"calculator","arguments":{"expression":"12*3"}}</tool_call><tool_response>36'
    assert hf(text)["input_ids"] == tok.encode(text) and len(hf) == tok.vocab_size
    assert hf.decode(tok.encode(text)) == text
    wide = type(tok)("ab\u00e9")  # a character of two bytes: no tokenizer is written, a warning says why
    with pytest.warns(RuntimeWarning, match="not single bytes"):
        export_hf(AutoModelForCausalLM.from_pretrained(model), tmp_path / "w", tokenizer=wide)
    assert not (tmp_path / "w" / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="tokenizer: got str"):
        export_hf(AutoModelForCausalLM.from_pretrained(model), tmp_path / "x", tokenizer="abc")


def test_reprobe30_an_export_failing_mid_way_leaves_the_previous_one_loadable(tmp_path, model_dir, monkeypatch):
    # save_pretrained wrote straight into out_dir: a full disk or a kill mid-export left a
    # truncated model.safetensors over the previous export.
    import errno
    import os

    from transformers import AutoModelForCausalLM, PreTrainedModel

    model, _ = load_policy(model_dir)
    out = export_hf(model, tmp_path / "hf")
    before = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(out).state_dict().items()}
    real = PreTrainedModel.save_pretrained

    def disk_full(self, directory, **kwargs):  # type: ignore[no-untyped-def]
        real(self, directory, **kwargs)
        weights = os.path.join(directory, "model.safetensors")
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 3)
        raise OSError(errno.ENOSPC, "No space left on device")

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_hf(model, out)
    monkeypatch.undo()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(before[k], v) for k, v in after.items())
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no partial folder left beside it
    export_hf(model, out)  # and the next export replaces it
    assert not torch.equal(AutoModelForCausalLM.from_pretrained(out).lm_head.weight, before["lm_head.weight"])


def test_reprobe30_an_export_leaves_a_concurrent_ones_folder_and_removes_a_dead_ones(tmp_path, model_dir):
    # The trainer's export and a user's `rlcore export` into the same hf/ must not delete each other's files.
    import subprocess
    import sys

    model, _ = load_policy(model_dir)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    running = tmp_path / f".hf.partial-{os.getpid()}-abc"
    killed = tmp_path / f".hf.partial-{dead.pid}-abc"
    for d in (running, killed):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    export_hf(model, tmp_path / "hf")
    assert running.is_dir() and not killed.exists()
