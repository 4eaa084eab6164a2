"""Adapter: an HF transformers causal LM as a pure function over one packed row of tokens.

``apply, params = from_hf(model)`` gives ``apply(params, input_ids, *, position_ids,
cu_seqlens) -> hidden [N, H]`` (the last hidden states, after the final norm) through
``torch.func.functional_call``, and ``apply.output_weight(params)`` the output-
embedding matrix ``[V, H]`` for :func:`rlcore.ops.linear_logprobs`; the logits are
never built. Qwen2 and Llama (and other HF decoders with the same layout: a
``base_model_prefix`` backbone and a bias-free ``lm_head``) are supported.

The backbone runs as a parameter-free twin on the meta device whose configuration
selects rlcore's packed attention (``"rlcore_packed"``, registered with
transformers' ``AttentionInterface``), so the user's model object is left exactly as
it was, and no ``[N, N]`` mask is built. A Llama-family backbone (Llama, Qwen2, Qwen3,
Mistral with full attention) runs instead as rlcore's own packed decoder over the same
weights (:mod:`rlcore.models.packed_decoder`): the same arithmetic, without the twin's
per-call plumbing. transformers is imported on first use.

A model sharded with FSDP2 or DTensor tensor parallelism (``rlcore.train.parallelize``)
runs through its own modules instead, whose hooks gather the shards: the attention is
switched to the packed one for the duration of the call only, and ``params`` must be
the mapping ``from_hf`` returned (the modules' own, sharded parameters).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from rlcore._checks import check_integer, check_ndim, check_same_shape
from rlcore.models.attention import attend_packed, check_cu_seqlens
from rlcore.models.context_parallel import ContextParallelShard
from rlcore.models.llama_family import is_llama_family
from rlcore.models.lora import AdaptersOff, MergedWeights, adapters_disabled, base_view, is_lora
from rlcore.models.packed_decoder import decoder_hidden
from rlcore.models.shared_prefix import SharedPrefix

__all__ = ["ATTENTION_NAME", "HFCausalLM", "from_hf"]

ATTENTION_NAME = "rlcore_packed"
_PACKING_KWARG = "rlcore_packing"


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: ``[1, heads, N, D]`` in, ``[1, N, heads, D]`` out."""
    packing = kwargs.get(_PACKING_KWARG)
    if packing is None or query.shape[0] != 1:
        raise RuntimeError(f"the {ATTENTION_NAME!r} attention runs only inside rlcore.models.from_hf's apply")
    if sliding_window is not None:
        raise ValueError(f"sliding_window: got {sliding_window}, expected None (packed attention is full causal)")
    if dropout:
        raise ValueError(f"dropout: got {dropout}, expected 0.0 (packed attention applies no attention dropout)")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return _attend(packing, q, k, v, scale).unsqueeze(0), None


def _attend(packing: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The packing's attention of ``[N, heads, D]`` queries over ``[N, kv_heads, D]`` keys and values."""
    if isinstance(packing, (ContextParallelShard, SharedPrefix)):
        return packing.attend(q, k, v, scale=scale)
    cu_seqlens, max_seqlen, bounds = packing
    return attend_packed(q, k, v, cu_seqlens, max_seqlen, bounds, scale)


@functools.cache
def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _hf_attention)


def _is_dtensor(x: Any) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


@contextlib.contextmanager
def _packed_attention(config: Any) -> Iterator[None]:
    """The real modules of a sharded model run the packed attention for one call, then their own again."""
    before = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = before


def _weight(params: Mapping[str, torch.Tensor], backbone: nn.Module, prefix: str, name: str) -> torch.Tensor | None:
    """Backbone weight ``name``: from ``params`` (under the model's ``prefix``), else the backbone's own; None if neither."""
    full = prefix + name
    if full in params:
        return params[full]
    try:
        return backbone.get_parameter(name)
    except AttributeError:  # no such weight (a projection without a bias)
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class HFCausalLM:
    """``apply(params, input_ids, *, position_ids, cu_seqlens, max_seqlen=None) -> hidden [N, H]``.

    Made by :func:`from_hf`. ``params`` maps the model's parameter names (as in
    ``model.named_parameters()``) to tensors; names it omits take the model's own
    tensors. ``output_weight(params)`` is the output-embedding matrix ``[V, H]``.
    """

    model: nn.Module
    prefix: str
    output_weight_name: str
    twin: nn.Module
    # Sharded models (FSDP2 / tensor parallel): the parameters from_hf handed out, else None.
    sharded: Mapping[str, torch.Tensor] | None = None
    # A sharded LoRA model run with its adapters off (the reference policy, AdaptersOff), else None.
    adapters_off: Any = None
    # A Llama-family backbone runs as rlcore's own packed decoder (rlcore.models.packed_decoder), not the twin.
    native: bool = False

    def __call__(
        self,
        params: Mapping[str, torch.Tensor],
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        context_parallel: ContextParallelShard | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """Last hidden states ``[N, H]`` of the packed row ``input_ids`` ``[N]``.

        Args:
          params: parameter name -> tensor (a subset is fine).
          input_ids: ``[N]`` token ids of the packed sequences.
          position_ids: ``[N]`` position of each token within its sequence.
          cu_seqlens: ``[B + 1]`` integer sequence boundaries, from 0 to ``N``.
          max_seqlen: the longest sequence (used by the CUDA kernel).
          context_parallel: this rank's shard of a row split over a context-parallel
            group (:func:`rlcore.models.shard_packed`); then ``input_ids`` and
            ``position_ids`` are the shard's ``[2L]`` tokens, ``cu_seqlens`` its padded
            row's, and the result is the shard's ``[2L, H]`` (a collective over the group).
          shared_prefix: a shared-prompt layout (:mod:`rlcore.models.shared_prefix`)
            instead of ``cu_seqlens``: who attends to whom within each prompt's group.
        """
        check_ndim("input_ids", input_ids, 1)
        check_integer("input_ids", input_ids)
        check_same_shape("position_ids", position_ids, "input_ids", input_ids)
        check_integer("position_ids", position_ids)
        if shared_prefix is not None:
            if self.sharded is not None:
                return self._sharded_call(params, input_ids, position_ids, shared_prefix)
            return self._forward(params, input_ids, position_ids, shared_prefix)
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: got None, expected [B + 1] sequence boundaries (or a shared_prefix layout)")
        if context_parallel is not None:
            n = context_parallel.shards.local_len
            if input_ids.shape[0] != n:
                raise ValueError(f"input_ids: got {input_ids.shape[0]} tokens, expected the shard's {n}")
            check_cu_seqlens(cu_seqlens, context_parallel.shards.padded_len)
            if self.sharded is not None:
                return self._sharded_call(params, input_ids, position_ids, context_parallel)
            return self._forward(params, input_ids, position_ids, context_parallel)
        bounds = check_cu_seqlens(cu_seqlens, input_ids.shape[0])
        if self.sharded is not None:
            if max_seqlen is None and bounds is not None:
                max_seqlen = max(b - a for a, b in zip(bounds, bounds[1:]))
            return self._sharded_call(params, input_ids, position_ids, (cu_seqlens, max_seqlen, bounds))
        if input_ids.shape[0] == 0:
            # HF layers reshape with -1, which an empty row cannot satisfy.
            weight = self.output_weight(params)
            return weight.new_zeros(0, weight.shape[1])
        if max_seqlen is None and bounds is not None:
            max_seqlen = max(b - a for a, b in zip(bounds, bounds[1:]))
        return self._forward(params, input_ids, position_ids, (cu_seqlens, max_seqlen, bounds))

    def _forward(
        self, params: Mapping[str, torch.Tensor], input_ids: torch.Tensor, position_ids: torch.Tensor, packing: Any
    ) -> torch.Tensor:
        backbone = self.model.get_submodule(self.prefix)
        if self.native:
            return decoder_hidden(
                backbone,
                functools.partial(_weight, params, backbone, self.prefix + "."),
                input_ids,
                position_ids,
                functools.partial(_attend, packing),
            )
        tensors: dict[str, torch.Tensor] = dict(backbone.named_parameters())
        tensors.update(backbone.named_buffers())
        cut = len(self.prefix) + 1
        tensors.update({k[cut:]: v for k, v in params.items() if k.startswith(self.prefix + ".")})
        kwargs = {
            "input_ids": input_ids.unsqueeze(0),
            "position_ids": position_ids.unsqueeze(0),
            "use_cache": False,
            _PACKING_KWARG: packing,
        }
        out = torch.func.functional_call(self.twin, tensors, (), kwargs)
        return out.last_hidden_state[0]

    def _sharded_call(
        self,
        params: Mapping[str, torch.Tensor],
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        packing: Any,
    ) -> torch.Tensor:
        # FSDP gathers a unit's shards in its forward hook, which a twin would bypass, and
        # ignores tensors swapped in by functional_call: only the model's own weights can run.
        assert self.sharded is not None
        foreign = [k for k, v in params.items() if self.sharded.get(k) is not v]
        if foreign:
            raise ValueError(
                f"params: got tensors for {foreign[:3]} that are not the sharded model's own; a sharded model "
                "runs with the parameters from_hf returned (shard a second model for other weights)"
            )
        if input_ids.shape[0] == 0:
            raise ValueError(
                "input_ids: got 0 tokens, expected at least 1 (a sharded model's forward is collective: "
                "every rank runs it)"
            )
        # The root module runs (FSDP's root unit gathers the embeddings and the output
        # embedding in its hook); the backbone's output is caught on the way and no logit is
        # computed (an empty logits_to_keep).
        caught: list[torch.Tensor] = []
        backbone = self.model.get_submodule(self.prefix)
        hook = backbone.register_forward_hook(lambda module, args, out: caught.append(out.last_hidden_state))
        off = adapters_disabled(self.adapters_off) if self.adapters_off is not None else contextlib.nullcontext()
        try:
            with _packed_attention(backbone.config), off:
                self.model(
                    input_ids=input_ids.unsqueeze(0),
                    position_ids=position_ids.unsqueeze(0),
                    use_cache=False,
                    logits_to_keep=input_ids.new_zeros(0),
                    **{_PACKING_KWARG: packing},
                )
        finally:
            hook.remove()
        return caught[0][0]

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding: token ids and labels must lie in ``[0, vocab_size)`` (a DTensor's global shape)."""
        return int(self.model.get_parameter(self.output_weight_name).shape[0])

    def output_weight(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The output-embedding (``lm_head``) weight ``[V, H]`` from ``params`` (or the model's own)."""
        if self.sharded is not None:
            # FSDP's root unit stays gathered from its forward to the backward, so after
            # ``apply`` the module holds the whole weight.
            weight = self.model.get_parameter(self.output_weight_name)
            if _is_dtensor(weight):
                raise RuntimeError(
                    "output_weight: the sharded model's output embedding is not gathered; call apply(...) first"
                )
            return weight
        if self.output_weight_name in params:
            return params[self.output_weight_name]
        return self.model.get_parameter(self.output_weight_name)


def from_hf(model: nn.Module) -> tuple[HFCausalLM, Mapping[str, torch.Tensor]]:
    """Wrap an HF causal LM as ``(apply, params)`` for packed, padding-free forward passes.

    The model is not modified. ``params`` is ``dict(model.named_parameters())`` (tied
    embeddings appear once, under the input-embedding name); pass it, or any updated
    copy, to ``apply``. The pure-function form of ``torch.func.functional_call``.
    A LoRA model (``peft.PeftModel``) gives the base architecture's ``apply`` and
    :class:`rlcore.models.MergedWeights` as ``params``: each forward runs on the merged
    weights as the adapters are now, and its gradients reach the adapters. Sharded with
    FSDP2, it runs through its own modules (peft's adapted layers, FSDP's hooks) and
    ``params`` are its parameters, adapters included. An :class:`rlcore.models.AdaptersOff`
    runs the base model: on :func:`rlcore.models.base_view`, or sharded, on the same
    modules with the adapters switched off for the call.

    Args:
      model: a transformers ``*ForCausalLM`` (Qwen2, Llama, ...), a ``peft.PeftModel``
        around one, or an :class:`rlcore.models.AdaptersOff`.

    Returns:
      ``(apply, params)``; ``apply.output_weight(params)`` is the ``[V, H]`` output embedding.
    """
    _register_attention()
    if isinstance(model, AdaptersOff):
        lora: Any = model.lora
        if not any(_is_dtensor(p) for p in lora.parameters()):
            return from_hf(base_view(lora))
        apply, params = from_hf(lora.get_base_model())
        return dataclasses.replace(apply, adapters_off=lora), params
    if is_lora(model):
        if any(_is_dtensor(p) for p in model.parameters()):  # FSDP's hooks gather the shards: the real modules run
            return from_hf(cast(Any, model).get_base_model())
        return from_hf(base_view(model))[0], MergedWeights(model)
    prefix = getattr(model, "base_model_prefix", "")
    if not isinstance(model, nn.Module) or not prefix or not hasattr(model, prefix):
        raise ValueError(
            f"model: got {type(model).__name__}, expected a transformers causal LM with a base_model_prefix backbone"
        )
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if get_output_embeddings is not None else None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"model: got output embeddings {head!r}, expected a bias-free nn.Linear lm_head")
    names = {id(p): n for n, p in model.named_parameters()}
    if id(head.weight) not in names:
        raise ValueError("model: its output-embedding weight is not one of model.named_parameters()")
    backbone = model.get_submodule(prefix)
    params = dict(model.named_parameters())
    if any(_is_dtensor(p) for p in params.values()):
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in model.modules()) and not isinstance(model, FSDPModule):
            raise ValueError(
                f"model: sharded with FSDP2, but {type(model).__name__} itself is not an FSDP unit; make the "
                "whole model the root unit with fully_shard(model) (rlcore.train.parallelize does)"
            )
        return HFCausalLM(model, prefix, names[id(head.weight)], backbone, sharded=params), params
    config = copy.deepcopy(backbone.config)
    config._attn_implementation = ATTENTION_NAME
    with torch.device("meta"):
        twin = type(backbone)(config)
    # RL post-training runs without dropout; eval mode also keeps HF from asking for it.
    twin.eval()
    apply = HFCausalLM(
        model=model,
        prefix=prefix,
        output_weight_name=names[id(head.weight)],
        twin=twin,
        native=prefix == "model" and is_llama_family(model),
    )
    return apply, params
