"""The one model builder: an HF causal LM (or its one-output value head) from a config or a local directory.

Every model rlcore makes (the trainer's policy, reference and critic, the rollout
worker's copy, the exporter's, :func:`rlcore.models.load_policy`'s) comes from
:func:`load_causal_lm`, with the dtype names of :data:`DTYPES` (the one table) and the
attention kernel of :func:`attention_implementation`. transformers is imported on first use.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["DTYPES", "attention_implementation", "load_causal_lm", "resolve_dtype"]

DTYPES: Mapping[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
"""The dtype names a config may use (``torch_dtype``), besides ``"auto"``."""


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def resolve_dtype(value: str | torch.dtype | None, *, path: str | os.PathLike | None = None) -> torch.dtype:
    """The ``torch.dtype`` a config names: ``bf16`` / ``bfloat16``, ``fp16`` / ``float16``, ``fp32`` / ``float32``, or ``auto``.

    ``auto`` (and ``None``) takes the dtype recorded in ``path``'s ``config.json``
    (``torch_dtype`` or ``dtype``), float32 when it records none.

    Args:
      value: the name (a key of :data:`DTYPES`), a ``torch.dtype``, ``"auto"`` or ``None``.
      path: the model directory read for ``auto``.

    Returns:
      A floating ``torch.dtype``.

    >>> resolve_dtype("bf16")
    torch.bfloat16
    """
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ValueError(f"torch_dtype: got {value}, expected a floating dtype")
        return value
    if value is None or value == "auto":
        recorded = None
        config = os.path.join(os.fspath(path), "config.json") if path is not None else None
        if config is not None and os.path.isfile(config):
            with open(config) as f:
                fields = json.load(f)
            recorded = fields.get("torch_dtype") or fields.get("dtype")
        return DTYPES.get(str(recorded), torch.float32)
    if isinstance(value, str) and value.lower() in DTYPES:
        return DTYPES[value.lower()]
    raise ValueError(f"torch_dtype: got {value!r}, expected one of {sorted(DTYPES)} or 'auto'")


def attention_implementation(use_flash_attention: bool, *, device: torch.device | str | None = None) -> str:
    """``"flash_attention_2"`` when asked for and usable (flash-attn installed, a CUDA device), else ``"sdpa"``.

    Asking for flash attention where it is not usable warns and falls back to SDPA.

    >>> attention_implementation(False)
    'sdpa'
    """
    if not use_flash_attention:
        return "sdpa"
    from transformers.utils import is_flash_attn_2_available

    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    installed = importlib.util.find_spec("flash_attn") is not None
    if kind == "cuda" and installed and is_flash_attn_2_available():
        return "flash_attention_2"
    if not installed:
        reason = "flash-attn is not installed"
    elif kind != "cuda":
        reason = f"the device is {kind!r}, not CUDA"
    else:
        reason = "flash-attn does not run with this transformers and torch"
    warnings.warn(f"use_flash_attention: {reason}; using SDPA attention instead", stacklevel=2)
    return "sdpa"


@contextlib.contextmanager
def _init_stream(seed: int | None) -> Iterator[None]:
    """Random initialisation from ``seed`` (the global stream left untouched), or from the global stream (``None``)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _dtype_kwarg() -> str:
    import transformers

    # transformers 4.56 renamed ``torch_dtype`` to ``dtype``.
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if version >= (4, 56) else "torch_dtype"


def load_causal_lm(
    source: Any,
    *,
    dtype: str | torch.dtype | None = torch.float32,
    seed: int | None = 0,
    vocab_size: int | None = None,
    value_head: bool = False,
    use_flash_attention: bool = False,
    device: torch.device | str | None = None,
    what: str = "source",
) -> nn.Module:
    """Build an HF causal LM from a config (random weights) or load it from a local directory.

    Never downloads: a string that is not an existing directory is refused, where
    transformers would treat it as a hub name.

    Args:
      source: a transformers ``PretrainedConfig``, a dict of config fields with a
        ``"model_type"`` (e.g. ``{"model_type": "qwen2", "hidden_size": 64, ...}``), or
        a local directory written by ``save_pretrained``.
      dtype: parameter dtype, or a name of :func:`resolve_dtype` (``"auto"``: a
        directory's recorded dtype).
      seed: seed of the random initialisation (the global RNG is left untouched);
        ``None`` draws it from the global RNG (a trainer that seeds once and builds
        several models in turn).
      vocab_size: the tokenizer's size: a dict config without ``vocab_size`` takes it,
        and a model with a smaller vocabulary is refused.
      value_head: a ``*ForTokenClassification`` model with one output per token (a
        critic) in place of the LM head, without the classifier dropout.
      use_flash_attention: FlashAttention-2 where usable, else SDPA with a warning
        (:func:`attention_implementation`) on ``device``.
      device: where the model is put; ``None`` leaves it on the CPU.
      what: the setting that gave ``source``, named in errors.

    Returns:
      The ``*ForCausalLM`` (or ``*ForTokenClassification``) module.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, PretrainedConfig

    auto: Any = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    head = {"num_labels": 1} if value_head else {}
    path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    options = {
        _dtype_kwarg(): resolve_dtype(dtype, path=path),
        "attn_implementation": attention_implementation(use_flash_attention, device=device),
    }
    if path is not None:
        if not os.path.isdir(path):
            raise ValueError(
                f"{what}: got {path!r}, expected a local model directory or a config (rlcore never downloads from the hub)"
            )
        try:
            model = auto.from_pretrained(path, local_files_only=True, **options, **head)
        except Exception as err:
            raise ValueError(f"{what}: the model in {path!r} does not load: {_one_line(err)}") from err
        # Weights loaded from safetensors may live in the file's memory map, whose storage cannot
        # be resized: the co-located swap offloads by resizing storages to 0.
        for p in model.parameters():
            p.data = p.data.clone()
    else:
        if isinstance(source, Mapping):
            fields = dict(source)
            if "model_type" not in fields:
                raise ValueError(f"{what}: got config keys {sorted(fields)}, expected a 'model_type' among them")
            if vocab_size is not None:
                fields = {"vocab_size": vocab_size, **fields}
            source = AutoConfig.for_model(fields.pop("model_type"), **fields, **head)
        elif isinstance(source, PretrainedConfig) and value_head:
            source = source.__class__.from_dict({**source.to_dict(), **head})
        if not isinstance(source, PretrainedConfig):
            raise ValueError(
                f"{what}: got {type(source).__name__}, expected a PretrainedConfig, a dict or a local path"
            )
        with _init_stream(seed):
            model = auto.from_config(source, **options)
    if vocab_size is not None and model.config.vocab_size < vocab_size:
        raise ValueError(
            f"{what}: the model's vocab_size {model.config.vocab_size} is smaller than the tokenizer's {vocab_size}"
        )
    if value_head:
        _no_dropout(model)
    return model if device is None else model.to(device)


def _no_dropout(critic: nn.Module) -> None:
    """Turn off a critic's dropout (transformers' token-classification head drops 10% by default).

    Its values in the update must equal the rollout's ``old_values`` on the same weights
    (PPO's value clip), and must not depend on the random stream, so that runs reproduce
    at any world size. The config records it, so a saved critic loads the same.
    """
    config: Any = critic.config
    config.classifier_dropout = 0.0
    for module in critic.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
