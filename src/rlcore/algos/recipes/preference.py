"""The DPO recipe: a batch of per-pair sequence log-probs to ``(loss, metrics)``, tensor-in like ``Algorithm``.

The DPO family has the recipe shape of every other algorithm in rlcore: ``counts =
recipe.global_counts(batch, process_group=...)`` once per step on the whole batch,
then ``loss, metrics = recipe.loss(micro_batch, **counts)`` per micro-batch. The model
forward is a separate step, :func:`rlcore.models.preference_logps`, which turns
token batches of chosen and rejected responses into the columns read here, so one
update stage serves every algorithm.

Batch layout (a dict; ``P`` pairs)::

    chosen_logps, rejected_logps           [P] float  policy's summed response log-probs (with gradient)
    ref_chosen_logps, ref_rejected_logps   [P] float  reference's summed response log-probs
    chosen_lengths, rejected_lengths       [P]        scored-token counts (for reduce="mean")
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from rlcore._checks import check_choice, check_count, check_counts, check_ndim, check_same_shape
from rlcore.algos.collectives import group_sum
from rlcore.algos.preference_pairwise import dpo_loss
from rlcore.ops import SEQUENCE_REDUCTIONS

__all__ = ["DPO", "PAIR_LOGP_COLUMNS", "dpo"]

# The summed response log-probs the loss reads (the token columns of the pairs are the trainer's).
PAIR_LOGP_COLUMNS = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
LENGTH_COLUMNS = ("chosen_lengths", "rejected_lengths")
# Columns whose leading dimension is the pair count, before or after the forward pass.
_COUNT_SOURCES = ("chosen_logps", "ref_chosen_logps", "chosen_input_ids", "chosen_mask")

Metrics = dict[str, torch.Tensor]
Count = int | float | torch.Tensor


def _columns(batch: Mapping[str, Any], keys: tuple[str, ...], why: str) -> list[torch.Tensor]:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"batch: got keys {sorted(batch)}, expected {', '.join(map(repr, missing))} ({why})")
    first = batch[keys[0]]
    check_ndim(keys[0], first, 1)
    for k in keys[1:]:
        check_same_shape(k, batch[k], keys[0], first)
    return [batch[k] for k in keys]


class DPO(NamedTuple):
    """A DPO-family recipe: ``loss, metrics = recipe.loss(batch, **recipe.global_counts(batch))``.

    Fields (replace any with ``recipe._replace(...)``):
      pair_loss: ``(pi_chosen, pi_rejected, ref_chosen, ref_rejected) -> (loss [P], metrics)``,
        e.g. :func:`dpo_loss` with its options bound.
      reduce: ``"sum"`` scores a response by its summed log-probs (DPO); ``"mean"``
        divides them by the scored-token counts ``chosen_lengths`` /
        ``rejected_lengths`` (length-normalised, as TRL runs IPO).

    The loss is the sum of the per-pair losses over ``num_pairs`` (the global pair
    count under micro-batching or data parallelism, from :meth:`global_counts`;
    default ``P``), so the losses of micro-batches add up to the loss of the batch.
    Metrics are detached 0-d means over the local pairs: the pair loss's metrics
    (``chosen_rewards``, ``rejected_rewards``, ``margins``, ``accuracies`` for
    :func:`dpo_loss`) plus ``logps_chosen`` and ``logps_rejected`` of the policy (after
    ``reduce``).
    """

    pair_loss: Callable[..., tuple[torch.Tensor, Metrics]] = dpo_loss
    reduce: str = "sum"

    def global_counts(self, batch: Mapping[str, Any], *, process_group: Any = None) -> dict[str, torch.Tensor]:
        """``{"num_pairs": P}``, summed over ``process_group`` (one all-reduce) when given.

        Take it from the whole local batch, before splitting into micro-batches; it
        reads the leading dimension of the first of ``chosen_logps``,
        ``ref_chosen_logps``, ``chosen_input_ids``, ``chosen_mask`` that the batch
        holds, so it works before or after :func:`rlcore.models.preference_logps`.

        Returns:
          ``{"num_pairs": int64 0-d tensor}`` on the batch's device.
        """
        source = next((k for k in _COUNT_SOURCES if k in batch), None)
        if source is None:
            raise ValueError(
                f"batch: got keys {sorted(batch)}, expected one of {', '.join(map(repr, _COUNT_SOURCES))} "
                "to count the pairs"
            )
        column = batch[source]
        if not isinstance(column, torch.Tensor) or column.dim() == 0:
            raise ValueError(f"{source}: got {type(column).__name__}, expected a tensor with a leading pair dimension")
        num_pairs = torch.tensor(column.shape[0], dtype=torch.int64, device=column.device)
        return {"num_pairs": group_sum(num_pairs, process_group=process_group)}

    def metric_weight(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The weight of this batch's metrics when ranks combine them: its pair count (they are means over pairs)."""
        source = next((k for k in _COUNT_SOURCES if k in batch), None)
        if source is None:
            raise ValueError(
                f"batch: got keys {sorted(batch)}, expected one of {', '.join(map(repr, _COUNT_SOURCES))} "
                "to count the pairs"
            )
        return torch.tensor(float(batch[source].shape[0]), device=batch[source].device)

    def metric_reductions(self) -> dict[str, str]:
        """How :meth:`loss`'s metrics combine over ranks: all are means over pairs (an empty dict)."""
        return {}

    def loss(self, batch: Mapping[str, Any], *, num_pairs: Count | None = None) -> tuple[torch.Tensor, Metrics]:
        """The scalar DPO-family loss of a (micro-)batch of pairs and detached metrics.

        Args:
          batch: the columns in the module docstring (``*_lengths`` only for ``reduce="mean"``).
          num_pairs: global pair count (number or 0-d tensor, from :meth:`global_counts`);
            default the batch's ``P``. Zero gives a zero loss.

        Returns:
          ``(loss, metrics)``: ``loss = sum_p pair_loss_p / num_pairs`` in float32
          (float64 for float64 log-probs).
        """
        check_count("num_pairs", num_pairs)
        pi_chosen, pi_rejected, ref_chosen, ref_rejected = _columns(
            batch, PAIR_LOGP_COLUMNS, "summed response log-probs: rlcore.models.preference_logps gives the policy's"
        )
        dtype = torch.promote_types(pi_chosen.dtype, torch.float32)
        if self.reduce == "mean":
            lengths = _columns(batch, LENGTH_COLUMNS, "scored-token counts for reduce='mean'")
            check_same_shape(LENGTH_COLUMNS[0], lengths[0], PAIR_LOGP_COLUMNS[0], pi_chosen)
            for name, n in zip(LENGTH_COLUMNS, lengths):
                check_counts(name, n)
            # An empty response scores 0, as sequence_logps(reduce="mean") does.
            dens = [torch.clamp(n.to(dtype), min=1.0) for n in lengths]
            pi_chosen, ref_chosen = pi_chosen.to(dtype) / dens[0], ref_chosen.to(dtype) / dens[0]
            pi_rejected, ref_rejected = pi_rejected.to(dtype) / dens[1], ref_rejected.to(dtype) / dens[1]
        pi_chosen, pi_rejected = pi_chosen.to(dtype), pi_rejected.to(dtype)
        per_pair, pair_metrics = self.pair_loss(
            pi_chosen, pi_rejected, ref_chosen.detach().to(dtype), ref_rejected.detach().to(dtype)
        )
        den = torch.as_tensor(per_pair.shape[0] if num_pairs is None else num_pairs, device=per_pair.device)
        den = den.to(per_pair.dtype)
        loss = per_pair.sum() / torch.where(den > 0, den, torch.ones_like(den))
        metrics = {k: _local_mean(v) for k, v in pair_metrics.items()}
        metrics["logps_chosen"] = _local_mean(pi_chosen)
        metrics["logps_rejected"] = _local_mean(pi_rejected)
        return loss, metrics


def _local_mean(x: torch.Tensor) -> torch.Tensor:
    """Detached float mean; 0 for an empty micro-batch."""
    x = x.detach().float()
    return x.sum() / max(x.numel(), 1)


def dpo(
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reduce: str = "sum",
    **loss_options: Any,
) -> DPO:
    """Build a DPO recipe with :func:`dpo_loss` and its options bound.

    DPO: Rafailov et al., 2023, arXiv:2305.18290, ``-log sigmoid(beta h)`` with ``h``
    the policy-minus-reference log-ratio margin of each pair; any ``loss_type`` of
    :func:`dpo_loss` (IPO is usually run with ``reduce="mean"``). Options are
    validated here, before any model runs.

    Args:
      beta, loss_type, label_smoothing, **loss_options: passed to :func:`dpo_loss`.
      reduce: ``"sum"`` (DPO) or ``"mean"`` (length-normalised) sequence log-probs.

    Returns:
      A :class:`DPO` recipe.

    >>> recipe = dpo(beta=0.1)
    >>> batch = {"chosen_logps": torch.tensor([-2.0]), "rejected_logps": torch.tensor([-3.0]),
    ...          "ref_chosen_logps": torch.tensor([-2.0]), "ref_rejected_logps": torch.tensor([-3.0])}
    >>> loss, metrics = recipe.loss(batch, **recipe.global_counts(batch))
    >>> loss  # policy == reference: log 2
    tensor(0.6931)
    """
    check_choice("reduce", reduce, SEQUENCE_REDUCTIONS)
    loss = functools.partial(dpo_loss, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, **loss_options)
    # A one-pair dry run raises any bad option now rather than after a forward pass.
    loss(*[torch.zeros(1)] * 4)
    return DPO(pair_loss=loss, reduce=reduce)
