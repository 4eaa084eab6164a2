"""Token-budget micro-batches, and the sequence packing primitives (re-exported from :mod:`rlcore.ops`).

A padded ``[B, T]`` batch spends compute on padding: with heavy-tailed response
lengths most of the rectangle is padding. Packing concatenates the real tokens into
one row of ``N`` tokens, with ``position_ids`` restarting at 0 for every sequence and
the sequence boundaries in ``cu_seqlens`` (int32, ``[B + 1]``, the flash-attention
varlen convention), so attention can keep the sequences apart.

:func:`pack` has to learn ``N`` to allocate the packed row, so it reads the per-row
lengths back to the host once (a deliberate, documented sync; packing is a data-
movement step, not part of a loss). :func:`unpack` and :func:`shift_labels` are
sync-free; they live in :mod:`rlcore.ops.packing` (the maths needs them) and are
re-exported here. :func:`pack_to_budget` plans micro-batches on host integers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rlcore._checks import check_choice, check_integer, check_ndim
from rlcore.dataflow.dispatch import PARTITION_METHODS, balanced_partition
from rlcore.ops.packing import Packed, pack, shift_labels, unpack

__all__ = ["Packed", "pack", "pack_to_budget", "shift_labels", "unpack"]


def _first_fit_decreasing(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def pack_to_budget(
    lengths: Sequence[int] | torch.Tensor, max_tokens: int, *, method: str = "kk", cp: int = 1
) -> list[list[int]]:
    """Group sequences into micro-batches of at most ``max_tokens`` tokens each, with balanced loads.

    Dynamic batch size for packed training (as verl's ``use_dynamic_bsz``): the number
    of micro-batches ``k`` starts at the lower bound ``ceil(sum / max_tokens)``; for
    each ``k`` the sequences are split into ``k`` load-balanced parts
    (:func:`rlcore.dataflow.balanced_partition`: Karmarkar-Karp or Graham's LPT),
    and the first ``k`` at which every part fits the budget is used. If none fits up
    to the count first-fit-decreasing needs (at most ``11/9 OPT + 6/9`` bins, Dósa
    2007), the first-fit-decreasing packing is returned. With context parallelism
    (``cp > 1``) ``max_tokens`` is the budget of each rank and a packed row is split
    over the ``cp`` ranks of its group (:func:`rlcore.models.shard_packed`: padded to
    ``2 * cp`` chunks, a rank holding two), so a row holds up to
    ``2 * cp * (max_tokens // 2)`` tokens and a sequence may be longer than
    ``max_tokens``. verl balances
    ``ceil(sum / max_tokens)`` partitions without checking the budget afterwards, so
    one of its micro-batches can exceed it; here every one fits.

    Args:
      lengths: ``[B]`` token counts (host ints or an integer tensor, read on the host:
        this is planning, not a kernel).
      max_tokens: the token budget per micro-batch.
      method: the balancing heuristic, ``"kk"`` or ``"lpt"``.
      cp: the context-parallel size (ranks sharing one packed row).

    Returns:
      A list of micro-batches, each a sorted list of sample indices; together they
      partition ``range(B)``.

    >>> pack_to_budget([5, 1, 4, 2, 3], max_tokens=8)
    [[0, 3], [1, 2, 4]]
    >>> pack_to_budget([14, 3, 9], max_tokens=8, cp=2)  # rows of up to 16 tokens, 8 per rank
    [[0], [1, 2]]
    """
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp: got {cp!r}, expected a positive int (the context-parallel size)")
    if cp > 1:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
            raise ValueError(
                f"max_tokens: got {max_tokens!r}, expected an int >= 2 with cp={cp} (each rank holds two chunks)"
            )
        return pack_to_budget(lengths, 2 * cp * (max_tokens // 2), method=method)
    if isinstance(lengths, torch.Tensor):
        check_ndim("lengths", lengths, 1)
        check_integer("lengths", lengths)
        lengths = lengths.tolist()  # sync-ok: planning runs on host ints
    lengths = [int(x) for x in lengths]
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens: got {max_tokens!r}, expected a positive int")
    for i, x in enumerate(lengths):
        if x < 0 or x > max_tokens:
            raise ValueError(
                f"lengths: got {x} at index {i}, expected token counts in [0, {max_tokens}] (max_tokens); "
                "a sequence longer than the budget fits no micro-batch"
            )
    check_choice("method", method, PARTITION_METHODS)
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan = _first_fit_decreasing(order, lengths, max_tokens)
    as_tensor = torch.tensor(lengths, dtype=torch.int64)
    for k in range(max(1, math.ceil(sum(lengths) / max_tokens)), len(plan) + 1):
        parts = [p.tolist() for p in balanced_partition(as_tensor, k, method=method)]
        if all(sum(lengths[i] for i in p) <= max_tokens for p in parts):
            plan = parts
            break
    return sorted((sorted(p) for p in plan if p), key=lambda p: p[0])
