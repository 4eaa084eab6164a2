"""Token-level advantage estimators: GAE, REINFORCE++, REINFORCE++ with a group baseline, the optimal token baseline.

All of them run on ``[B, T]`` right-padded tensors with an explicit ``mask``. Tokens with
mask 0 *inside* a response (observation tokens of a multi-turn rollout) are not time
steps: they carry the running quantities through unchanged and their rewards and
values are ignored, so padding may hold anything, even NaN. Every recurrence runs on
:func:`rlcore.ops.reverse_linear_scan` (no Python loop over ``T``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlcore._checks import (
    check_floating,
    check_group_ids,
    check_integer,
    check_ndim,
    check_positive,
    check_same_shape,
    check_shape,
)
from rlcore.algos._groups import check_outcome
from rlcore.algos.advantages.normalize import batch_normalize
from rlcore.ops import acc_dtype, reverse_linear_scan, segment_centred, segment_sum

__all__ = ["gae", "optimal_token_baseline_advantages", "reinforce_pp_advantages", "reinforce_pp_baseline_advantages"]


def _check_tokens(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    check_ndim(name, x, 2)
    check_floating(name, x)
    check_same_shape("mask", mask, name, x)


def _check_discount(name: str, value: float) -> None:
    check_positive(name, value, strict=False)
    if value > 1:
        raise ValueError(f"{name}: got {value!r}, expected a number in [0, 1]")


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over token rewards, with observation-token carry-through.

    Reference: Schulman et al., "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", arXiv 1506.02438.

    Formula, over the counted tokens ``t < t'`` (``t'`` the next token with mask 1)::

        delta_t = r_t + gamma * V_{t'} - V_t          (V after the last counted token = 0)
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t

    Tokens with mask 0 are skipped: the next value and the running advantage pass
    through them unchanged, and rewards placed on them are ignored (as verl's multi-turn
    GAE). OpenRLHF and TRL instead zero the rewards and values there but still discount
    across them, so each observation token costs a factor ``gamma * lam``. No whitening
    happens here; compose :func:`rlcore.ops.masked_whiten` or :func:`batch_normalize`.
    With ``gamma = lam = 1``, ``A_t`` is the reward-to-go minus ``V_t``.

    Args:
      rewards: ``[B, T]`` token rewards.
      values: ``[B, T]`` value estimates ``V_t``.
      mask: ``[B, T]``; 1 marks a generated (action) token.
      gamma: discount factor in ``[0, 1]``.
      lam: GAE ``lambda`` in ``[0, 1]``.

    Returns:
      ``(advantages, returns)``, both ``[B, T]`` in the dtype of ``values``, 0 where the
      mask is 0. Differentiable in ``rewards`` and ``values``.

    >>> r = torch.tensor([[0.0, 0.0, 1.0]])
    >>> adv, ret = gae(r, torch.tensor([[0.5, 0.5, 0.5]]), torch.ones(1, 3))
    >>> adv
    tensor([[0.5000, 0.5000, 0.5000]])
    >>> ret
    tensor([[1., 1., 1.]])
    """
    _check_tokens("rewards", rewards, mask)
    check_floating("values", values)
    check_same_shape("values", values, "rewards", rewards)
    _check_discount("gamma", gamma)
    _check_discount("lam", lam)
    acc = acc_dtype(values.dtype)
    on = mask != 0
    r = torch.where(on, rewards.to(acc), 0.0)
    v = torch.where(on, values.to(acc), 0.0)
    # V of the nearest counted token after t (0 past the last one): a reverse running
    # minimum of counted positions, then one gather.
    length = rewards.shape[-1]
    positions = torch.where(on, torch.arange(length, device=on.device), length)
    nearest = positions.flip(-1).cummin(dim=-1).values.flip(-1)
    next_v = F.pad(v, (0, 1)).gather(-1, F.pad(nearest[:, 1:], (0, 1), value=length))
    delta = torch.where(on, r + gamma * next_v - v, 0.0)
    adv = reverse_linear_scan(delta, torch.where(on, delta.new_full((), gamma * lam), 1.0))
    adv = torch.where(on, adv, 0.0)
    returns = torch.where(on, adv + v, 0.0)
    return adv.to(values.dtype), returns.to(values.dtype)


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-8,
    process_group: Any = None,
) -> torch.Tensor:
    """REINFORCE++ advantages: discounted reward-to-go, whitened over the global batch of tokens.

    Reference: Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models", arXiv 2501.03262.

    Formula: ``G_t = r_t + gamma * G_{t'}`` over counted tokens (``t'`` the next counted
    token), then ``A = (G - mean(G)) / sqrt(var(G) + eps)`` with mean and unbiased
    variance over all counted tokens of the batch (of every rank of ``process_group``).

    Observation tokens (mask 0 inside a response) carry ``G`` through unchanged and are
    not discount steps. verl's loop instead resets the running return to 0 at every
    mask-0 token, which drops all later rewards from the tokens before an observation;
    OpenRLHF discounts across observation tokens.

    Args:
      rewards: ``[B, T]`` token rewards (KL already folded in, if any).
      mask: ``[B, T]``; 1 marks a generated token.
      gamma: discount factor in ``[0, 1]``.
      eps: added to the variance before the square root.
      process_group: whiten over all data-parallel ranks of this group (one all-reduce).

    Returns:
      ``[B, T]`` advantages in ``rewards.dtype``, 0 where the mask is 0.

    >>> reinforce_pp_advantages(torch.tensor([[0.0, 1.0], [0.0, 3.0]]), torch.ones(2, 2))
    tensor([[-0.8660, -0.8660],
            [ 0.8660,  0.8660]])
    """
    _check_tokens("rewards", rewards, mask)
    _check_discount("gamma", gamma)
    acc = acc_dtype(rewards.dtype)
    on = mask != 0
    r = torch.where(on, rewards.to(acc), 0.0)
    returns = reverse_linear_scan(r, torch.where(on, r.new_full((), gamma), 1.0))
    return batch_normalize(returns, mask, eps=eps, process_group=process_group).to(rewards.dtype)


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps: float = 1e-8,
    num_groups: int | None = None,
    process_group: Any = None,
) -> torch.Tensor:
    """REINFORCE++-baseline: group-mean-centred scores broadcast to tokens, whitened over the batch.

    Reference: Hu, "REINFORCE++", arXiv 2501.03262 (the variant with a group baseline).

    Formula: ``a_i = s_i - mean_{j in g(i)} s_j``; every counted token of sample ``i``
    gets ``a_i``; then ``A = (a - mean(a)) / sqrt(var(a) + eps)`` over all counted tokens
    of the batch (token-weighted, as verl; of every rank of ``process_group``).

    A group of one sample is centred on itself and gets 0 before whitening; verl uses a
    baseline of 0 there, which passes the raw score through. A non-finite score makes its
    own group's advantages non-finite and is left out of the batch statistics, so every
    other group keeps the advantages it would have without it.

    Args:
      scores: ``[B]`` sequence scores.
      group_ids: ``[B]`` integer group of each sample (prompt), in ``[0, num_groups)``.
      mask: ``[B, T]``; 1 marks a generated token.
      eps: added to the variance before the square root.
      num_groups: number of groups; ``None`` uses ``B`` (no host sync).
      process_group: whiten over all data-parallel ranks of this group (one all-reduce).

    Returns:
      ``[B, T]`` advantages in ``scores.dtype``, 0 where the mask is 0.

    >>> reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 1))
    tensor([[ 0.7071],
            [-0.7071]])
    """
    n = check_outcome(scores, group_ids, num_groups)
    check_ndim("mask", mask, 2)
    check_shape("mask", mask, (scores.shape[0], None), what="[B, T] with B from scores")
    acc = acc_dtype(scores.dtype)
    s = scores.to(acc)
    centred = segment_centred(s, group_ids, num_segments=n)
    tokens = centred[:, None].expand(mask.shape)
    # As grpo_advantages: a non-finite score makes its own group non-finite and stays out
    # of the batch statistics, so it never turns every other group's advantages into NaN.
    finite = torch.isfinite(tokens)
    out = batch_normalize(tokens, torch.where(finite, mask, 0), eps=eps, process_group=process_group)
    return torch.where(finite | (mask == 0), out, tokens).to(scores.dtype)


def _compact(x: torch.Tensor, keep: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s counted values moved to the front, in order (``slot`` is each token's counted index, ``T`` if none)."""
    out = x.new_zeros(x.shape[0], x.shape[1] + 1)
    return out.scatter(1, slot, torch.where(keep, x, 0.0))[:, :-1]


def optimal_token_baseline_advantages(
    rewards: torch.Tensor,
    old_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    multi_turn: bool = False,
    eps: float = 1e-8,
    num_groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline: a per-position group baseline weighted by each path's gradient variance.

    Reference: verl's ``optimal_token_baseline`` and ``tir_optimal_token_baseline``; the
    variance-minimising baseline ``b* = E[G ||grad log pi||^2] / E[||grad log pi||^2]``
    of Weaver & Tao 2001, "The Optimal Reward Baseline for Gradient-Based RL", with the
    squared norm of the logits' score function ``||e_y - pi||^2 = 1 - 2 pi_y + sum_v pi_v^2``.

    Formula, per token ``t`` of response ``i`` in group ``g``::

        G_{i,t} = sum_{s >= t} mask * rewards                   (reward-to-go)
        w_{i,t} = (1 - 2 exp(old_logp_{i,t}) + sum_pi_squared_{i,t}) * rho_{i,t}^2
        W_{i,t} = sum_{s <= t} mask * w                         (the path's variance so far)
        b_{g,t} = sum_{i in g, t counted} G W / (sum_{i in g, t counted} W + eps)
        A_{i,t} = G_{i,t} - b_{g,t}

    with ``rho`` the ``is_weights`` (1 when ``None``). Where only one response of a group
    is present, it has no baseline (``b = 0``, ``A = G``, as in verl): a group of one, and
    with ``handle_zero_tail`` the positions of the longest response beyond all others
    (otherwise its own return would be its baseline there, and its advantage 0).

    ``multi_turn=False`` lines the responses up by position. With ``multi_turn=True`` the
    mask may have holes (tool outputs inside the response) and the ``k``-th counted token
    of each response is lined up with the ``k``-th of the others; a response with no
    counted token then does not count as a member of its group (verl's ``tir_`` variant).

    Args:
      rewards: ``[B, T]`` token rewards (an outcome score on the last counted token).
      old_logp: ``[B, T]`` log-probabilities of the sampled tokens under the rollout policy.
      sum_pi_squared: ``[B, T]`` ``sum_v pi(v)^2`` of the rollout policy at each position,
        e.g. ``torch.softmax(logits, -1).square().sum(-1)``.
      mask: ``[B, T]``, nonzero where a token counts.
      group_ids: ``[B]`` integer group (prompt) of each response, in ``[0, num_groups)``.
      is_weights: optional ``[B, T]`` truncated importance weights ``rho`` (rollout vs
        training engine); ``W`` then weighs by ``rho^2``, minimising the variance of the
        importance-weighted estimator.
      handle_zero_tail: no baseline where a single response of its group is present.
      multi_turn: line the responses up by counted token rather than by position.
      eps: added to the baseline's denominator.
      num_groups: number of groups; ``None`` uses ``B`` (no host sync).

    Returns:
      ``(advantages, returns)``, both ``[B, T]`` in ``rewards.dtype`` and 0 where the mask is 0.

    >>> rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    >>> adv, ret = optimal_token_baseline_advantages(
    ...     rewards, torch.zeros(2, 2) - 0.7, torch.full((2, 2), 0.5), torch.ones(2, 2), torch.tensor([0, 0]))
    >>> adv
    tensor([[ 0.5000,  0.5000],
            [-0.5000, -0.5000]])
    """
    _check_tokens("rewards", rewards, mask)
    for name, x in (("old_logp", old_logp), ("sum_pi_squared", sum_pi_squared)):
        check_floating(name, x)
        check_same_shape(name, x, "rewards", rewards)
    if is_weights is not None:
        check_same_shape("is_weights", is_weights, "rewards", rewards)
    check_ndim("group_ids", group_ids, 1)
    check_integer("group_ids", group_ids)
    check_shape("group_ids", group_ids, (rewards.shape[0],), what="one group per response")
    check_positive("eps", eps, strict=False, finite=True)
    if num_groups is None:
        num_groups = rewards.shape[0]
    elif isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups: got {num_groups!r}, expected a non-negative int (or None for B)")
    check_group_ids(group_ids, num_groups)
    acc = acc_dtype(rewards.dtype)
    keep = mask if mask.dtype == torch.bool else mask != 0
    drop = ~keep
    r = torch.where(keep, rewards.to(acc), 0.0)
    returns = r.flip(-1).cumsum(-1).flip(-1)
    # Fresh buffers from here on: updated in place.
    w = old_logp.detach().to(acc).exp().mul_(-2.0).add_(1.0).add_(sum_pi_squared.to(acc))  # 1 - 2 pi + sum pi^2
    if is_weights is not None:
        w.mul_(is_weights.detach().to(acc).square())
    path = w.masked_fill_(drop, 0.0).cumsum(-1)  # W_t
    if multi_turn:
        counted = keep.cumsum(-1)
        slot = torch.where(keep, counted - 1, rewards.shape[1])
        g_al, w_al = _compact(returns, keep, slot), _compact(path, keep, slot)
        k_al = torch.arange(rewards.shape[1], device=rewards.device) < counted[:, -1:]
        members = (counted[:, -1] > 0).to(acc)
    else:
        g_al, w_al, k_al = returns, path, keep
        members = torch.ones(rewards.shape[0], dtype=acc, device=rewards.device)
    w_on = torch.where(k_al, w_al, 0.0)
    # The baseline is a [G, T] table, read out to the responses once.
    num = segment_sum(g_al * w_on, group_ids, num_segments=num_groups)
    den = segment_sum(w_on, group_ids, num_segments=num_groups)
    sole = (segment_sum(members, group_ids, num_segments=num_groups) == 1)[:, None]
    if handle_zero_tail:
        sole = sole | (segment_sum(k_al.to(acc), group_ids, num_segments=num_groups) == 1)
    index = group_ids if group_ids.dtype in (torch.int32, torch.int64) else group_ids.long()
    baseline = torch.where(sole, 0.0, num / (den + eps)).index_select(0, index)
    adv = g_al - baseline
    if multi_turn:
        adv = adv.gather(1, torch.where(keep, slot, 0))
    return adv.masked_fill_(drop, 0.0).to(rewards.dtype), returns.masked_fill_(drop, 0.0).to(rewards.dtype)
