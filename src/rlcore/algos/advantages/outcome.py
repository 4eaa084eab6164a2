"""Outcome (sequence-score) advantage estimators with a group baseline: GRPO, GDPO, RLOO, GPG, OPO, ReMax.

Each takes one score per sample ``[B]`` and the sample's group ``group_ids [B]``
(the prompt it answers; groups may be uneven and non-contiguous) and returns one
advantage per sample ``[B]``; broadcast it over the response tokens with the mask.
Group statistics come from :func:`rlcore.ops.segment_centred` and
:func:`rlcore.ops.segment_zscore` (two passes, float64 accumulation) with an explicit segment count (``num_groups``, else ``B``), so nothing
is read back from the device; ``1e4 + noise`` keeps its float32 resolution and a
spread beyond ``1.8e19`` does not overflow. A group whose scores are all equal gets
advantage exactly 0, and so does a group of one sample. A NaN or inf score makes its
own group's advantages NaN and leaves every other group's unchanged (the trainer's
finite-loss check then stops the step); it never silently rescales other groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlcore._checks import (
    check_choice,
    check_counts,
    check_floating,
    check_ndim,
    check_positive,
    check_same_shape,
    check_shape,
)
from rlcore.algos._groups import check_outcome
from rlcore.algos.advantages.normalize import batch_moments, batch_normalize
from rlcore.algos.filters import dynamic_sampling_mask
from rlcore.ops import acc_dtype, safe_div, segment_centred, segment_count, segment_sum, segment_zscore

__all__ = [
    "gdpo_advantages",
    "gpg_advantages",
    "grpo_advantages",
    "opo_advantages",
    "remax_advantages",
    "rloo_advantages",
]

_SCALES = ("group", "batch", "none")


def grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | None,
    *,
    scale: str = "group",
    eps: float = 1e-6,
    num_groups: int | None = None,
    group_size: int | None = None,
    process_group: Any = None,
) -> torch.Tensor:
    """GRPO advantages: scores centred on their group mean, optionally divided by a std.

    Reference: Shao et al., "DeepSeekMath" (GRPO), arXiv 2402.03300; ``scale="none"``
    is Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783);
    ``scale="batch"`` is TRL's ``scale_rewards="batch"``.

    Formula: ``A_i = (s_i - mean_g) / (std + eps)`` where ``std`` is the unbiased std of
    the group (``"group"``) or of the raw scores over the whole batch (``"batch"``), and
    ``A_i = s_i - mean_g`` for ``"none"``.

    A group whose scores are all equal gets exactly 0 in every mode (the group std is
    exactly 0 and the centred scores are exactly 0; peers computing ``E[x^2] - E[x]^2``
    return spurious stds there). A group of one sample gets 0: it has no baseline.
    Peers disagree here: verl uses mean 0 and std 1 (the raw score passes through) and
    TRL's unbiased std of one sample is NaN.

    Args:
      scores: ``[B]`` sequence scores.
      group_ids: ``[B]`` integer group of each sample, in ``[0, num_groups)``; may be
        ``None`` when ``group_size`` declares the layout.
      scale: ``"group"``, ``"batch"`` or ``"none"``.
      eps: added to the std.
      num_groups: number of groups; ``None`` uses ``B``, a bound that needs no host sync.
      group_size: declares contiguous groups of this size (``group_ids[i] == i //
        group_size``, the layout of ``n_samples`` responses per prompt): the group
        statistics are then a reshape and row reductions, the fastest path. Given
        ids are checked against it on CPU tensors in eager mode and trusted
        elsewhere (no host sync).
      process_group: with ``scale="batch"``, take the batch std over all data-parallel
        ranks of this group (one all-reduce). Group means are always local: a group
        must live on one rank.

    Returns:
      ``[B]`` advantages in ``scores.dtype``.

    >>> grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]))
    tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    n = check_outcome(scores, group_ids, num_groups, group_size, check_ids=False)  # checked by the segment op
    check_choice("scale", scale, _SCALES)
    check_positive("eps", eps, strict=False, finite=True)
    if scale == "group":
        return segment_zscore(scores, group_ids, num_segments=n, group_size=group_size, eps=eps)
    if group_ids is None:  # the declared layout (check_outcome requires group_size here)
        assert group_size is not None
        group_ids = torch.arange(scores.shape[0], device=scores.device) // group_size
    s = scores.to(acc_dtype(scores.dtype))
    if scale == "none":
        return segment_centred(s, group_ids, num_segments=n).to(scores.dtype)
    centred = segment_centred(s, group_ids, num_segments=n)
    # Non-finite scores stay out of the batch std: they make their own group NaN
    # (through its mean), never every other group's scale.
    _, count, _, m2 = batch_moments(s, torch.isfinite(s), process_group=process_group)
    var = safe_div(m2, count - 1) * (count > 1)
    std = torch.where(var > 0, torch.sqrt(torch.where(var > 0, var, 1.0)), 0.0).to(s.dtype)
    if eps > 0:
        return (centred / (std + eps)).to(scores.dtype)
    # eps = 0: where the std is 0 (a constant group) the centred score is exactly 0 too.
    return (centred / torch.where(std > 0, std, 1.0)).to(scores.dtype)


def gdpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | None,
    *,
    weights: torch.Tensor | Sequence[float] | None = None,
    eps: float = 1e-6,
    batch_norm: bool = True,
    num_groups: int | None = None,
    group_size: int | None = None,
    process_group: Any = None,
) -> torch.Tensor:
    """GDPO advantages: each reward component normalised within its group, then combined.

    Reference: Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy
    Optimization for Multi-reward RL Optimization", arXiv 2601.05242 (verl's ``gdpo``).
    GRPO on the sum of several rewards maps different reward combinations to the same
    advantage (a group whose format reward varies drowns a group whose accuracy varies);
    normalising each component in its group first keeps them apart.

    Formula, for components ``k`` with weights ``w_k``::

        A_k   = grpo_advantages(scores[:, k], group_ids)        (group z-score per component)
        A_sum = sum_k w_k * A_k
        A     = (A_sum - mean(A_sum)) / sqrt(var(A_sum) + 1e-8)  (over the batch's samples)

    The batch normalisation keeps the scale from growing with the number of components.
    It is taken over samples: verl whitens the ``[B, T]`` token advantages instead, which
    weighs each sample by its length and gives samples of all-equal groups a nonzero
    advantage (``-mean / std``). With one component and ``batch_norm=False`` this is
    exactly :func:`grpo_advantages`. A constant component contributes 0, and a group of
    one sample gets 0, as in GRPO.

    Args:
      scores: ``[B, K]`` reward components per sample (``[B]`` is one component).
      group_ids: ``[B]`` integer group of each sample (``None`` with ``group_size``).
      weights: ``[K]`` weights ``w_k`` (a tensor or a sequence of numbers; 1 when ``None``).
      eps: added to each group std.
      batch_norm: whiten the combined advantages over the batch (the paper's last step).
      num_groups, group_size: the group layout, as in :func:`grpo_advantages`.
      process_group: take the batch statistics over all data-parallel ranks.

    Returns:
      ``[B]`` advantages in ``scores.dtype``.

    >>> scores = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    >>> gdpo_advantages(scores, torch.tensor([0, 0, 1, 1]), batch_norm=False)
    tensor([ 0.7071, -0.7071,  0.7071, -0.7071])
    """
    check_floating("scores", scores)
    check_ndim("scores", scores, (1, 2))
    columns = scores[:, None] if scores.dim() == 1 else scores
    k = columns.shape[1]
    if k == 0:
        raise ValueError(f"scores: got shape {tuple(scores.shape)}, expected [B] or [B, K] with K >= 1 components")
    w: torch.Tensor | None = None
    if weights is not None:
        w = weights if isinstance(weights, torch.Tensor) else torch.as_tensor(weights, dtype=torch.float64)
        check_floating("weights", w)
        check_shape("weights", w, (k,), what="one weight per reward component")
    check_outcome(columns[:, 0], group_ids, num_groups, group_size)
    acc = acc_dtype(scores.dtype)
    total = torch.zeros(columns.shape[0], dtype=acc, device=scores.device)
    for j in range(k):
        adv = grpo_advantages(columns[:, j].to(acc), group_ids, eps=eps, num_groups=num_groups, group_size=group_size)
        total = total + (adv if w is None else w[j].to(acc) * adv)
    if batch_norm:
        keep = torch.ones_like(total, dtype=torch.bool)
        total = batch_normalize(total, keep, eps=1e-8, process_group=process_group)
    return total.to(scores.dtype)


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, *, num_groups: int | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out advantages: each score minus the mean of the other scores of its group.

    Reference: Kool et al., "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (2019);
    Ahmadian et al., "Back to Basics" (RLOO for LLMs), arXiv 2402.14740.

    Formula: ``A_i = s_i - 1/(n-1) sum_{j != i} s_j = n/(n-1) * (s_i - mean_g)``.

    A group of one sample gets 0 (there is no other sample to form a baseline); verl
    passes the raw score through there.

    Args:
      scores: ``[B]`` sequence scores.
      group_ids: ``[B]`` integer group of each sample.
      num_groups: number of groups; ``None`` uses ``B`` (no host sync).

    Returns:
      ``[B]`` advantages in ``scores.dtype``.

    >>> rloo_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0, 0, 0]))
    tensor([ 1.0000, -0.5000, -0.5000])
    """
    n = check_outcome(scores, group_ids, num_groups)
    s = scores.to(acc_dtype(scores.dtype))
    count = segment_count(group_ids, num_segments=n).to(s.dtype)[group_ids]
    factor = torch.where(count > 1, count / torch.clamp(count - 1, min=1), 0.0)
    return (factor * segment_centred(s, group_ids, num_segments=n)).to(scores.dtype)


def gpg_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    f_norm: float = 1.0,
    alpha: float | str = 1.0,
    num_groups: int | None = None,
) -> torch.Tensor:
    """GPG advantages: group-centred scores, rescaled by ``alpha / f_norm``.

    Reference: Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline for
    Model Reasoning", arXiv 2504.02546.

    Formula: ``A_i = alpha * (s_i - mean_g) / f_norm``. ``alpha="auto"`` is the paper's
    gradient-estimation correction ``alpha = B / (B - M)``, with ``M`` the number of
    samples whose group has all-equal scores (their advantage is 0, so they dilute a
    mean over the batch); computed on the device. verl instead overrides ``alpha`` with
    ``B / (number of nonzero raw scores)``, which is not the paper's ``M``.

    Args:
      scores: ``[B]`` sequence scores.
      group_ids: ``[B]`` integer group of each sample.
      f_norm: positive normaliser ``F_norm`` (1 in the paper's best setting).
      alpha: a positive number, or ``"auto"`` for ``B / (B - M)``.
      num_groups: number of groups; ``None`` uses ``B`` (no host sync).

    Returns:
      ``[B]`` advantages in ``scores.dtype``.

    >>> gpg_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), alpha="auto")
    tensor([ 1., -1.,  0.,  0.])
    """
    n = check_outcome(scores, group_ids, num_groups)
    check_positive("f_norm", f_norm, finite=True)
    if isinstance(alpha, str):
        check_choice("alpha", alpha, ("auto",))
    else:
        check_positive("alpha", alpha, finite=True)
    s = scores.to(acc_dtype(scores.dtype))
    centred = segment_centred(s, group_ids, num_segments=n)
    if isinstance(alpha, str):  # "auto", the one name check_choice lets through
        valid = dynamic_sampling_mask(s, group_ids, num_groups=n).to(s.dtype).sum()
        return (s.shape[0] / torch.clamp(valid, min=1) * centred / f_norm).to(scores.dtype)
    return (alpha * centred / f_norm).to(scores.dtype)


def opo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor, *, num_groups: int | None = None
) -> torch.Tensor:
    """OPO advantages: scores minus the length-weighted mean score of their group.

    Reference: Hao et al., "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585.

    Formula: ``b_g = sum_{j in g} l_j s_j / sum_{j in g} l_j`` (the variance-optimal
    baseline when gradient norms grow with length), ``A_i = s_i - b_{g(i)}``. The
    baseline is computed as ``mean_g + sum l (s - mean_g) / sum l`` so that a group of
    equal scores gets exactly 0; a group whose lengths sum to 0 falls back to the
    plain mean. A group of one sample gets 0 (verl: the raw score).

    Args:
      scores: ``[B]`` sequence scores.
      group_ids: ``[B]`` integer group of each sample.
      lengths: ``[B]`` response lengths ``l_i`` (token counts >= 0, integer or float; a
        negative count on a CPU tensor is refused).
      num_groups: number of groups; ``None`` uses ``B`` (no host sync).

    Returns:
      ``[B]`` advantages in ``scores.dtype``.

    >>> opo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([3, 1]))
    tensor([ 0.2500, -0.7500])
    """
    n = check_outcome(scores, group_ids, num_groups)
    check_same_shape("lengths", lengths, "scores", scores)
    if lengths.dtype == torch.bool or lengths.dtype.is_complex:
        raise ValueError(f"lengths: got dtype {lengths.dtype}, expected an integer or floating-point dtype")
    check_counts("lengths", lengths)
    s = scores.to(acc_dtype(scores.dtype))
    w = lengths.to(s.dtype)
    centred = segment_centred(s, group_ids, num_segments=n)
    total = segment_sum(w, group_ids, num_segments=n)
    shift = segment_sum(w * centred, group_ids, num_segments=n) / torch.where(total != 0, total, 1.0)
    return (centred - shift[group_ids]).to(scores.dtype)


def remax_advantages(scores: torch.Tensor, baseline_scores: torch.Tensor) -> torch.Tensor:
    """ReMax advantages: each score minus the score of the greedy response to the same prompt.

    Reference: Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement
    Learning Method for Aligning Large Language Models", arXiv 2310.10505.

    Formula: ``A_i = r(x_i, y_i) - r(x_i, y_i^greedy)``.

    Args:
      scores: ``[B]`` scores of the sampled responses.
      baseline_scores: ``[B]`` scores of the greedy responses to the same prompts.

    Returns:
      ``[B]`` advantages in ``scores.dtype``.

    >>> remax_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]))
    tensor([ 0.5000, -0.5000])
    """
    check_ndim("scores", scores, 1)
    check_floating("scores", scores)
    check_floating("baseline_scores", baseline_scores)
    check_same_shape("baseline_scores", baseline_scores, "scores", scores)
    acc = acc_dtype(scores.dtype)
    return (scores.to(acc) - baseline_scores.to(acc)).to(scores.dtype)
