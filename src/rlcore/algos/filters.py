"""Sample filters: DAPO dynamic sampling, and importance weights / rejection for rollout-training mismatch.

Everything returns a mask or weights with the shape of its input, computed on the
device without a host sync, except :func:`dynamic_sampling_indices`, whose output
size depends on the data (it reads one count back by design).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rlcore._checks import check_choice, check_floating, check_ndim, check_positive, check_same_shape
from rlcore.algos._groups import check_outcome
from rlcore.ops import acc_dtype

__all__ = [
    "RefillPick",
    "dynamic_sampling_indices",
    "dynamic_sampling_mask",
    "informative_groups",
    "refill_groups",
    "rejection_mask",
    "truncated_is_weights",
]

_IS_LEVELS = ("token", "sequence")
_RS_LEVELS = ("token", "sequence", "geometric")


def dynamic_sampling_mask(
    scores: torch.Tensor, group_ids: torch.Tensor, *, num_groups: int | None = None
) -> torch.Tensor:
    """DAPO dynamic sampling as a mask: keep the samples whose group's scores are not all equal.

    Reference: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale", arXiv 2503.14476 (keep a prompt only if ``0 < #correct < G``).

    Formula: ``keep_i = max_{j in g(i)} s_j != min_{j in g(i)} s_j``; exact comparison,
    so it agrees with a group advantage that is exactly 0. A group of one sample is
    dropped (its GRPO / RLOO advantage is 0); verl's DAPO trainer keeps it. A group
    with any non-finite score (NaN from a failed reward, inf) is dropped too: its
    group mean and std are NaN, so none of its samples has a usable advantage.

    Args:
      scores: ``[B]`` sequence scores.
      group_ids: ``[B]`` integer group of each sample.
      num_groups: number of groups; ``None`` uses ``B`` (no host sync).

    Returns:
      ``[B]`` bool, True for samples to keep.

    >>> dynamic_sampling_mask(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    tensor([ True,  True, False, False])
    >>> dynamic_sampling_mask(torch.tensor([1.0, 0.0, float("nan"), 1.0]), torch.tensor([0, 0, 1, 1]))
    tensor([ True,  True, False, False])
    """
    n = check_outcome(scores, group_ids, num_groups)
    return _informative(scores, group_ids, n)[group_ids.long()]


def _informative(scores: torch.Tensor, group_ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` bool: group ``g`` has samples, all finite, not all equal (a group absent from the batch is False)."""
    s = scores.detach()
    idx = group_ids.long()
    bad = ~torch.isfinite(s)
    # A group with a NaN or inf score has no usable advantage (its group statistics are NaN): dropped.
    spoiled = torch.zeros(n, dtype=torch.int32, device=s.device).index_add(0, idx, bad.to(torch.int32)) > 0
    s = torch.where(bad, 0.0, s)
    hi = s.new_zeros(n).scatter_reduce(0, idx, s, "amax", include_self=False)
    lo = s.new_zeros(n).scatter_reduce(0, idx, s, "amin", include_self=False)
    return (hi != lo) & ~spoiled


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor, *, num_groups: int | None = None) -> torch.Tensor:
    """Per group, whether DAPO's dynamic sampling keeps it: its scores are finite and not all equal.

    The group-level form of :func:`dynamic_sampling_mask` (``mask = informative_groups(...)[group_ids]``);
    an id in ``[0, num_groups)`` that no sample carries is False.

    Args:
      scores: ``[B]`` sequence scores.
      group_ids: ``[B]`` integer group of each sample.
      num_groups: number of groups; ``None`` uses ``B`` (no host sync).

    Returns:
      ``[num_groups]`` bool.

    >>> informative_groups(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), num_groups=3)
    tensor([ True, False, False])
    """
    n = check_outcome(scores, group_ids, num_groups)
    return _informative(scores, group_ids, n)


class RefillPick(NamedTuple):
    """What :func:`refill_groups` picked.

    Fields:
      groups: ``[wanted]`` int64, the picked group ids in increasing order, then -1 in
        each slot no informative group was left for.
      valid: ``[wanted]`` bool, True where ``groups`` holds a group.
      shortfall: ``[]`` int64, the slots left empty (``wanted - valid.sum()``).
    """

    groups: torch.Tensor
    valid: torch.Tensor
    shortfall: torch.Tensor


def refill_groups(
    scores: torch.Tensor, group_ids: torch.Tensor, *, wanted: int, num_groups: int | None = None
) -> RefillPick:
    """Filter-and-refill: the first ``wanted`` informative groups of the candidates drawn so far.

    Reference: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale", arXiv 2503.14476, dynamic sampling: prompts are drawn and sampled again
    until the batch holds ``wanted`` groups with ``0 < #correct < G``, under a bound
    on the draws (verl's ``max_num_gen_batches``).

    The candidates are numbered in the order they were drawn (``group_ids``); the pick
    is the ``wanted`` lowest ids among the informative groups (:func:`informative_groups`),
    so a later draw only fills what the earlier ones left. A zero-variance or
    non-finite group is never picked: when fewer than ``wanted`` are informative, the
    rest of the slots are empty (-1) and counted in ``shortfall``. No host sync (the
    output size is ``wanted``).

    Args:
      scores: ``[B]`` sequence scores of every candidate sample.
      group_ids: ``[B]`` integer group of each sample, in draw order.
      wanted: groups the batch needs (an int >= 0).
      num_groups: number of candidate groups; ``None`` uses ``B``.

    Returns:
      :class:`RefillPick` ``(groups [wanted], valid [wanted], shortfall [])``.

    >>> s = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    >>> refill_groups(s, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), wanted=3)
    RefillPick(groups=tensor([ 1,  3, -1]), valid=tensor([ True,  True, False]), shortfall=tensor(1))
    """
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 0:
        raise ValueError(f"wanted: got {wanted!r}, expected an int >= 0 (groups the batch needs)")
    n = check_outcome(scores, group_ids, num_groups)
    ok = _informative(scores, group_ids, n)
    device = scores.device
    ids = torch.arange(n, device=device)
    # Informative groups rank above the rest, earlier draws above later ones; topk's order is the pick's.
    key = torch.where(ok, n - ids, 0)
    k = min(wanted, n)
    _, top = torch.topk(key, k, sorted=True)
    valid = torch.cat([ok[top], torch.zeros(wanted - k, dtype=torch.bool, device=device)])
    groups = torch.where(valid, torch.cat([top, torch.zeros(wanted - k, dtype=torch.long, device=device)]), -1)
    shortfall = torch.clamp(wanted - ok.sum(), min=0).to(torch.int64)
    return RefillPick(groups, valid, shortfall)


def dynamic_sampling_indices(
    scores: torch.Tensor, group_ids: torch.Tensor, *, num_groups: int | None = None
) -> torch.Tensor:
    """DAPO dynamic sampling as indices: the positions :func:`dynamic_sampling_mask` keeps.

    Use it to gather the kept samples out of a batch (``tree_index(batch, idx)``). The
    number of kept samples depends on the scores, so this reads it back from the device
    (one host sync); inside a compiled step, use the mask instead.

    Args:
      scores: ``[B]`` sequence scores.
      group_ids: ``[B]`` integer group of each sample.
      num_groups: number of groups; ``None`` uses ``B``.

    Returns:
      ``[K]`` int64 indices in increasing order.

    >>> dynamic_sampling_indices(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    tensor([0, 1])
    """
    keep = dynamic_sampling_mask(scores, group_ids, num_groups=num_groups)
    return torch.nonzero(keep).squeeze(-1)  # sync-ok: the output size is data-dependent by definition


def _check_logps(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> None:
    check_ndim("logp", logp, 2)
    check_floating("logp", logp)
    check_floating("rollout_logp", rollout_logp)
    check_same_shape("rollout_logp", rollout_logp, "logp", logp)
    check_same_shape("mask", mask, "logp", logp)


def _log_ratios(
    logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    on = mask != 0
    acc = acc_dtype(logp.dtype)
    log_rho = torch.where(on, logp.detach().to(acc) - rollout_logp.detach().to(acc), 0.0)
    return log_rho, on


def truncated_is_weights(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    cap: float = 2.0,
) -> torch.Tensor:
    """Truncated importance-sampling weights correcting the rollout engine / trainer mismatch.

    Reference: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy
    RL Training" (2025, truncated IS, TIS); Liu, Li et al., "When Speed Kills
    Stability" (2025, sequence-level IS); Ionides, "Truncated Importance Sampling" (2008).

    Formula, with ``rho_t = pi_train(y_t) / pi_rollout(y_t) = exp(logp_t - rollout_logp_t)``::

        token:     w_t = min(rho_t, cap)
        sequence:  w_t = min(prod_{s in seq} rho_s, cap)   (same weight on every token)

    The product is formed in log space and truncated before ``exp``, so it cannot
    overflow; peers clamp the log-ratio to +-20 first, which distorts nothing only
    because the cap is far below ``e^20``. The weights are detached (a constant factor
    on the per-token loss).

    Args:
      logp: ``[B, T]`` log-probs of the sampled tokens under the training engine
        (the proximal policy, or the current one in bypass mode).
      rollout_logp: ``[B, T]`` log-probs the rollout engine reported.
      mask: ``[B, T]``; 1 marks a generated token.
      level: ``"token"`` or ``"sequence"``.
      cap: truncation threshold ``C`` (> 0; verl's default 2).

    Returns:
      ``[B, T]`` weights in ``logp.dtype``, 0 where the mask is 0.

    >>> lp = torch.tensor([[0.0, 0.0]]); rl = torch.tensor([[-0.5, -2.0]])
    >>> truncated_is_weights(lp, rl, torch.ones(1, 2))
    tensor([[1.6487, 2.0000]])
    """
    _check_logps(logp, rollout_logp, mask)
    check_choice("level", level, _IS_LEVELS)
    check_positive("cap", cap)
    log_rho, on = _log_ratios(logp, rollout_logp, mask)
    if level == "sequence":
        log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho)
    w = torch.exp(torch.clamp(log_rho, max=math.log(cap)))
    return torch.where(on, w, 0.0).to(logp.dtype)


def rejection_mask(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    high: float = 2.0,
    low: float | None = None,
    veto: float | None = None,
) -> torch.Tensor:
    """Rejection sampling for rollout / trainer mismatch: drop tokens or sequences with outlying ratios.

    Reference: Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse
    from the Training-Inference Mismatch" (2025); verl's rollout correction.

    With ``rho_t = exp(logp_t - rollout_logp_t)`` over the counted tokens, a token /
    sequence is kept when its statistic lies in ``[low, high]``::

        token:      rho_t
        sequence:   prod_t rho_t
        geometric:  (prod_t rho_t) ** (1 / |seq|)      (typical bounds 1 +- 1e-3)

    and, with ``veto`` set, a sequence is dropped whole if any token has
    ``rho_t < veto``. Comparisons are made in log space.

    Args:
      logp: ``[B, T]`` log-probs of the sampled tokens under the training engine.
      rollout_logp: ``[B, T]`` log-probs the rollout engine reported.
      mask: ``[B, T]``; 1 marks a generated token.
      level: ``"token"``, ``"sequence"`` or ``"geometric"``.
      high: upper bound on the ratio (> 0).
      low: lower bound; ``None`` uses ``1 / high``.
      veto: per-token catastrophe threshold, or ``None``.

    Returns:
      The mask with rejected tokens set to 0, in ``mask.dtype``.

    >>> lp = torch.tensor([[0.0, 0.0], [0.0, 0.0]]); rl = torch.tensor([[0.0, -1.0], [0.0, 0.1]])
    >>> rejection_mask(lp, rl, torch.ones(2, 2), level="sequence")
    tensor([[0., 0.],
            [1., 1.]])
    """
    _check_logps(logp, rollout_logp, mask)
    check_choice("level", level, _RS_LEVELS)
    check_positive("high", high)
    lo = 1.0 / high if low is None else low
    check_positive("low", lo)
    if lo > high:
        raise ValueError(f"low: got {lo!r}, expected a number <= high ({high!r})")
    log_rho, on = _log_ratios(logp, rollout_logp, mask)
    if level == "token":
        stat = log_rho
    else:
        total = log_rho.sum(dim=-1, keepdim=True)
        if level == "geometric":
            total = total / torch.clamp(on.sum(dim=-1, keepdim=True), min=1).to(total.dtype)
        stat = total.expand_as(log_rho)
    keep = (stat >= math.log(lo)) & (stat <= math.log(high))
    if veto is not None:
        check_positive("veto", veto)
        vetoed = (on & (log_rho < math.log(veto))).any(dim=-1, keepdim=True)
        keep = keep & ~vetoed
    return torch.where(keep & on, mask, torch.zeros_like(mask))
