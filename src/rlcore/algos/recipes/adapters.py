"""Batch adapters: lift tensor-level estimators and shaping functions to ``batch -> ...`` steps.

Estimator adapters return a dict of *new* leaves (``"advantages"``, maybe
``"returns"``); shaping adapters return the whole batch, changed. All of them read
documented keys and are meant to be bound with ``functools.partial``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlcore.algos.advantages import batch_normalize, gae, optimal_token_baseline_advantages
from rlcore.algos.filters import dynamic_sampling_mask
from rlcore.algos.kl import kl_in_reward, kl_penalty
from rlcore.algos.recipes.algorithm import Batch, batch_entry, with_group
from rlcore.algos.shaping import overlong_penalty, scores_to_token_rewards
from rlcore.ops import masked_sum

__all__ = [
    "dynamic_sampling_filter",
    "gae_advantages",
    "kl_reward_shaping",
    "kl_score_shaping",
    "outcome_advantages",
    "overlong_shaping",
    "score_scaling",
    "token_advantages",
    "token_baseline_advantages",
    "token_rewards_shaping",
]


def outcome_advantages(batch: Batch, *, estimator: Callable[..., torch.Tensor], process_group: Any = None) -> Batch:
    """Run an outcome estimator on ``scores`` and ``group_ids`` and spread its ``[B]`` result over the tokens.

    ``estimator(scores, group_ids) -> [B]``, e.g. ``partial(grpo_advantages, scale="group")``.
    ``process_group`` (data parallel) reaches an estimator that takes it (GRPO's
    ``scale="batch"`` std over every rank); groups never straddle ranks.

    >>> from functools import partial
    >>> from rlcore.algos import rloo_advantages
    >>> batch = {"scores": torch.tensor([1.0, 0.0]), "group_ids": torch.tensor([0, 0]),
    ...          "mask": torch.tensor([[1, 1], [1, 0]])}
    >>> outcome_advantages(batch, estimator=rloo_advantages)["advantages"]
    tensor([[ 1.,  1.],
            [-1.,  0.]])
    """
    scores = batch_entry(batch, "scores", "sequence scores [B]")
    groups = batch_entry(batch, "group_ids", "groups [B]")
    adv = with_group(estimator, process_group)(scores, groups)
    mask = batch_entry(batch, "mask", "the token mask")
    return {"advantages": torch.where(mask != 0, adv[:, None], torch.zeros((), dtype=adv.dtype, device=adv.device))}


def token_advantages(batch: Batch, *, estimator: Callable[..., torch.Tensor], process_group: Any = None) -> Batch:
    """Run a token-level estimator ``estimator(rewards, mask) -> [B, T]`` on ``rewards`` and ``mask``.

    E.g. ``partial(reinforce_pp_advantages, gamma=1.0)``; ``process_group`` (data
    parallel) reaches an estimator that takes it, to whiten over every rank's tokens.
    """
    rewards = batch_entry(batch, "rewards", "token rewards [B, T]")
    mask = batch_entry(batch, "mask", "the token mask")
    return {"advantages": with_group(estimator, process_group)(rewards, mask)}


def token_baseline_advantages(
    batch: Batch, *, handle_zero_tail: bool = True, multi_turn: bool = False, eps: float = 1e-8
) -> Batch:
    """The optimal token baseline (:func:`rlcore.algos.optimal_token_baseline_advantages`) on the batch's token ``rewards``.

    Reads ``rewards``, ``old_logp`` and ``sum_pi_squared`` (the rollout policy's, from its
    forward: :func:`rlcore.ops.linear_logprobs` ``with_sum_pi_squared``), ``mask`` and
    ``group_ids``. Single-turn lines the responses up by position; ``multi_turn=True``
    (verl's ``tir_optimal_token_baseline``) lines up the ``k``-th policy token of each
    trajectory, so the observation tokens (mask 0 inside a response) take no part in the
    returns, the path variances or the baseline. Put ``scores`` on the last token first
    (:func:`token_rewards_shaping`), or give each turn's reward as ``rewards``.

    >>> batch = {"rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0]]), "old_logp": torch.full((2, 2), -0.7),
    ...          "sum_pi_squared": torch.full((2, 2), 0.5), "mask": torch.ones(2, 2), "group_ids": torch.tensor([0, 0])}
    >>> token_baseline_advantages(batch)["advantages"]
    tensor([[ 0.5000,  0.5000],
            [-0.5000, -0.5000]])
    """
    adv, _ = optimal_token_baseline_advantages(
        batch_entry(batch, "rewards", "token rewards [B, T]"),
        batch_entry(batch, "old_logp", "rollout-policy log-probs"),
        batch_entry(batch, "sum_pi_squared", "the rollout policy's sum_v pi(v)^2 per token [B, T]"),
        batch_entry(batch, "mask", "the token mask"),
        batch_entry(batch, "group_ids", "groups [B]"),
        handle_zero_tail=handle_zero_tail,
        multi_turn=multi_turn,
        eps=eps,
    )
    return {"advantages": adv}


def gae_advantages(
    batch: Batch, *, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True, process_group: Any = None
) -> Batch:
    """GAE on ``rewards`` and the rollout critic's ``old_values``; advantages whitened over the batch.

    Returns ``{"advantages", "returns"}``; the returns (value targets) are not whitened.
    With ``process_group`` (data parallel) the whitening's moments are those of every
    rank's tokens (:func:`rlcore.algos.batch_normalize`), as one process would take them.
    """
    mask = batch_entry(batch, "mask", "the token mask")
    adv, returns = gae(
        batch_entry(batch, "rewards", "token rewards [B, T]"),
        batch_entry(batch, "old_values", "rollout critic values [B, T]"),
        mask,
        gamma=gamma,
        lam=lam,
    )
    if whiten:
        adv = batch_normalize(adv, mask, process_group=process_group)
    return {"advantages": adv, "returns": returns}


def token_rewards_shaping(batch: Batch) -> Batch:
    """Put each sequence's ``scores`` on its last counted token as ``rewards`` (unless ``rewards`` is given)."""
    if "rewards" in batch:
        return batch
    return {
        **batch,
        "rewards": scores_to_token_rewards(batch_entry(batch, "scores", "sequence scores [B]"), batch["mask"]),
    }


def kl_reward_shaping(batch: Batch, *, kl_coef: float, estimator: str = "k1") -> Batch:
    """Fold ``kl_coef * KL(old_logp || ref_logp)`` per token into ``rewards`` (RLHF's KL reward).

    With ``kl_coef == 0`` the batch is returned as it is: nothing is read, so a recipe
    without a KL penalty needs no reference forward.
    """
    if kl_coef == 0:
        return batch
    rewards, _ = kl_in_reward(
        batch_entry(batch, "rewards", "token rewards [B, T]"),
        batch_entry(batch, "old_logp", "rollout-policy log-probs"),
        batch_entry(batch, "ref_logp", "reference log-probs"),
        batch["mask"],
        kl_coef=kl_coef,
        estimator=estimator,
    )
    return {**batch, "rewards": rewards}


def kl_score_shaping(batch: Batch, *, kl_coef: float, estimator: str = "k1") -> Batch:
    """Subtract ``kl_coef`` times the sequence KL (sum over tokens) from ``scores``: RLOO's KL reward.

    With ``kl_coef == 0`` the batch is returned as it is (nothing is read).
    """
    if kl_coef == 0:
        return batch
    mask = batch_entry(batch, "mask", "the token mask")
    on = mask != 0
    old_logp = torch.where(on, batch_entry(batch, "old_logp", "rollout-policy log-probs"), 0.0)
    ref_logp = torch.where(on, batch_entry(batch, "ref_logp", "reference log-probs"), 0.0)
    seq_kl = masked_sum(kl_penalty(old_logp.detach(), ref_logp.detach(), estimator=estimator).float(), mask, dim=-1)
    scores = batch_entry(batch, "scores", "sequence scores [B]")
    return {**batch, "scores": (scores.float() - kl_coef * seq_kl).to(scores.dtype)}


def dynamic_sampling_filter(batch: Batch) -> Batch:
    """DAPO dynamic sampling without a host sync: zero the ``mask`` of groups whose ``scores`` are all equal."""
    keep = dynamic_sampling_mask(
        batch_entry(batch, "scores", "sequence scores [B]"), batch_entry(batch, "group_ids", "groups [B]")
    )
    mask = batch_entry(batch, "mask", "the token mask")
    return {**batch, "mask": mask * keep[:, None].to(mask.dtype)}


def overlong_shaping(batch: Batch, *, max_length: int = 20480, cache_length: int = 4096) -> Batch:
    """Add DAPO's overlong penalty to ``scores``; lengths from ``lengths`` or the mask's token count."""
    scores = batch_entry(batch, "scores", "sequence scores [B]")
    lengths = batch["lengths"] if "lengths" in batch else (batch_entry(batch, "mask", "the token mask") != 0).sum(-1)
    penalty = overlong_penalty(lengths, max_length=max_length, cache_length=cache_length)
    return {**batch, "scores": (scores.float() + penalty.float()).to(scores.dtype)}


def score_scaling(batch: Batch, *, coef: float) -> Batch:
    """Scale ``scores`` by ``coef``: the weight of the task reward beside another signal (0: none of it).

    >>> score_scaling({"scores": torch.tensor([1.0, 0.5])}, coef=0.5)["scores"]
    tensor([0.5000, 0.2500])
    """
    if coef == 1:
        return batch
    scores = batch_entry(batch, "scores", "sequence scores [B]")
    return {**batch, "scores": (scores.float() * coef).to(scores.dtype)}
