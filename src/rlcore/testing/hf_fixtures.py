"""Tiny local Hugging Face artefacts for end-to-end tests: a Qwen2 directory, its tokenizer, a prompt dataset.

Everything is built on the spot (random weights, a byte-level BPE tokenizer trained with
``tokenizers`` on the task's own text, a ChatML chat template) and written with
``save_pretrained``, so a test loads them exactly as a user loads a downloaded model.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CHATML_TEMPLATE",
    "arithmetic_rows",
    "build_tiny_qwen2",
    "build_tiny_reward_model",
    "tiny_tokenizer",
    "write_prompt_files",
]

# The ChatML template of Qwen2.5-Instruct, without its tool-calling branches.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def arithmetic_rows(n: int, *, seed: int = 0, low: int = 0, high: int = 20) -> list[dict[str, Any]]:
    """``n`` addition problems ``{"prompt", "answer", "a", "b"}`` (the answer as a string), seeded.

    >>> arithmetic_rows(1, seed=3)[0]["prompt"].startswith("What is ")
    True
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        rows.append({"prompt": f"What is {a} + {b}? Answer in \\boxed{{}}.", "answer": str(a + b), "a": a, "b": b})
    return rows


def tiny_tokenizer(
    texts: Sequence[str],
    *,
    vocab_size: int = 320,
    chat_template: str | None = CHATML_TEMPLATE,
    pad_token: str | None = "<|endoftext|>",
) -> Any:
    """A byte-level BPE tokenizer trained on ``texts``, with ChatML special tokens and a chat template.

    EOS is ``<|im_end|>`` and padding ``<|endoftext|>`` (Qwen2.5-Instruct's choices).

    Args:
      texts: the training text.
      vocab_size: the BPE vocabulary size (at least the 256 bytes plus the 3 special tokens).
      chat_template: a Jinja chat template, or ``None`` for a tokenizer without one.
      pad_token: the padding token, or ``None`` for a tokenizer without one.

    Returns:
      A ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    if pad_token is not None:
        out.pad_token = pad_token
    if chat_template is not None:
        out.chat_template = chat_template
    return out


def _corpus(rows: Sequence[dict[str, Any]]) -> list[str]:
    turns = [f"<|im_start|>user\n{r['prompt']}<|im_end|>\n<|im_start|>assistant\n" for r in rows]
    return turns + [f"The answer is \\boxed{{{r['answer']}}}." for r in rows] + [str(i) for i in range(200)]


def build_tiny_qwen2(
    directory: str | os.PathLike,
    *,
    texts: Sequence[str] | None = None,
    vocab_size: int = 320,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    chat_template: str | None = CHATML_TEMPLATE,
    pad_token: str | None = "<|endoftext|>",
    with_tokenizer: bool = True,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised tiny Qwen2 causal LM and its tokenizer to ``directory``.

    Args:
      directory: where ``save_pretrained`` writes (created if missing).
      texts: the tokenizer's training text; ``None`` uses the arithmetic task's text.
      vocab_size: BPE vocabulary size; the model's vocabulary is the tokenizer's.
      hidden_size, num_layers, num_heads, num_kv_heads: the model's shape.
      chat_template: the tokenizer's chat template (``None``: none).
      pad_token: the tokenizer's padding token (``None``: none).
      with_tokenizer: ``False`` writes the model alone (a directory without a tokenizer).
      seed: seed of the weights.

    Returns:
      The directory, as a ``Path``.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(
        _corpus(arithmetic_rows(200)) if texts is None else texts,
        vocab_size=vocab_size,
        chat_template=chat_template,
        pad_token=pad_token,
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(path)
    if with_tokenizer:
        tokenizer.save_pretrained(path)
    return path


def build_tiny_reward_model(
    directory: str | os.PathLike, *, hidden_size: int = 32, num_layers: int = 1, seed: int = 0
) -> Path:
    """Write a randomly initialised tiny ``Qwen2ForSequenceClassification`` (one score) and its tokenizer.

    Returns:
      The directory, as a ``Path``.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(_corpus(arithmetic_rows(100)))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_prompt_files(
    directory: str | os.PathLike, *, num_train: int = 200, num_val: int = 20, seed: int = 0
) -> tuple[Path, Path]:
    """Write the arithmetic task as ``train.jsonl`` and ``val.jsonl`` (``prompt``, ``answer``, ``a``, ``b``).

    Returns:
      ``(train_path, val_path)``.

    >>> import tempfile
    >>> train, val = write_prompt_files(tempfile.mkdtemp(), num_train=3, num_val=2)
    >>> len(train.read_text().splitlines()), len(val.read_text().splitlines())
    (3, 2)
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (
        ("train.jsonl", arithmetic_rows(num_train, seed=seed)),
        ("val.jsonl", arithmetic_rows(num_val, seed=seed + 1)),
    ):
        file = path / name
        file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(file)
    return paths[0], paths[1]
