"""Overrides that make a reference-trainer run tiny and quick, shared by the trainer tests."""

from __future__ import annotations

import torch
import transformers

TINY_MODEL = [
    "model.model_name_or_path.hidden_size=32",
    "model.model_name_or_path.intermediate_size=64",
    "model.model_name_or_path.num_hidden_layers=1",
]
TINY_ROLLOUT = ["rl.num_rollouts=4", "rl.max_new_tokens=6", "trainer.warmup_steps=2"]
TINY_BATCH = ["rl.batch_size=4", "rl.mini_batch_size=2", "trainer.warmup_batch_size=8"]
# No progress bar, no plots, one thread, rewards in the trainer's process, one rollout at a time.
QUIET = [
    "trainer.progress=false",
    "trainer.plot=false",
    "trainer.threads=1",
    "trainer.reward_workers=0",
    "deploy.async_infer=false",
]
TINY = [*TINY_MODEL, *TINY_BATCH, *TINY_ROLLOUT, *QUIET]
# The smallest step of the main job that still runs every stage: 2 prompts x 2 samples, one warm-up step, one thread.
SMALLEST_STEP = [
    "rl.batch_size=2",
    "rl.mini_batch_size=2",
    "rl.num_rollouts=2",
    "trainer.warmup_steps=1",
    "trainer.warmup_batch_size=4",
    "trainer.threads=1",
]


def record_losses(records: list[dict]) -> torch.Tensor:
    """The ``loss`` of each step record, as float64."""
    return torch.tensor([r["loss"] for r in records], dtype=torch.float64)


def tiny_qwen2(vocab_size: int) -> dict:
    """An inline config of a 2-layer, hidden-32 Qwen2 (GQA: 4 query heads, 2 key-value heads) for model-level tests."""
    return {
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }


def tiny_lm(dtype=torch.float32, seed=0, vocab=12):
    """A random 2-layer Qwen2 causal LM (hidden 32, 4 heads over 2 KV heads) in eval mode."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def tiny_family_lm(kind, *, vocab, dtype=torch.float32, seed=0, **extra):
    """A random 2-layer causal LM of ``kind`` (qwen2, llama, qwen3, mistral, ...): hidden 32, 4 heads over 2 KV heads, eval mode.

    ``extra`` overrides or adds config keys (``head_dim``, ``attention_bias``, a sliding window, ...).
    """
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(
        kind,
        **{
            "vocab_size": vocab,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            **extra,
        },
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
