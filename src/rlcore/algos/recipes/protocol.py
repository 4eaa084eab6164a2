"""The ``Recipe`` protocol: what an update step reads of any recipe, an RL ``Algorithm`` or a preference ``DPO``.

A recipe is maths only: it never runs a model. The columns its batch needs come from
stages that hold models (GRPO's advantages after the rollout's scoring, PPO's critic
values and GAE, DPO's pairs and their reference log-probs); a trainer assembles those
per recipe type (:mod:`rlcore.train.recipe_stages`), outside this model-free package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Recipe"]

Metrics = dict[str, torch.Tensor]


@runtime_checkable
class Recipe(Protocol):
    """A recipe as an update step runs it: ``loss, metrics = recipe.loss(micro_batch, **recipe.global_counts(batch))``.

    The counts are taken once per step from the whole local batch (summed over the
    data-parallel ``process_group``), so the losses of the micro-batches add up to the
    loss of the batch whatever the split. :class:`~rlcore.algos.Algorithm` counts
    ``num_tokens`` and ``num_seqs``; :class:`~rlcore.algos.DPO` counts ``num_pairs``.

    Members:
      global_counts: ``(batch, *, process_group=None) -> dict`` of 0-d count tensors.
      loss: ``(batch, **counts) -> (loss, metrics)``: a scalar loss and detached metrics.
      metric_weight: ``batch -> 0-d tensor``, the weight of this batch's mean metrics
        when ranks combine them (:func:`rlcore.algos.reduce_metrics`).
      metric_reductions: ``() -> dict`` of the metrics that are not weighted means
        (summed loss terms, extremes), as :func:`rlcore.algos.reduce_metrics` takes them.

    >>> from rlcore import algos
    >>> isinstance(algos.grpo(), Recipe), isinstance(algos.dpo(), Recipe), isinstance(algos.gae, Recipe)
    (True, True, False)
    """

    def global_counts(self, batch: dict[str, Any], *, process_group: Any = None) -> dict[str, torch.Tensor]: ...

    # Each recipe names its own counts as keywords (num_tokens, num_seqs; num_pairs): a method typed
    # ``loss(batch, **counts)`` would admit none of them, so the member is "a callable returning the pair".
    @property
    def loss(self) -> Callable[..., tuple[torch.Tensor, Metrics]]: ...

    def metric_weight(self, batch: dict[str, Any]) -> torch.Tensor: ...

    def metric_reductions(self) -> dict[str, str]: ...
