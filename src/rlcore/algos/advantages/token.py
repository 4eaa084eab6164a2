"""Token-level advantage estimators: GAE, REINFORCE++ and REINFORCE++ with a group baseline.

All three run on ``[B, T]`` right-padded tensors with an explicit ``mask``. Tokens with
mask 0 *inside* a response (observation tokens of a multi-turn rollout) are not time
steps: they carry the running quantities through unchanged and their rewards and
values are ignored, so padding may hold anything, even NaN. Every recurrence runs on
:func:`rlcore.ops.reverse_linear_scan` (no Python loop over ``T``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlcore._checks import check_floating, check_ndim, check_positive, check_same_shape, check_shape
from rlcore.algos._groups import check_outcome
from rlcore.algos.advantages.normalize import batch_normalize
from rlcore.ops import acc_dtype, reverse_linear_scan, segment_centred

__all__ = ["gae", "reinforce_pp_advantages", "reinforce_pp_baseline_advantages"]


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
