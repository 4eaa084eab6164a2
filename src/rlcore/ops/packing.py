"""Sequence packing: padded or ragged batches to one row of tokens and back.

A padded ``[B, T]`` batch spends compute on padding: with heavy-tailed response
lengths most of the rectangle is padding. Packing concatenates the real tokens into
one row of ``N`` tokens, with ``position_ids`` restarting at 0 for every sequence and
the sequence boundaries in ``cu_seqlens`` (int32, ``[B + 1]``, the flash-attention
varlen convention), so attention can keep the sequences apart.

:func:`pack` has to learn ``N`` to allocate the packed row, so it reads the per-row
lengths back to the host once (a deliberate, documented sync; packing is a data-
movement step, not part of a loss). :func:`unpack` and :func:`shift_labels` are
sync-free. Token-budgeted micro-batch planning (``pack_to_budget``) lives in
:mod:`rlcore.dataflow`, which also re-exports these names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlcore._checks import check_integer, check_ndim, check_same_shape, check_tensor
from rlcore.pytree import dataclass, static_field

__all__ = ["Packed", "pack", "shift_labels", "unpack"]


@dataclass
class Packed:
    """A packed batch: ``N`` real tokens of ``B`` sequences in one row.

    Attributes:
      input_ids: ``[N]`` int64 token ids, sequence after sequence.
      position_ids: ``[N]`` int64 position of each token within its sequence (0, 1, ...).
      cu_seqlens: ``[B + 1]`` int32 sequence boundaries: sequence ``b`` is
        ``input_ids[cu_seqlens[b]:cu_seqlens[b + 1]]``; ``cu_seqlens[-1] == N``.
      indices: ``[N]`` int64 flat index of each token in the ``[B, T]`` padded layout.
      max_seqlen: the longest sequence (a host int, static).
      padded_shape: ``(B, T)`` of the padded layout :func:`unpack` restores (static).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    indices: torch.Tensor
    max_seqlen: int = static_field()
    padded_shape: tuple[int, int] = static_field()


def _from_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    check_ndim("input_ids", input_ids, 2)
    check_integer("input_ids", input_ids)
    check_same_shape("attention_mask", attention_mask, "input_ids", input_ids)
    mask = attention_mask != 0
    b, t = input_ids.shape
    lengths = mask.sum(1)
    # sync-ok: the packed length N sizes the output, so it must reach the host once.
    indices = mask.reshape(-1).nonzero().squeeze(1)
    positions = (mask.cumsum(1) - 1).reshape(-1)[indices]
    cu = torch.zeros(b + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = lengths.cumsum(0)
    max_seqlen = int(lengths.max()) if b else 0  # sync-ok: a host int for the attention kernels
    return Packed(
        input_ids=input_ids.reshape(-1)[indices].long(),
        position_ids=positions,
        cu_seqlens=cu,
        indices=indices,
        max_seqlen=max_seqlen,
        padded_shape=(b, t),
    )


def _from_ragged(seqs: Sequence[torch.Tensor]) -> Packed:
    for i, s in enumerate(seqs):
        check_ndim(f"batch[{i}]", s, 1)
        check_integer(f"batch[{i}]", s)
    lengths = [s.shape[0] for s in seqs]
    device = seqs[0].device
    b, t = len(seqs), max(lengths)
    len_t = torch.tensor(lengths, device=device)
    rows = torch.repeat_interleave(torch.arange(b, device=device), len_t, output_size=sum(lengths))
    starts = torch.repeat_interleave(len_t.cumsum(0) - len_t, len_t, output_size=sum(lengths))
    positions = torch.arange(sum(lengths), device=device) - starts
    cu = torch.zeros(b + 1, dtype=torch.int32, device=device)
    cu[1:] = len_t.cumsum(0)
    return Packed(
        input_ids=torch.cat([s.long() for s in seqs]),
        position_ids=positions,
        cu_seqlens=cu,
        indices=rows * t + positions,
        max_seqlen=t,
        padded_shape=(b, t),
    )


def pack(batch: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> Packed:
    """Pack a padded or ragged batch of token sequences into one row of ``N`` tokens.

    The padding-free layout of flash-attention's ``unpad_input`` (Dao, arXiv:2307.08691)
    and verl's ``use_remove_padding``: token ``i`` of the row belongs to sequence
    ``b`` when ``cu_seqlens[b] <= i < cu_seqlens[b + 1]``, and its position is its
    rank among the real tokens of that sequence (as HF computes ``position_ids``
    from ``attention_mask``).

    Args:
      batch: either a mapping with ``"input_ids"`` ``[B, T]`` and ``"attention_mask"``
        ``[B, T]`` (1 = real token; the model-input mask, left and/or right padded),
        or a sequence of ``B`` 1-D token-id tensors (ragged).

    Returns:
      A :class:`Packed` (an rlcore pytree container).

    >>> p = pack({"input_ids": torch.tensor([[5, 6, 7], [8, 0, 0]]),
    ...           "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])})
    >>> p.input_ids, p.position_ids, p.cu_seqlens, p.max_seqlen
    (tensor([5, 6, 7, 8]), tensor([0, 1, 2, 0]), tensor([0, 3, 4], dtype=torch.int32), 3)
    """
    if isinstance(batch, Mapping):
        for key in ("input_ids", "attention_mask"):
            if key not in batch:
                raise ValueError(f"batch: got keys {sorted(batch)}, expected 'input_ids' and 'attention_mask'")
        return _from_padded(batch["input_ids"], batch["attention_mask"])
    if isinstance(batch, torch.Tensor) or not isinstance(batch, Sequence) or len(batch) == 0:
        raise ValueError(
            f"batch: got {type(batch).__name__}, expected a mapping with 'input_ids' and 'attention_mask' "
            "or a non-empty sequence of 1-D token tensors"
        )
    return _from_ragged(batch)


def _check_packed(packed: Any) -> None:
    if not isinstance(packed, Packed):
        raise ValueError(f"packed: got {type(packed).__name__}, expected an rlcore.ops.Packed (from pack)")


def unpack(values: torch.Tensor, packed: Packed, *, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-token values ``[N, ...]`` back to the padded layout ``[B, T, ...]``.

    Padding positions get ``fill``. Differentiable in ``values``; no host sync.

    Args:
      values: ``[N, ...]``, one row per packed token.
      packed: the :class:`Packed` the tokens came from.
      fill: value at padding positions.

    Returns:
      ``[B, T, ...]`` in ``values.dtype``.

    >>> p = pack([torch.tensor([5, 6]), torch.tensor([7])])
    >>> unpack(torch.tensor([1.0, 2.0, 3.0]), p)
    tensor([[1., 2.],
            [3., 0.]])
    """
    _check_packed(packed)
    check_tensor("values", values)
    n = packed.input_ids.shape[0]
    if values.dim() == 0 or values.shape[0] != n:
        raise ValueError(f"values: got shape {tuple(values.shape)}, expected ({n}, ...) (one row per packed token)")
    b, t = packed.padded_shape
    out = values.new_full((b * t, *values.shape[1:]), fill)
    return out.index_copy(0, packed.indices, values).reshape(b, t, *values.shape[1:])


def shift_labels(packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token labels in the packed row, never crossing a sequence boundary.

    ``labels[i] = input_ids[i + 1]`` when token ``i + 1`` belongs to the same
    sequence; the last token of every sequence has no next token: its label is 0
    (a valid id, so kernels can gather it) and its mask is False. A plain
    ``roll``/shift of the packed row would instead teach each sequence's last token
    to predict the next sequence's first.

    Returns:
      ``(labels [N] int64, mask [N] bool)``.

    >>> shift_labels(pack([torch.tensor([5, 6, 7]), torch.tensor([8, 9])]))
    (tensor([6, 7, 0, 9, 0]), tensor([ True,  True, False,  True, False]))
    """
    _check_packed(packed)
    ids = packed.input_ids
    n = ids.shape[0]
    if n == 0:
        return ids.clone(), torch.zeros(0, dtype=torch.bool, device=ids.device)
    # cu_seqlens[b + 1] - 1 is the last token of sequence b; for an empty sequence it is
    # the last token of an earlier one (or -1 = N - 1, the very last), a last token anyway.
    last = (packed.cu_seqlens[1:].long() - 1).remainder(n)
    is_last = torch.zeros(n, dtype=torch.bool, device=ids.device).index_fill(0, last, True)
    labels = torch.where(is_last, 0, torch.roll(ids, -1))
    return labels, ~is_last
