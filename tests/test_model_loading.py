"""Policy and tokenizer from a local Hugging Face directory: dtype names, attention fallback, special ids, errors."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from rlcore.models import attention_implementation, load_policy, load_tokenizer, resolve_dtype, token_ids
from rlcore.testing.hf_fixtures import build_tiny_qwen2, tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


def test_load_policy_and_tokenizer(model_dir):
    model, tokenizer = load_policy(model_dir, torch_dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "sdpa"
    assert tokenizer.chat_template
    ids = token_ids(tokenizer, generation_config=model.generation_config)
    assert ids.eos == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.pad == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert ids.stop == (ids.eos,)
    # the loaded weights are the saved ones
    from safetensors.torch import load_file

    saved = load_file(str(model_dir / "model.safetensors"))
    loaded, _ = load_policy(model_dir, torch_dtype=torch.float32)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, saved[name]), name
    auto, _ = load_policy(model_dir, torch_dtype="auto")
    assert next(auto.parameters()).dtype == torch.float32


def test_flash_attention_falls_back_to_sdpa_with_a_warning(model_dir):
    with pytest.warns(UserWarning, match="use_flash_attention: .*using SDPA attention instead"):
        model, _ = load_policy(model_dir, use_flash_attention=True, device="cpu")
    assert model.config._attn_implementation == "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attention_implementation(False, device="cpu") == "sdpa"


def test_pad_falls_back_to_eos_and_generation_config_adds_stop_ids(tmp_path):
    # a tokenizer directory without a model config: transformers keeps the tokenizer's own (absent) pad
    tiny_tokenizer(["1 + 2 = 3"], vocab_size=270, pad_token=None).save_pretrained(tmp_path / "nopad")
    tokenizer = load_tokenizer(tmp_path / "nopad")
    ids = token_ids(tokenizer)
    assert ids.pad == ids.eos == tokenizer.convert_tokens_to_ids("<|im_end|>")

    from transformers import GenerationConfig

    generation = GenerationConfig(eos_token_id=[ids.eos, 0])
    assert token_ids(tokenizer, generation_config=generation).stop == (ids.eos, 0)


def test_resolve_dtype():
    table = {"bf16": torch.bfloat16, "BFloat16": torch.bfloat16, "fp16": torch.float16, "float32": torch.float32}
    for name, dtype in table.items():
        assert resolve_dtype(name) is dtype
    assert resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype("auto") is torch.float32
    with pytest.raises(ValueError, match="torch_dtype: got 'int8'"):
        resolve_dtype("int8")
    with pytest.raises(ValueError, match="torch_dtype: got torch.int64"):
        resolve_dtype(torch.int64)


def test_errors_name_the_setting_and_the_directory(tmp_path, model_dir):
    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(model_dir, no_tok)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (no_tok / name).unlink(missing_ok=True)
    grown = tmp_path / "grown_tokenizer"
    shutil.copytree(model_dir, grown)
    tokenizer = load_tokenizer(grown)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(5)])
    tokenizer.save_pretrained(grown)
    cases = [
        (lambda: load_policy(no_tok), r"model\.model_name_or_path: '.*no_tokenizer' has no tokenizer"),
        (lambda: load_tokenizer(tmp_path / "absent"), r"model\.model_name_or_path: got '.*absent', expected a local"),
        (lambda: load_policy("Qwen/Qwen2.5-7B-Instruct"), r"got 'Qwen/Qwen2\.5-7B-Instruct', expected a local model"),
        (lambda: load_policy(grown), r"'.*grown_tokenizer' has 325 tokens, more than the model's 320 embeddings"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as info:
            call()
        assert "\n" not in str(info.value)


# --- the one builder ------------------------------------------------------------------------------

TINY = {
    "model_type": "qwen2",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def _direct(fields, *, vocab_size, dtype, value_head=False):
    """The model transformers builds from the same config and the current global stream: the oracle."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    options = {"vocab_size": vocab_size, **fields}
    head = {"num_labels": 1} if value_head else {}
    config = AutoConfig.for_model(options.pop("model_type"), **options, **head)
    auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    return auto.from_config(config, dtype=dtype, attn_implementation="sdpa")


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_trainer_models_are_the_one_builders_with_the_global_stream(name):
    """rlcore.train.build_model (policy, then critic) draws from the seeded global stream exactly as transformers does."""
    from rlcore.train import build_model, parse_config

    cfg = parse_config({"model": {"model_name_or_path": TINY, "torch_dtype": name}, "rl": {"algo": "ppo"}})
    torch.manual_seed(5)
    policy, critic = build_model(cfg, 30), build_model(cfg, 30, critic=True)
    torch.manual_seed(5)
    want_policy = _direct(TINY, vocab_size=30, dtype=resolve_dtype(name))
    want_critic = _direct(TINY, vocab_size=30, dtype=resolve_dtype(name), value_head=True)
    _same_weights(policy, want_policy)
    _same_weights(critic, want_critic)
    assert critic.config.num_labels == 1 and type(critic).__name__.endswith("ForTokenClassification")


def test_a_seeded_build_leaves_the_global_stream_and_repeats():
    from rlcore.models import load_causal_lm

    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a = load_causal_lm(TINY, seed=3, vocab_size=30)
    assert torch.equal(torch.random.get_rng_state(), before)
    _same_weights(a, load_causal_lm(TINY, seed=3, vocab_size=30))
    b = load_causal_lm(TINY, seed=None, vocab_size=30)  # the global stream: it advances
    assert not torch.equal(torch.random.get_rng_state(), before)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_a_directory_loads_out_of_its_memory_map_with_the_value_head(model_dir):
    from safetensors.torch import load_file

    from rlcore.models import load_causal_lm

    saved = load_file(str(model_dir / "model.safetensors"))
    model = load_causal_lm(model_dir, dtype="auto")
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name
        p.data.untyped_storage().resize_(0)  # what the co-located swap does: a memory-mapped storage refuses
    critic = load_causal_lm(model_dir, value_head=True)
    assert critic.config.num_labels == 1 and critic.score.weight.shape[0] == 1


def test_one_dtype_table_covers_every_config_name():
    import typing

    from rlcore.models import DTYPES
    from rlcore.train.config import ModelConfig

    names = typing.get_args(typing.get_type_hints(ModelConfig)["torch_dtype"])
    assert names and set(names) <= set(DTYPES)
    for name in names:
        assert resolve_dtype(name) is DTYPES[name] and DTYPES[name].is_floating_point


def test_builder_errors_name_the_setting():
    from rlcore.models import load_causal_lm

    what = "config key 'model.model_name_or_path'"
    cases = [
        (lambda: load_causal_lm({**TINY, "vocab_size": 8}, vocab_size=30, what=what), r"vocab_size 8 is smaller"),
        (lambda: load_causal_lm({"hidden_size": 8}, what=what), r"expected a 'model_type' among them"),
        (lambda: load_causal_lm("no/such/dir", what=what), r"got 'no/such/dir', expected a local model directory"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as info:
            call()
        assert str(info.value).startswith(what)


def test_a_critic_has_no_dropout_its_train_mode_values_equal_its_eval_values(model_dir):
    """transformers' token-classification head drops 10% by default; a critic must not (PPO's value clip compares
    the update's values with the rollout's old_values on the same weights, and runs reproduce across world sizes)."""
    from rlcore.models import load_causal_lm

    ids = torch.randint(0, 30, (3, 7), generator=torch.Generator().manual_seed(0))
    for critic in (load_causal_lm(TINY, vocab_size=30, value_head=True), load_causal_lm(model_dir, value_head=True)):
        assert critic.config.classifier_dropout == 0.0
        critic.train()
        torch.manual_seed(1)
        a = critic(input_ids=ids).logits
        torch.manual_seed(2)
        b = critic(input_ids=ids).logits
        critic.eval()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, critic(input_ids=ids).logits, rtol=0, atol=0)
