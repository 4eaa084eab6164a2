"""The packed forward of a Llama-family backbone as one function of its weights: no module plumbing per call.

:func:`rlcore.models.from_hf`'s ``apply`` runs the backbone as a parameter-free twin
through ``torch.func.functional_call``: every call swaps each weight into the twin,
builds transformers' attention-mask arguments, and passes keyword arguments and output
classes through every module. At the sizes of RL post-training on a CPU (a few thousand
tokens, small layers) that plumbing is a fifth of the forward. For the Llama-family
layout (:func:`rlcore.models.llama_family.is_llama_family`) :func:`decoder_hidden`
computes the same arithmetic -- the same operations on the same operands, in the same
order -- straight from the weight tensors, and calls the model's own parameter-free
parts (rotary embedding, activation) for the rest. The attention is whatever the packing
asks for (``attend``), as in the twin.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from rlcore.models.llama_family import rms_norm, rotary

__all__ = ["decoder_hidden"]

Weights = Callable[[str], "torch.Tensor | None"]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_MLP = ("gate_proj", "up_proj", "down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


@functools.cache
def _layer_names(i: int) -> dict[str, str]:
    """Backbone-relative names of layer ``i``'s parts: ``q_proj`` -> ``layers.i.self_attn.q_proj``, and so on."""
    return {
        **{n: f"layers.{i}.self_attn.{n}" for n in _ATTENTION},
        **{n: f"layers.{i}.mlp.{n}" for n in _MLP},
        **{n: f"layers.{i}.{n}" for n in _NORMS},
    }


def _linear(weights: Weights, name: str, x: torch.Tensor) -> torch.Tensor:
    weight = weights(name + ".weight")
    assert weight is not None, f"{name}.weight: every projection has a weight"
    return F.linear(x, weight, weights(name + ".bias"))


def _norm(weights: Weights, name: str, module: Any, x: torch.Tensor) -> torch.Tensor:
    weight = weights(name + ".weight")
    assert weight is not None, f"{name}.weight: every RMS norm has a weight"
    return rms_norm(x, weight, module.variance_epsilon)


def decoder_hidden(
    backbone: Any, weights: Weights, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """Last hidden states ``[N, H]`` (after the final norm) of the packed row ``input_ids`` ``[N]``.

    Args:
      backbone: the model's backbone (``model.model``) of a Llama-family causal LM; its
        parameter-free parts (rotary embedding, activations, norm epsilons, shapes) are read.
      weights: backbone-relative name (``"layers.0.self_attn.q_proj.weight"``) -> the
        tensor to use, or None where the model has none (a bias).
      input_ids, position_ids: ``[N]`` token ids of the packed sequences and their
        positions within each sequence.
      attend: ``attend(q [N, heads, D], k, v [N, kv_heads, D], scale) -> [N, heads, D]``,
        the packing's attention (causal within each sequence, or a shared-prompt layout).
    """
    n = input_ids.shape[0]
    embed = backbone.embed_tokens
    table = weights("embed_tokens.weight")
    assert table is not None, "embed_tokens.weight: the embedding has a weight"
    hidden = F.embedding(
        input_ids, table, embed.padding_idx, embed.max_norm, embed.norm_type, embed.scale_grad_by_freq, embed.sparse
    )
    cos, sin = backbone.rotary_emb(hidden[None], position_ids[None])
    cos, sin = cos[0][:, None], sin[0][:, None]  # [N, 1, D]: one angle per token, shared by the heads
    for i, layer in enumerate(backbone.layers):
        names, attn = _layer_names(i), layer.self_attn
        x = _norm(weights, names["input_layernorm"], layer.input_layernorm, hidden)
        q, k, v = (_linear(weights, names[p], x).view(n, -1, attn.head_dim) for p in ("q_proj", "k_proj", "v_proj"))
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotary embedding
            q = _norm(weights, names["q_norm"], attn.q_norm, q)
            k = _norm(weights, names["k_norm"], attn.k_norm, k)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        out = attend(q, k, v, attn.scaling).reshape(n, -1)
        hidden = hidden + _linear(weights, names["o_proj"], out)
        x = _norm(weights, names["post_attention_layernorm"], layer.post_attention_layernorm, hidden)
        act = layer.mlp.act_fn(_linear(weights, names["gate_proj"], x)) * _linear(weights, names["up_proj"], x)
        hidden = hidden + _linear(weights, names["down_proj"], act)
    return _norm(weights, "norm", backbone.norm, hidden)
