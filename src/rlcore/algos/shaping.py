"""Reward shaping: DAPO's overlong penalty, running reward normalisation with pure state, clipping.

The running normaliser follows optax: a ``NamedTuple`` of pure functions ``init`` and
``update`` over an explicit state (:class:`RunningMomentsState`), which holds the count,
mean and sum of squared deviations of every reward seen so far, in float64 (the count
grows without bound, and float32 means drift after ~10^7 samples).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from rlcore._checks import check_counts, check_floating, check_ndim, check_positive, check_same_shape, check_tensor
from rlcore.algos.advantages.normalize import batch_moments
from rlcore.ops import acc_dtype

__all__ = [
    "RewardNormalizer",
    "RunningMomentsState",
    "clip_rewards",
    "overlong_penalty",
    "running_reward_normalizer",
    "scores_to_token_rewards",
]


def overlong_penalty(
    lengths: torch.Tensor, *, max_length: int = 20480, cache_length: int = 4096, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment: a length penalty that ramps from 0 to -1 over the last ``cache_length`` tokens.

    Reference: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale", arXiv 2503.14476, eq. 13 (defaults: 20480 generated tokens at most, of which
    4096 are the punishment cache).

    Formula, with ``L_exp = max_length - cache_length``::

        R(l) = 0                              l <= L_exp
             = (L_exp - l) / cache_length     L_exp < l <= max_length
             = -1                             l > max_length

    times ``penalty_factor`` (verl's ``overlong_buffer.penalty_factor``). Add it to the
    sequence scores.

    Args:
      lengths: ``[B]`` response lengths in tokens, >= 0 (integer or float; a negative
        count on a CPU tensor is refused).
      max_length: ``L_max`` (> 0).
      cache_length: ``L_cache``, in ``(0, max_length]``.
      penalty_factor: scale of the penalty (>= 0).

    Returns:
      ``[B]`` penalties (<= 0), float32 (or the dtype of floating ``lengths``).

    >>> overlong_penalty(torch.tensor([10, 17, 20, 30]), max_length=20, cache_length=4)
    tensor([ 0.0000, -0.2500, -1.0000, -1.0000])
    """
    check_ndim("lengths", lengths, 1)
    check_counts("lengths", lengths)
    check_positive("max_length", max_length)
    check_positive("cache_length", cache_length)
    if cache_length > max_length:
        raise ValueError(f"cache_length: got {cache_length!r}, expected a number <= max_length ({max_length!r})")
    check_positive("penalty_factor", penalty_factor, strict=False, finite=True)
    dtype = lengths.dtype if lengths.dtype.is_floating_point else torch.float32
    expected = max_length - cache_length
    ramp = (expected - lengths.to(acc_dtype(dtype))) / cache_length
    return (torch.clamp(ramp, min=-1.0, max=0.0) * penalty_factor).to(dtype)


def clip_rewards(rewards: torch.Tensor, *, low: float = -10.0, high: float = 10.0) -> torch.Tensor:
    """Clip rewards to ``[low, high]`` (the reward clipping of OpenAI Baselines' ``VecNormalize``, bound 10).

    Reference: Mnih et al., "Human-level control through deep reinforcement learning"
    (2015) introduced reward clipping; Baselines clips normalised rewards to +-10.

    Args:
      rewards: any shape, floating point.
      low: lower bound.
      high: upper bound (>= low).

    Returns:
      The clipped rewards, same shape and dtype.

    >>> clip_rewards(torch.tensor([-20.0, 0.5, 12.0]))
    tensor([-10.0000,   0.5000,  10.0000])
    """
    check_floating("rewards", rewards)
    for name, bound in (("low", low), ("high", high)):
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or bound != bound:
            raise ValueError(f"{name}: got {bound!r}, expected a number")
    if low > high:
        raise ValueError(f"low: got {low!r}, expected a number <= high ({high!r})")
    return torch.clamp(rewards, min=low, max=high)


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on the last counted token of its row, 0 elsewhere.

    Reference: Ziegler et al., arXiv 1909.08593, and Ouyang et al., arXiv 2203.02155:
    the reward model's score is the reward of the final token, the other tokens get
    only the KL term. This is how an outcome reward enters token-level estimators (GAE,
    REINFORCE++). A row without counted tokens gets no reward.

    Formula: ``r_{i,t} = s_i`` if ``t`` is the last ``t`` with ``mask[i, t] = 1``, else 0.

    Args:
      scores: ``[B]`` sequence scores.
      mask: ``[B, T]``; 1 marks a generated token.

    Returns:
      ``[B, T]`` token rewards in ``scores.dtype``.

    >>> scores_to_token_rewards(torch.tensor([1.0, 2.0]), torch.tensor([[1, 1, 0], [1, 0, 1]]))
    tensor([[0., 1., 0.],
            [0., 0., 2.]])
    """
    check_ndim("scores", scores, 1)
    check_floating("scores", scores)
    check_ndim("mask", mask, 2)
    if mask.shape[0] != scores.shape[0]:
        raise ValueError(f"mask: got shape {tuple(mask.shape)}, expected ({scores.shape[0]}, T) (B from scores)")
    on = mask != 0
    t = mask.shape[1]
    positions = torch.arange(t, device=mask.device).expand_as(on)
    last = torch.where(on, positions, -1).amax(dim=-1, keepdim=True) if t else positions[:, :1]
    return torch.where(positions == last, scores[:, None], torch.zeros((), dtype=scores.dtype, device=scores.device))


class RunningMomentsState(NamedTuple):
    """Running statistics of every reward seen: count, mean and sum of squared deviations (float64 scalars)."""

    # A public field name that shadows tuple.count, which mypy rejects in a NamedTuple.
    count: torch.Tensor  # type: ignore[assignment]
    mean: torch.Tensor
    m2: torch.Tensor


class RewardNormalizer(NamedTuple):
    """Running reward normalisation as pure functions (optax style).

    ``init(device=None) -> RunningMomentsState`` and
    ``update(rewards, mask, state, *, process_group=None) -> (normalised, state)``: the
    convention every ``(init, update)`` pair of rlcore follows (data tensors, then the
    state, positional; options keyword-only; see :class:`rlcore.algos.KLController`).
    """

    init: Callable[..., RunningMomentsState]
    update: Callable[..., tuple[torch.Tensor, RunningMomentsState]]


def running_reward_normalizer(*, shift_mean: bool = True, eps: float = 1e-8) -> RewardNormalizer:
    """Normalise rewards by the running mean and std of all rewards seen so far (batch included).

    Reference: the reward normalisation of OpenAI Baselines' ``VecNormalize`` and of
    TRL/OpenRLHF's ``RunningMoments``; merging by Chan et al., "Updating Formulae and a
    Pairwise Algorithm for Computing Sample Variances" (1979).

    ``update`` first merges the batch into the running statistics (exactly, with Chan's
    formula; across data-parallel ranks with one all-reduce when a process group is
    given) and then returns ``(r - mean) / sqrt(var + eps)`` with the merged mean and
    unbiased variance (``r / sqrt(var + eps)`` with ``shift_mean=False``). Elements with
    mask 0 neither count nor change (they come back as 0). A non-finite reward (NaN,
    inf) does not enter the statistics, so one bad batch cannot make them NaN for the
    rest of the run; it comes back non-finite, for the caller to see. Rewards are
    data: the output carries no gradient.

    Args:
      shift_mean: subtract the running mean (True) or only rescale (False).
      eps: added to the variance before the square root.

    Returns:
      A :class:`RewardNormalizer`.

    >>> norm = running_reward_normalizer()
    >>> out, state = norm.update(torch.tensor([1.0, 3.0]), torch.ones(2, dtype=torch.bool), norm.init())
    >>> out, state.count
    (tensor([-0.7071,  0.7071]), tensor(2., dtype=torch.float64))
    """
    check_positive("eps", eps, strict=False, finite=True)

    def init(device: torch.device | str | None = None) -> RunningMomentsState:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return RunningMomentsState(zero, zero, zero)

    def update(
        rewards: torch.Tensor,
        mask: torch.Tensor,
        state: RunningMomentsState,
        *,
        process_group: Any = None,
    ) -> tuple[torch.Tensor, RunningMomentsState]:
        check_floating("rewards", rewards)
        check_tensor("state.count", state.count)
        check_same_shape("mask", mask, "rewards", rewards)
        # Batch statistics in float64 too: they are merged into float64 state, and a
        # float32 batch mean of rewards near 1e4 would be off by 5e-4.
        x = rewards.detach().to(torch.float64)
        # A non-finite reward (a failed scorer's NaN, an inf) is left out of the statistics,
        # which would otherwise stay NaN for the rest of the run; its own output stays NaN.
        finite = torch.isfinite(x)
        weights = torch.where(finite, mask, torch.zeros((), dtype=mask.dtype, device=mask.device))
        _, n_b, mean_b, m2_b = batch_moments(torch.where(finite, x, 0.0), weights, process_group=process_group)
        n_a, mean_a, m2_a = state
        n = n_a + n_b
        delta = mean_b - mean_a
        safe_n = torch.where(n > 0, n, torch.ones_like(n))
        mean = mean_a + delta * n_b / safe_n
        m2 = m2_a + m2_b + delta.square() * n_a * n_b / safe_n
        var = m2 / torch.clamp(n - 1, min=1) * (n > 1)
        total = var + eps
        inv = torch.where(total > 0, torch.rsqrt(torch.where(total > 0, total, 1.0)), 0.0)
        out = (x - mean) * inv if shift_mean else x * inv
        out = torch.where(mask != 0, out, 0.0).to(rewards.dtype)
        return out, RunningMomentsState(n, mean, m2)

    return RewardNormalizer(init, update)
