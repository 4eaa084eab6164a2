"""A policy and its tokenizer from one local Hugging Face directory, and the EOS and padding ids.

The model comes from :func:`rlcore.models.load_causal_lm` (the one builder: dtype
names, attention kernel, no downloads); this module adds the tokenizer from the same
directory. transformers is imported on first use.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from rlcore.models.build import load_causal_lm

__all__ = ["TokenIds", "load_policy", "load_tokenizer", "token_ids"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def load_tokenizer(path: str | os.PathLike, *, what: str = "model.model_name_or_path") -> Any:
    """The tokenizer saved in a local model directory, through ``AutoTokenizer``.

    A tokenizer without a padding token pads with its EOS token.

    Args:
      path: the model directory (``save_pretrained`` output).
      what: the setting that gave ``path``, named in errors.

    Returns:
      A transformers tokenizer.

    Raises:
      ValueError: one line naming ``what`` and the path, when the directory is missing,
        holds no tokenizer files, or its tokenizer does not load.
    """
    from transformers import AutoTokenizer

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{what}: got {path!r}, expected a local model directory (rlcore never downloads)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{what}: {path!r} has no tokenizer (none of {list(_TOKENIZER_FILES)}); "
            "save one there with tokenizer.save_pretrained"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:
        raise ValueError(f"{what}: the tokenizer in {path!r} does not load: {_one_line(err)}") from err
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class TokenIds(NamedTuple):
    """The special token ids generation needs: ``eos``, ``pad`` (EOS when the tokenizer has none) and every ``stop`` id."""

    eos: int
    pad: int
    stop: tuple[int, ...]


def token_ids(tokenizer: Any, *, generation_config: Any = None) -> TokenIds:
    """EOS, padding and stop ids from a tokenizer (and the model's generation config, which may add stop ids).

    Args:
      tokenizer: a transformers tokenizer.
      generation_config: the model's ``GenerationConfig`` (its ``eos_token_id``, an int or
        a list, joins the stop ids, as Qwen2.5-Instruct's ``<|endoftext|>``), or ``None``.

    Returns:
      :class:`TokenIds` ``(eos, pad, stop)``.
    """
    extra = getattr(generation_config, "eos_token_id", None)
    extra_ids: Sequence[int] = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    eos = tokenizer.eos_token_id
    if eos is None:
        if not extra_ids:
            raise ValueError("tokenizer: has no eos_token_id and the generation config names none, expected one")
        eos = extra_ids[0]
    pad = tokenizer.pad_token_id
    stop = tuple(dict.fromkeys([eos, *extra_ids]))
    return TokenIds(eos=int(eos), pad=int(eos if pad is None else pad), stop=tuple(int(i) for i in stop))


def load_policy(
    path: str | os.PathLike,
    *,
    torch_dtype: str | torch.dtype | None = "float32",
    use_flash_attention: bool = False,
    device: torch.device | str | None = None,
    what: str = "model.model_name_or_path",
) -> tuple[nn.Module, Any]:
    """A causal LM and its tokenizer from one local Hugging Face directory.

    Args:
      path: the directory (``config.json``, safetensors weights, tokenizer files).
      torch_dtype: parameter dtype (see :func:`rlcore.models.resolve_dtype`).
      use_flash_attention: use FlashAttention-2 where usable, else SDPA with a warning.
      device: where the model is put; ``None`` leaves it on the CPU.
      what: the setting that gave ``path``, named in errors.

    Returns:
      ``(model, tokenizer)``; :func:`token_ids` gives the EOS / padding ids.

    Raises:
      ValueError: one line naming ``what`` for a missing directory, a missing or broken
        tokenizer, or a tokenizer larger than the model's vocabulary.
    """
    tokenizer = load_tokenizer(path, what=what)
    model: Any = load_causal_lm(
        path, dtype=torch_dtype, use_flash_attention=use_flash_attention, device=device, what=what
    )
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ValueError(
            f"{what}: the tokenizer in {os.fspath(path)!r} has {len(tokenizer)} tokens, "
            f"more than the model's {vocab} embeddings"
        )
    return model, tokenizer
