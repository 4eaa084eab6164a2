"""The Llama-family decoder layout: which models have it, and the arithmetic its layers share.

Llama, Qwen2, Qwen3 (per-head query and key norms) and Mistral decoders with full
attention are one stack: token embedding, then per layer ``x + o(attention(rope(q(n1(x))),
rope(k(n1(x))), v(n1(x))))`` followed by ``x + down(act(gate(n2(x))) * up(n2(x)))``, with
RMS norms, and a final norm. rlcore runs that stack itself where transformers' generic
forward plumbing would cost more than the arithmetic at RL sizes: the cached decode
(:mod:`rlcore.models.static_cache`) and the packed training forward
(:mod:`rlcore.models.packed_decoder`). Both compute exactly what the model's own forward
computes, with the same operations in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["is_llama_family", "rms_norm", "rotary", "unwrap_peft"]

_LAYOUTS = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def unwrap_peft(model: Any) -> Any:
    """The causal LM under a ``peft`` wrapper (adapters injected into its modules), else ``model``."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def is_llama_family(model: Any) -> bool:
    """Whether ``model`` (a causal LM, or a ``peft`` model over one) has the Llama-family layout in every layer.

    True for a ``transformers`` Llama, Qwen2, Qwen3 or Mistral causal LM with full attention
    in every layer, RMS norms, plain (not sharded) parameters and no tensor-parallel
    pretraining split.
    """
    model = unwrap_peft(model)
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None or getattr(config, "model_type", None) not in _LAYOUTS:
        return False
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types) or getattr(config, "use_sliding_window", False):
        return False
    if getattr(config, "model_type", None) == "mistral" and getattr(config, "sliding_window", None) is not None:
        return False
    if getattr(config, "pretraining_tp", 1) != 1:
        return False
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(inner, p) for p in parts) or not hasattr(model, "lm_head"):
        return False
    if not isinstance(inner.embed_tokens, torch.nn.Embedding) or not hasattr(inner.norm, "variance_epsilon"):
        return False
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in names):
            return False
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return False
        norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if not all(hasattr(n, "variance_epsilon") for n in norms):
            return False
    return not any(isinstance(p, DTensor) for p in model.parameters())


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of queries or keys ``x``: ``x * cos + rotate_half(x) * sin``, as transformers computes it.

    ``rotate_half(x)`` is ``[-x2, x1]`` of the two halves of the last dimension; ``cos`` and
    ``sin`` broadcast against ``x`` (one angle per position, shared by the heads).
    """
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama-family RMS norm: normalised in float32, scaled by ``weight`` in the input's dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps)).to(dtype)
