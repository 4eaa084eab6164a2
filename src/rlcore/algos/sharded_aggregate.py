"""Loss aggregation when each sequence's tokens are split over context-parallel ranks.

With context parallelism every rank of a ``cp`` group holds the same ``B``
sequences but scores a disjoint part of their tokens (the mask of
:func:`rlcore.models.sharded_token_logprobs`). :func:`rlcore.algos.aggregate` over
such a local mask is additive over the ranks for every mode whose per-sequence
normaliser is global — except ``"seq-mean-token-mean"``, whose ``sum_t m`` would be
the local part of the sequence. :func:`sequence_sharded_counts` all-reduces the
per-sequence token counts over ``cp`` (a sequence split over ranks is one sequence,
not ``cp``) and the totals over ``dp``; :func:`sequence_sharded_aggregate` feeds
them to ``aggregate``, so the sum over all ``cp × dp`` ranks equals ``aggregate`` of
the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlcore._checks import check_choice, check_ndim, check_shape, check_tensor, host_readable
from rlcore._process_group import as_process_group
from rlcore.algos.aggregate import AGGREGATION_MODES, Count, aggregate
from rlcore.ops import acc_dtype

__all__ = ["sequence_sharded_aggregate", "sequence_sharded_counts"]


def sequence_sharded_counts(mask: torch.Tensor, *, cp_group: Any, dp_group: Any = None) -> dict[str, torch.Tensor]:
    """Global token, sequence and per-sequence counts of a batch whose tokens are split over ``cp`` ranks.

    Args:
      mask: ``[B, T]`` this rank's part of the token mask (disjoint over ``cp_group``,
        whose ranks hold the same ``B`` sequences).
      cp_group: the context-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``.
      dp_group: the data-parallel one (ranks holding other sequences), if any.

    Returns:
      ``{"num_tokens": N, "num_seqs": S, "seq_tokens": [B]}``: the counted tokens of
      the whole batch, its sequences with at least one counted token, and each local
      sequence's counted tokens over ``cp``. int64 for a boolean or integer mask, float
      for a weighted one. Two all-reduces (``[B]`` over ``cp``, 2 numbers over ``dp``).

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> sequence_sharded_counts(torch.tensor([[1, 1, 0], [0, 0, 0]]), cp_group=dist.group.WORLD)
    {'num_tokens': tensor(2), 'num_seqs': tensor(1), 'seq_tokens': tensor([2, 0])}
    >>> dist.destroy_process_group()
    """
    check_tensor("mask", mask)
    check_ndim("mask", mask, 2)
    weights = mask.to(acc_dtype(mask.dtype)) if mask.dtype.is_floating_point else (mask != 0).long()
    seq_tokens = weights.sum(-1)
    dist.all_reduce(seq_tokens, op=dist.ReduceOp.SUM, group=as_process_group("cp_group", cp_group, optional=True))
    totals = torch.stack([seq_tokens.sum(), (seq_tokens != 0).sum().to(seq_tokens.dtype)])
    if dp_group is not None:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=as_process_group("dp_group", dp_group))
    return {"num_tokens": totals[0], "num_seqs": totals[1], "seq_tokens": seq_tokens}


def _check_seq_tokens(seq_tokens: torch.Tensor, mask: torch.Tensor) -> None:
    """Each sequence's count over the group holds at least this rank's part of it (NaN and < 0 fail).

    Read only where that stalls nothing (CPU tensors in eager mode), like every value check.
    """
    if not (host_readable(seq_tokens) and host_readable(mask)) or mask.dim() != 2 or seq_tokens.dtype == torch.bool:
        return
    local = (mask.double() if mask.dtype.is_floating_point else (mask != 0).double()).sum(-1)
    total = seq_tokens.double()
    bad = ~(total >= local - 1e-6 * local.abs().clamp(min=1.0))
    if bad.any():
        i = int(bad.to(torch.int8).argmax())
        raise ValueError(
            f"seq_tokens: got {total[i].item()!r} for sequence {i}, which holds {local[i].item()!r} counted tokens "  # sync-ok: CPU tensors in eager mode (host_readable), error path only
            "on this rank alone, expected each sequence's counted tokens over the whole context-parallel group "
            "(rlcore.algos.sequence_sharded_counts)"
        )


def sequence_sharded_aggregate(
    loss_t: torch.Tensor,
    mask: torch.Tensor,
    *,
    seq_tokens: torch.Tensor,
    mode: str = "token-mean",
    num_tokens: Count,
    num_seqs: Count,
    horizon: int | None = None,
) -> torch.Tensor:
    """:func:`rlcore.algos.aggregate` of this rank's part of sequences split over ``cp`` ranks.

    Every mode of ``aggregate`` (DAPO's token-mean, GRPO's seq-mean-token-mean,
    Dr. GRPO's seq-mean-token-sum-norm, ...) with the counts of
    :func:`sequence_sharded_counts`; summed over the ``cp × dp`` ranks it equals
    ``aggregate`` of the whole batch. ``"seq-mean-token-mean"`` divides each token by
    its sequence's global count ``seq_tokens`` and sums, instead of dividing by the
    local count.

    Args:
      loss_t: ``[B, T]`` per-token loss.
      mask: ``[B, T]`` this rank's part of the mask.
      seq_tokens: ``[B]`` each sequence's counted tokens over the ``cp`` group.
      mode: one of :data:`rlcore.algos.AGGREGATION_MODES`.
      num_tokens: global counted tokens.
      num_seqs: global counted sequences.
      horizon: as in ``aggregate``.

    Returns:
      A scalar in ``loss_t.dtype``.

    >>> loss_t, mask = torch.tensor([[1.0, 3.0]]), torch.tensor([[1, 0]])
    >>> sequence_sharded_aggregate(loss_t, mask, seq_tokens=torch.tensor([2]), mode="seq-mean-token-mean",
    ...                            num_tokens=2, num_seqs=1)
    tensor(0.5000)
    """
    check_tensor("loss_t", loss_t)
    check_ndim("loss_t", loss_t, 2)
    check_choice("mode", mode, AGGREGATION_MODES)
    check_tensor("seq_tokens", seq_tokens)
    check_shape("seq_tokens", seq_tokens, (loss_t.shape[0],))
    _check_seq_tokens(seq_tokens, mask)
    if mode != "seq-mean-token-mean":
        return aggregate(loss_t, mask, mode=mode, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    acc = acc_dtype(loss_t.dtype)
    den = seq_tokens.to(acc)
    per_token = loss_t.to(acc) / torch.where(den > 0, den, torch.ones_like(den))[:, None]
    out = aggregate(per_token, mask, mode="seq-mean-token-sum", num_tokens=num_tokens, num_seqs=num_seqs)
    return out.to(loss_t.dtype)
