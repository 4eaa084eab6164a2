"""Context parallelism for packed rows: one rank's shard of the tokens, its attention, its scores.

A packed row (:func:`rlcore.dataflow.pack`) too long for one device is split over
the ``cp`` ranks of a context-parallel group with the load-balanced split of
:func:`rlcore.models.plan_sequence_shards`. :func:`shard_packed` gives this rank's
:class:`ContextParallelShard`: its token ids and positions, the next-token labels
of its rows (the shift done on the whole row, so a label may be the first token of
another rank's chunk), and the attention that joins the shards (``"ring"`` or
``"ulysses"``). A model adapter runs on the shard only (``from_hf``'s ``apply``
takes it as ``context_parallel=``); the log-probs and entropies are computed by
the chunked / fused kernels on the rank's ``2L`` rows, never on the whole row.

:func:`sharded_token_logprobs` is the one call: the ``[B, T]`` log-probs of the
tokens this rank scores (zero elsewhere) and the mask of those tokens. Summed over
the group they equal :func:`rlcore.models.token_logprobs`; a loss aggregated over the
local mask with the batch's global counts (:func:`rlcore.algos.global_counts` of the
whole batch mask, over the data-parallel group) adds up over the group, so the
gradients summed over ``cp`` (and ``dp``) ranks are those of the whole batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rlcore._checks import check_choice
from rlcore._process_group import as_process_group
from rlcore.models.ring_attention import ring_attention
from rlcore.models.sequence_shards import SequenceShards, plan_sequence_shards
from rlcore.models.ulysses import ulysses_attention
from rlcore.ops import Packed, pack, shift_labels
from rlcore.ops.linear_logprobs import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE, linear_logprobs

__all__ = [
    "CP_MODES",
    "ContextParallelShard",
    "ShardedLogprobs",
    "shard_packed",
    "sharded_token_logprobs",
]

CP_MODES = ("ring", "ulysses")


@dataclasses.dataclass(frozen=True, eq=False)
class ContextParallelShard:
    """This rank's shard of a packed row: ``2L`` tokens, their labels, and the attention over the group.

    Made by :func:`shard_packed`. Row ``i`` of every per-token tensor is the token at
    padded-row position ``shards.positions[i]``.

    Attributes:
      shards: the split plan (:class:`rlcore.models.SequenceShards`).
      group: the context-parallel ``ProcessGroup``.
      mode: ``"ring"`` or ``"ulysses"``.
      input_ids: ``[2L]`` int64 token ids (0 for padding).
      position_ids: ``[2L]`` int64 positions within each sequence (0 for padding).
      labels: ``[2L]`` int64 next-token labels (0 where ``label_mask`` is False).
      label_mask: ``[2L]`` bool, True where the row's next token is in the same sequence.
      targets: ``[2L]`` int64 flat index, in the padded ``[B, T]`` layout, of the token
        each row's label is (0 where ``label_mask`` is False).
      padded_shape: ``(B, T)`` of the batch the row was packed from.
    """

    shards: SequenceShards
    group: Any
    mode: str
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    targets: torch.Tensor
    padded_shape: tuple[int, int]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[B' + 1]`` int32 boundaries of the padded row, on the tokens' device."""
        return self.shards.cu_seqlens.to(self.input_ids.device)

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float | None = None
    ) -> torch.Tensor:
        """Causal packed attention of this rank's ``[2L, H, D]`` rows over the whole row (a collective)."""
        fn = ring_attention if self.mode == "ring" else ulysses_attention
        return fn(query, key, value, self.shards, self.group, scale=scale)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row values ``[2L]`` to ``[B, T]`` at the token each row scores; 0 at every other token.

        Differentiable in ``values``; rows without a label contribute nothing.
        """
        if values.shape != self.labels.shape:
            raise ValueError(f"values: got shape {tuple(values.shape)}, expected {tuple(self.labels.shape)}")
        b, t = self.padded_shape
        kept = torch.where(self.label_mask, values, 0.0)
        return kept.new_zeros(b * t).index_add(0, self.targets, kept).reshape(b, t)

    @property
    def mask(self) -> torch.Tensor:
        """``[B, T]`` bool: the tokens this rank scores. Disjoint over the group; their union is every scored token."""
        b, t = self.padded_shape
        hits = torch.zeros(b * t, dtype=torch.int32, device=self.targets.device)
        return hits.index_add(0, self.targets, self.label_mask.int()).reshape(b, t) > 0


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(n)]) if n else x


def shard_packed(packed: Packed, group: Any, *, mode: str = "ring") -> ContextParallelShard:
    """This rank's :class:`ContextParallelShard` of a packed row, for context-parallel forward passes.

    Every rank of ``group`` calls it with the same packed row (token ids are cheap to
    replicate; activations are what context parallelism splits). The row is padded to
    ``2 * cp * L`` tokens with one padding sequence and split load-balanced
    (:func:`rlcore.models.plan_sequence_shards`). Labels are shifted on the whole row
    first, so the label of a chunk's last token is the first token of the next chunk,
    wherever it lives, and never crosses a sequence boundary.

    Args:
      packed: a :class:`rlcore.dataflow.Packed` row with at least one token.
      group: the context-parallel ``ProcessGroup`` or 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]``).
      mode: ``"ring"`` (ring attention, any head count) or ``"ulysses"`` (all-to-all;
        query and key/value heads must divide by ``cp``).

    Returns:
      A :class:`ContextParallelShard` (reads ``cu_seqlens`` on the host once: planning).
    """
    if not isinstance(packed, Packed):
        raise ValueError(f"packed: got {type(packed).__name__}, expected an rlcore.dataflow.Packed (from pack)")
    check_choice("mode", mode, CP_MODES)
    pg = as_process_group("group", group)
    shards = plan_sequence_shards(packed.cu_seqlens, world=dist.get_world_size(pg), rank=dist.get_rank(pg))
    device = packed.input_ids.device
    pad = shards.padded_len - shards.num_tokens
    pos = shards.positions.to(device)
    labels, label_mask = shift_labels(packed)
    targets = torch.cat([packed.indices[1:], packed.indices.new_zeros(1)])
    label_mask = _pad(label_mask, pad).index_select(0, pos)
    return ContextParallelShard(
        shards=shards,
        group=pg,
        mode=mode,
        input_ids=_pad(packed.input_ids, pad).index_select(0, pos),
        position_ids=_pad(packed.position_ids, pad).index_select(0, pos),
        labels=_pad(labels, pad).index_select(0, pos),
        label_mask=label_mask,
        targets=torch.where(label_mask, _pad(targets, pad).index_select(0, pos), 0),
        padded_shape=packed.padded_shape,
    )


def _batch_device(batch: Any) -> torch.device:
    """The device of the batch's token ids (the CPU when it holds none)."""
    if isinstance(batch, Packed):
        return batch.input_ids.device
    first: Any = None
    if isinstance(batch, Mapping):
        first = batch.get("input_ids")
    elif isinstance(batch, Sequence) and len(batch) > 0:
        first = batch[0]
    return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")


def _fingerprint(packed: Packed, options: tuple[Any, ...]) -> int:
    """A 63-bit digest of the row's layout (boundaries, padded shape) and the call's options."""
    bounds = [int(b) for b in packed.cu_seqlens.tolist()]  # sync-ok: planning reads them on the host anyway
    text = repr((bounds, tuple(packed.padded_shape), tuple(packed.indices.shape), options))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _check_ranks_agree(
    packed: Packed | None,
    group: Any,
    *,
    vocab_size: int | None = None,
    options: tuple[Any, ...] = (),
    local: Exception | None = None,
    device: torch.device | None = None,
) -> None:
    """Every rank of a context-parallel group checks that all hold the same valid row before any collective runs.

    One all-gather of five int64 per rank: a digest of the row's layout and ``options``,
    a checksum of its token ids, their smallest and largest id, and whether this rank's
    own checks passed (``local`` is ``None``). Then every rank raises the same
    ``ValueError`` when the ranks disagree, any id is outside ``[0, vocab_size)``, or a
    rank rejected its input (that rank raises its own ``local`` error) — so no rank is
    left waiting in the ring or the all-to-all for a peer that has already failed.

    Args:
      packed: this rank's packed row, or ``None`` when building it failed (``local`` set).
      group: the context-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``.
      vocab_size: the model's vocabulary size, or ``None`` to skip the id range check.
      options: anything else every rank must call with (mode, temperature, chunk sizes).
      local: the error this rank's own checks raised, if any.
      device: where the all-gather runs when ``packed`` is ``None`` (the batch's device).
    """
    pg = as_process_group("group", group)
    if packed is not None:
        ids = packed.input_ids.long()
        device = ids.device
        weights = torch.arange(1, ids.numel() + 1, device=device, dtype=torch.int64)
        nonempty = ids.numel() > 0
        lo = ids.min() if nonempty else torch.zeros((), dtype=torch.int64, device=device)
        hi = ids.max() if nonempty else torch.zeros((), dtype=torch.int64, device=device)
        head = torch.tensor([_fingerprint(packed, options)], dtype=torch.int64, device=device)
        mine = torch.cat([head, torch.stack([(ids * weights).sum(), lo, hi]), head.new_ones(1) * (local is None)])
    else:
        mine = torch.tensor([-1, 0, 0, 0, 0], dtype=torch.int64, device=device)
    seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(seen, mine, group=pg)
    table = torch.stack(seen).cpu().tolist()  # sync-ok: five ints per rank, once per forward
    if local is not None:
        raise local
    bad = [r for r, row in enumerate(table) if not row[4]]
    if bad:
        raise ValueError(
            f"batch: rank(s) {bad} of the context-parallel group rejected their input (see their error), "
            "expected every rank to hold the same valid batch; nothing was run"
        )
    odd = next((r for r, row in enumerate(table) if row[:2] != table[0][:2]), None)
    if odd is not None:
        raise ValueError(
            f"batch: the context-parallel ranks hold different batches or options (rank {odd} differs from rank 0), "
            "expected every rank of the group to call with the same batch, mode, temperature and chunk sizes; "
            "nothing was run"
        )
    lo, hi = table[0][2], table[0][3]
    if vocab_size is not None and (lo < 0 or hi >= vocab_size):
        raise ValueError(
            f"input_ids: got token ids in [{lo}, {hi}], expected ids in [0, {vocab_size}) (the model's "
            "vocabulary); nothing was run"
        )


class ShardedLogprobs(NamedTuple):
    """What :func:`sharded_token_logprobs` returns: this rank's part of the ``[B, T]`` scores."""

    logp: torch.Tensor
    """``[B, T]`` log-probs of the tokens this rank scores, 0 elsewhere."""
    entropy: torch.Tensor | None
    """``[B, T]`` entropies at the same tokens (``None`` unless asked for)."""
    mask: torch.Tensor
    """``[B, T]`` bool, the tokens this rank scores."""


def sharded_token_logprobs(
    apply: Callable[..., torch.Tensor],
    params: Any,
    batch: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | Packed,
    *,
    group: Any,
    mode: str = "ring",
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
    with_entropy: bool = False,
) -> ShardedLogprobs:
    """:func:`rlcore.models.token_logprobs` with the packed row split over a context-parallel group.

    Ring attention (Liu et al., arXiv:2310.01889) or Ulysses (arXiv:2309.14509) joins
    the shards inside the model; the fused kernel (:func:`rlcore.ops.linear_logprobs`)
    scores this rank's ``2L`` rows only, so neither the activations nor the logits of
    the whole row exist on any rank. Every rank of ``group`` calls it with the same
    batch; summed over the group, ``logp`` and ``entropy`` equal ``token_logprobs``'s,
    and the ``mask``s partition the scored tokens.

    Args:
      apply: a model function taking ``context_parallel=`` (``rlcore.models.from_hf(model)[0]``).
      params: the parameters ``apply`` takes (replicated over ``group``).
      batch: as for ``token_logprobs`` (padded mapping or ragged sequence), or a
        :class:`rlcore.dataflow.Packed` row.
      group: the context-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``.
      mode: ``"ring"`` or ``"ulysses"``.
      temperature: sampling temperature.
      chunk_size: tokens per block of the fused kernel.
      vocab_chunk_size: vocabulary entries per block.
      with_entropy: also return the entropies.

    Returns:
      A :class:`ShardedLogprobs` ``(logp [B, T], entropy [B, T] or None, mask [B, T])``.

    Before any rank enters the attention's collectives, the ranks compare their batches,
    options and input checks (one small all-gather), so a
    token id outside the vocabulary (``apply.vocab_size``) or ranks given different
    batches raise the same ``ValueError`` on every rank instead of leaving the peers
    waiting in the ring until the process-group timeout.
    """
    output_weight = getattr(apply, "output_weight", None)
    if not callable(output_weight):
        raise ValueError(
            f"apply: got {type(apply).__name__} without an output_weight(params) method, "
            "expected a model function such as rlcore.models.from_hf(model)[0]"
        )
    pg = as_process_group("group", group)
    local: Exception | None = None
    packed: Packed | None = None
    shard: ContextParallelShard | None = None
    try:
        packed = batch if isinstance(batch, Packed) else pack(batch)
        shard = shard_packed(packed, pg, mode=mode)
    except ValueError as err:
        local = err
    options = (mode, temperature, chunk_size, vocab_chunk_size, with_entropy)
    _check_ranks_agree(
        packed,
        pg,
        vocab_size=getattr(apply, "vocab_size", None),
        options=options,
        local=local,
        device=_batch_device(batch),
    )
    assert packed is not None and shard is not None
    hidden = apply(
        params,
        shard.input_ids,
        position_ids=shard.position_ids,
        cu_seqlens=shard.cu_seqlens,
        context_parallel=shard,
    )
    out = linear_logprobs(
        hidden,
        output_weight(params),
        shard.labels,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        with_entropy=with_entropy,
    )
    if isinstance(out, tuple):
        return ShardedLogprobs(shard.unpack(out[0]), shard.unpack(out[1]), shard.mask)
    return ShardedLogprobs(shard.unpack(out), None, shard.mask)
