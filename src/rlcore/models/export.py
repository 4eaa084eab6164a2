"""Export a policy as a Hugging Face directory (safetensors, config, generation config, tokenizer) that loads anywhere."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlcore.models.lora import is_lora, merged_state_dict

__all__ = ["export_hf"]


@torch.no_grad()
def export_hf(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
    params: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str = "5GB",
) -> Path:
    """Write ``model`` with ``save_pretrained`` so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it.

    A LoRA model (``peft.PeftModel``) is written with its adapters merged, as a plain
    model of the base architecture, so inference servers need no peft. ``params`` (e.g.
    the trained tensors of :func:`rlcore.models.from_hf`) replace the model's own tensors
    of the same names. Weights are safetensors; the model itself is not modified.

    Args:
      model: a transformers causal LM, or a ``peft.PeftModel`` around one.
      out_dir: the directory to write (created if missing).
      tokenizer: saved beside the weights when given (with its chat template).
      params: name -> tensor overriding the model's state.
      dtype: cast floating weights to this dtype (``None``: keep theirs).
      max_shard_size: ``save_pretrained``'s shard size.

    Returns:
      ``out_dir`` as a ``Path``.
    """
    base: Any = model.get_base_model() if is_lora(model) else model  # type: ignore[operator]
    state = merged_state_dict(model) if is_lora(model) else dict(model.state_dict())
    if params is not None:
        unknown = sorted(set(params) - set(state))
        if unknown:
            raise ValueError(f"params: got names the model does not have, e.g. {unknown[:3]}")
        state.update(params)
    state = {
        k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()).contiguous()
        for k, v in state.items()
    }
    # A clean twin of the base architecture (no adapter modules), holding the tensors
    # without copying them, is what gets saved.
    with torch.device("meta"):
        twin = type(base)(base.config)
    twin.load_state_dict(state, strict=False, assign=True)
    missing = [n for n, p in twin.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"model: its state lacks {missing[:3]}, which the exported architecture needs")
    if dtype is not None:
        twin.config.torch_dtype = dtype
    twin.generation_config = getattr(base, "generation_config", twin.generation_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    twin.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
