"""The one call a trainer makes for token log-probs: pack, forward, fused log-probs, unpack."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import torch

from rlcore.ops import Packed, pack, shift_labels, unpack
from rlcore.ops.linear_logprobs import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE, linear_logprobs

__all__ = ["token_logprobs"]


def packed_hidden(apply: Callable[..., torch.Tensor], params: Any, packed: Packed) -> torch.Tensor:
    """The last hidden states ``[N, H]`` of a packed row (:func:`rlcore.ops.pack`), sequences kept apart."""
    return apply(
        params,
        packed.input_ids,
        position_ids=packed.position_ids,
        cu_seqlens=packed.cu_seqlens,
        max_seqlen=packed.max_seqlen,
    )


@overload
def token_logprobs(
    apply: Callable[..., torch.Tensor],
    params: Any,
    batch: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    *,
    temperature: float = ...,
    chunk_size: int = ...,
    vocab_chunk_size: int = ...,
    with_entropy: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def token_logprobs(
    apply: Callable[..., torch.Tensor],
    params: Any,
    batch: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    *,
    temperature: float = ...,
    chunk_size: int = ...,
    vocab_chunk_size: int = ...,
    with_entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def token_logprobs(
    apply: Callable[..., torch.Tensor],
    params: Any,
    batch: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    *,
    temperature: float = ...,
    chunk_size: int = ...,
    vocab_chunk_size: int = ...,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


def token_logprobs(
    apply: Callable[..., torch.Tensor],
    params: Any,
    batch: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Log-prob of every token given its prefix, from one padding-free forward pass.

    The per-token log-likelihood ``log pi(x_t | x_<t)`` of PPO-style RL post-training
    (Ouyang et al., arXiv:2203.02155; Schulman et al., arXiv:1707.06347), computed the
    padding-free way (verl's ``use_remove_padding``): the batch is packed into one row
    (:func:`rlcore.ops.pack`), run through ``apply`` with packed attention, and the
    last hidden states go straight into :func:`rlcore.ops.linear_logprobs` with
    next-token labels that never cross a sequence boundary; the result is scattered
    back to the padded layout.

        logp[b, t] = log softmax(h[b, t-1] @ W.T / T)[x[b, t]]   (0 at each sequence's first token)

    Args:
      apply: ``apply(params, input_ids, *, position_ids, cu_seqlens, max_seqlen) ->
        hidden [N, H]`` with an ``output_weight(params) -> [V, H]`` method, e.g. from
        :func:`rlcore.models.from_hf`.
      params: the parameters ``apply`` takes.
      batch: ``{"input_ids": [B, T], "attention_mask": [B, T]}`` (padded on either
        side) or a sequence of ``B`` 1-D token tensors (then ``T`` is the longest).
      temperature: sampling temperature ``T``.
      chunk_size: tokens per block of the fused log-prob kernel.
      vocab_chunk_size: vocabulary entries per block.
      with_entropy: also return the entropy of each token's predictive distribution.
      with_sum_pi_squared: also return ``sum_v pi(v)^2`` of each token's predictive
        distribution (no gradient; :func:`rlcore.ops.linear_logprobs`).

    Returns:
      ``logp [B, T]`` (or ``(logp, entropy?, sum_pi_squared?)`` when an option is on), aligned with the tokens they score: 0 at
      the first real token of each sequence and at padding. Differentiable in ``params``.
    """
    output_weight = getattr(apply, "output_weight", None)
    if not callable(output_weight):
        raise ValueError(
            f"apply: got {type(apply).__name__} without an output_weight(params) method, "
            "expected a model function such as rlcore.models.from_hf(model)[0]"
        )
    packed = pack(batch)
    hidden = packed_hidden(apply, params, packed)
    labels, _ = shift_labels(packed)
    out = linear_logprobs(
        hidden,
        output_weight(params),
        labels,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        with_entropy=with_entropy,
        with_sum_pi_squared=with_sum_pi_squared,
    )
    # Position i predicts token i + 1: move each value onto the token it scores. The
    # value rolled onto a sequence's first token came from the previous sequence's
    # last (label-less) position and is dropped.
    first = packed.position_ids == 0
    aligned = [
        unpack(torch.where(first, 0.0, torch.roll(v, 1)), packed) for v in (out if isinstance(out, tuple) else (out,))
    ]
    return tuple(aligned) if with_entropy or with_sum_pi_squared else aligned[0]
