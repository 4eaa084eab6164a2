"""Evaluation metrics: pass@k, the unbiased estimate of the chance that at least one of k samples is correct."""

from __future__ import annotations

import math

import torch

from rlcore._checks import check_positive
from rlcore.algos._groups import check_outcome
from rlcore.ops import segment_count, segment_sum

__all__ = ["pass_at_k"]


def pass_at_k(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    k: int,
    threshold: float = 0.0,
    num_groups: int | None = None,
) -> torch.Tensor:
    """Per-group unbiased pass@k from ``n`` samples with ``c`` correct: ``1 - C(n - c, k) / C(n, k)``.

    Reference: Chen et al., "Evaluating Large Language Models Trained on Code",
    arXiv 2107.03374 (the estimator and its numerically stable product form)::

        pass@k = 1 - prod_{i=0}^{k-1} (n - c - i) / (n - i)

    A group of fewer than ``k`` samples uses ``k = n`` (pass@n: any sample correct); an
    empty group (an id below ``num_groups`` that no sample has) gets 0. With ``k = 1``
    this is the group's fraction of correct samples. Computed in float64.

    Args:
      scores: ``[B]`` sample scores; a score ``> threshold`` is correct.
      group_ids: ``[B]`` integer prompt of each sample.
      k: the ``k`` of pass@k, a positive int.
      threshold: scores above it count as correct.
      num_groups: number of groups ``G``; ``None`` uses ``B`` (no host sync).

    Returns:
      ``[G]`` float32 estimates in ``[0, 1]``; the mean over prompts is the dataset's pass@k.

    >>> pass_at_k(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0, 1, 1]), k=2, num_groups=2)
    tensor([0.5000, 1.0000])
    """
    g = check_outcome(scores, group_ids, num_groups)
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"k: got {k!r}, expected a positive int")
    check_positive("k", k)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
        raise ValueError(f"threshold: got {threshold!r}, expected a number")
    correct = (scores > threshold).to(torch.float64)
    n = segment_count(group_ids, num_segments=g).to(torch.float64)
    c = segment_sum(correct, group_ids, num_segments=g)
    k_eff = torch.clamp(n, max=float(k))
    i = torch.arange(k, dtype=torch.float64, device=scores.device)
    active = i < k_eff[:, None]
    # factor i of C(n - c, k) / C(n, k); a factor (n - c - i) <= 0 makes the ratio 0
    num = torch.clamp(n[:, None] - c[:, None] - i, min=0.0)
    den = torch.where(active, n[:, None] - i, 1.0)
    miss = torch.where(active, num / den, 1.0).prod(dim=-1)
    return torch.where(n > 0, 1.0 - miss, 0.0).to(torch.float32)
