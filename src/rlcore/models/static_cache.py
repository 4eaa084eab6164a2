"""The prompt forward and decode steps of a Llama-family decoder over a preallocated KV cache, without set-up per call.

A ``transformers`` forward of one token per row re-does, at every step, work that does
not change between steps: the attention mask is rebuilt from the whole ``[B, T]``
padding mask, the cache grows by concatenation, the grouped keys and values are
repeated to every query head, and every module call passes through the generic
forward plumbing. At the sizes of RL rollouts (hundreds of rows, a few layers) that
set-up is a third of the decode's time on a CPU. :class:`StaticDecodeStep` runs the
same arithmetic through the model's own sub-modules (its norms, projections, rotary
embedding, activation and output head, so adapters wrapping a projection keep
working), with keys and values written in place into buffers with room to grow and a
boolean padding mask kept beside them. :meth:`StaticDecodeStep.prefill` runs the prompt
the same way (one causal-and-padding mask, only the last position through the head) and
writes its keys and values straight into those buffers.

It serves the decoder layouts of Llama, Qwen2, Qwen3 (per-head query and key norms) and
Mistral with full attention; :func:`supports_static_decode` says whether a model is one
of them. Anything else (sliding windows, sharded or hooked modules, a legacy cache)
keeps the model's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlcore.models.attention import attend_masked
from rlcore.models.llama_family import is_llama_family, rotary, unwrap_peft

__all__ = ["StaticDecodeStep", "supports_static_decode"]

# Room added to the cache when it is full: at least this many columns (doubling beyond).
_GROW = 16


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def supports_static_decode(model: Any) -> bool:
    """Whether :class:`StaticDecodeStep` computes ``model``'s decode step exactly as its own forward does.

    True for a Llama-family causal LM (:func:`rlcore.models.llama_family.is_llama_family`: a
    ``transformers`` Llama, Qwen2, Qwen3 or Mistral with full attention, or a ``peft`` model
    over one: its adapters sit in the projections the step calls) with plain (not hooked)
    modules and no attention dropout in training mode.
    """
    if not is_llama_family(model):
        return False
    model = unwrap_peft(model)
    if model.training and getattr(model.config, "attention_dropout", 0.0):
        return False
    inner = model.model
    return not any(_hooked(m) for m in (model, inner, *inner.layers, *(layer.self_attn for layer in inner.layers)))


def _cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each layer's ``(keys, values)`` ``[B, kv_heads, T, head_dim]`` of a transformers cache, or None if unknown."""
    layers = getattr(cache, "layers", None)
    if layers is not None and all(hasattr(x, "keys") and hasattr(x, "values") for x in layers):
        return [(x.keys, x.values) for x in layers]
    if isinstance(cache, (tuple, list)) and all(isinstance(x, (tuple, list)) and len(x) >= 2 for x in cache):
        return [(x[0], x[1]) for x in cache]
    return None


def _rope_table(inner: Any, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cos, sin)`` ``[length, head_dim]`` of positions ``0 .. length - 1``, or None for a rotary embedding with state.

    The default rotary embedding is a function of the position alone (each angle one
    product ``position * inv_freq``), so a row of the table is bit for bit what the model's
    ``rotary_emb`` gives that position; the decode reads it instead of recomputing the
    angles, their cosines and sines at every token. Scaled variants whose frequencies
    follow the sequence length (dynamic, longrope) keep the model's own call.
    """
    rotary = inner.rotary_emb
    if getattr(rotary, "rope_type", None) != "default":
        return None
    weight = inner.embed_tokens.weight
    positions = torch.arange(length, device=weight.device)[None]
    cos, sin = rotary(weight[:1], positions)
    return cos[0], sin[0]


def _rotary(
    attn: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys ``[..., heads, T, head_dim]`` after the per-head norms (Qwen3) and the rotary embedding."""
    if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotary embedding
        q, k = attn.q_norm(q), attn.k_norm(k)
    return rotary(q, cos, sin), rotary(k, cos, sin)


def _mlp(layer: Any, hidden: torch.Tensor) -> torch.Tensor:
    mlp = layer.mlp
    x = layer.post_attention_layernorm(hidden)
    return hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


class StaticDecodeStep:
    """The cached decode of a :func:`supports_static_decode` model, from a prefill's cache on.

    Args:
      model: the causal LM (its sub-modules are called; its weights are read at each step,
        so weights loaded in place between steps are used, as by the model's own forward).
      cache: the prefill's ``transformers`` cache over ``[B, T]`` (its entries are copied).
      attention: ``[B, T]`` padding mask of the cached positions (1 on real tokens).

    Call it with one token per row (``[B]``) and their positions (``[B, 1]``) for the next
    logits ``[B, V]``; :meth:`select` keeps a subset of the rows.
    """

    def __init__(self, model: Any, cache: Any, attention: torch.Tensor):
        layers = _cache_layers(cache)
        if layers is None:
            raise ValueError(f"cache: got {type(cache).__name__}, expected a transformers cache with per-layer keys")
        self.model = model = unwrap_peft(model)
        self.inner = model.model
        rows, length = attention.shape
        capacity = length + _GROW
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for keys, values in layers:
            k = keys.new_empty(rows, keys.shape[1], capacity, keys.shape[3])
            v = values.new_empty(rows, values.shape[1], capacity, values.shape[3])
            k[:, :, :length] = keys
            v[:, :, :length] = values
            self.keys.append(k)
            self.values.append(v)
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=attention.device)
        self.valid[:, :length] = attention.bool()
        self.length = length
        self.rope = _rope_table(self.inner, capacity)

    @classmethod
    def prefill(
        cls,
        model: Any,
        ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        groups: torch.Tensor | None = None,
    ) -> tuple[StaticDecodeStep, torch.Tensor]:
        """The prompt forward into a new step's buffers: ``(step, logits [B, V] of each row's next token)``.

        The same arithmetic as the model's own forward over the left-padded prompts, on
        the same sub-modules, with one boolean causal-and-padding mask; only the last
        position goes through the norm and the output head (the model's forward takes
        them at every position and keeps the last). A padding query has no key to attend:
        it attends every position instead (as ``transformers``' mask does), which keeps its
        (never read) keys and values finite.

        Args:
          model: a :func:`supports_static_decode` causal LM.
          ids, attention, positions: ``[P, L]`` left-padded prompts, their padding mask and
            position ids.
          groups: ``[B]``, the prompt row of each batch row (rows sharing a prompt share its
            forward, as :func:`rlcore.models.shared_prefix.shares_prompts` finds them); None:
            one row per prompt.
        """
        base = unwrap_peft(model)
        inner = base.model
        rows, length = ids.shape
        valid = attention.bool()
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril_()
        mask = causal[None] & valid[:, None, :]  # [P, L(query), L(key)]
        mask |= ~mask.any(-1, keepdim=True)
        mask = mask[:, None]
        hidden = inner.embed_tokens(ids)  # [P, L, H]
        cos, sin = inner.rotary_emb(hidden, positions)  # [P, L, head_dim]
        cos, sin = cos[:, None], sin[:, None]
        cache = []
        for layer in inner.layers:
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (rows, length, -1, attn.head_dim)
            q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            q, k = _rotary(attn, q, k, cos, sin)
            out = attend_masked(q, k, v, mask, scale=attn.scaling)
            hidden = _mlp(layer, hidden + attn.o_proj(out.transpose(1, 2).reshape(rows, length, -1)))
            cache.append((k, v) if groups is None else (k.index_select(0, groups), v.index_select(0, groups)))
        logits = base.lm_head(inner.norm(hidden[:, -1]))
        if groups is not None:
            logits, attention = logits.index_select(0, groups), attention.index_select(0, groups)
        return cls(model, cache, attention), logits

    def _grow(self) -> None:
        """Room for more columns: the buffers are copied into ones twice as wide (at least ``_GROW`` more)."""
        more = max(_GROW, self.length)

        def wider(t: torch.Tensor, axis: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[axis] += more
            out = t.new_zeros(shape)
            out.narrow(axis, 0, self.length).copy_(t.narrow(axis, 0, self.length))
            return out

        self.keys = [wider(t, 2) for t in self.keys]
        self.values = [wider(t, 2) for t in self.values]
        self.valid = wider(self.valid, 1)
        self.rope = _rope_table(self.inner, self.valid.shape[1])

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (an index list), in that order."""
        self.keys = [t.index_select(0, rows) for t in self.keys]
        self.values = [t.index_select(0, rows) for t in self.values]
        self.valid = self.valid.index_select(0, rows)

    def __call__(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if self.length == self.valid.shape[1]:
            self._grow()
        at, end = self.length, self.length + 1
        self.valid[:, at] = True
        mask = self.valid[:, None, None, :end]
        inner = self.inner
        hidden = inner.embed_tokens(token)  # [B, H]
        if self.rope is not None:  # a row's position is at most the cache's length: inside the table
            cos, sin = self.rope[0][position], self.rope[1][position]  # [B, 1, head_dim]
        else:
            cos, sin = inner.rotary_emb(hidden, position)
        rows = token.shape[0]
        for layer, keys, values in zip(inner.layers, self.keys, self.values):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (rows, -1, attn.head_dim)
            q, k = _rotary(attn, attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), cos, sin)
            v = attn.v_proj(x).view(shape)
            keys[:, :, at] = k
            values[:, :, at] = v
            # One query per row: SDPA, not attend_masked (whose batched matmuls of one query
            # per row were slower here: 0.28 against 0.23 ms at 256 rows on the CPU).
            out = F.scaled_dot_product_attention(
                q[:, :, None], keys[:, :, :end], values[:, :, :end], attn_mask=mask, scale=attn.scaling, enable_gqa=True
            )
            hidden = _mlp(layer, hidden + attn.o_proj(out.reshape(rows, -1)))
        self.length = end
        return self.model.lm_head(inner.norm(hidden))
