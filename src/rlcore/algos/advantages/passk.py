"""Pass@k advantages: the analytic group advantage of the pass@k objective for binary rewards."""

from __future__ import annotations

import torch

from rlcore._checks import check_positive
from rlcore.algos._groups import check_outcome
from rlcore.ops import acc_dtype, segment_count, segment_sum

__all__ = ["passk_advantages"]


def _comb_ratio(top: torch.Tensor, bottom: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """``C(top, k) / C(bottom, k)`` per element, as ``prod_{i<k} (top - i) / (bottom - i)``.

    ``k <= bottom`` elementwise; factors with ``i >= k`` are 1 and a negative
    ``top - i`` makes the ratio 0 (``C(top, k) = 0`` when ``k > top``).
    """
    i = torch.arange(k_max, dtype=top.dtype, device=top.device)
    active = i < k[:, None]
    num = torch.clamp(top[:, None] - i, min=0.0)
    den = torch.where(active, bottom[:, None] - i, 1.0)
    return torch.where(active, num / den, 1.0).prod(dim=-1)


def passk_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, *, k: int = 4, num_groups: int | None = None
) -> torch.Tensor:
    """Pass@k advantages: each response's mean advantage over the k-subsets of its group that contain it.

    Reference: Chen et al., "Pass@k Training for Adaptively Balancing Exploration and
    Exploitation of Large Reasoning Models", arXiv 2508.10751 (analytic derivation).

    A group of ``N`` responses with ``N_neg`` incorrect ones is scored by its k-subsets:
    a subset's reward is 1 if any member is correct. Over all ``C(N, k)`` subsets the
    reward has mean ``1 - q`` and std ``sigma = sqrt(q (1 - q))`` with
    ``q = C(N_neg, k) / C(N, k)``. A response's advantage is the mean normalised
    advantage ``(reward - (1 - q)) / sigma`` of the subsets that contain it::

        A_correct   = q / sigma
        A_incorrect = (q - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / sigma

    With ``k = 1`` this is GRPO with the population (biased) group std. A group that is
    all correct or all incorrect (``sigma = 0``) gets 0; a group smaller than ``k`` uses
    ``k = N``. verl's ``grpo_passk`` is a different estimator (only the best response of
    a group gets ``r_max - r_second``, arXiv 2503.19595).

    Args:
      scores: ``[B]`` binary outcome scores; a score ``> 0`` counts as correct (so 0/1
        and -1/+1 rewards both work).
      group_ids: ``[B]`` integer group of each sample.
      k: the ``k`` of pass@k, a positive int.
      num_groups: number of groups; ``None`` uses ``B`` (no host sync).

    Returns:
      ``[B]`` advantages in ``scores.dtype``.

    >>> passk_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0]), k=2)
    tensor([ 1.0000, -0.3333, -0.3333, -0.3333])
    """
    n = check_outcome(scores, group_ids, num_groups)
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"k: got {k!r}, expected a positive int")
    check_positive("k", k)
    acc = acc_dtype(scores.dtype)
    correct = (scores > 0).to(acc)
    size = segment_count(group_ids, num_segments=n).to(acc)
    wrong = size - segment_sum(correct, group_ids, num_segments=n)
    k_eff = torch.clamp(size, max=float(k))
    q = _comb_ratio(wrong, size, k_eff, k)
    q_wrong = _comb_ratio(wrong - 1, size - 1, k_eff - 1, k)
    var = q * (1 - q)
    inv_sigma = torch.where(var > 0, torch.rsqrt(torch.where(var > 0, var, 1.0)), 0.0)
    adv_correct = q * inv_sigma
    adv_wrong = (q - q_wrong) * inv_sigma
    out = torch.where(correct > 0, adv_correct[group_ids], adv_wrong[group_ids])
    return out.to(scores.dtype)
