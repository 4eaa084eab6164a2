"""Reward-model losses: Bradley-Terry on preference pairs (with margin and centring), and a process reward model's step loss.

Each returns a per-pair (``[B]``) or per-step (``[B, S]``) loss in the input dtype and
detached metrics, like the preference losses; reduce with ``.mean()`` (pairs) or
:func:`rlcore.algos.aggregate` (steps, with their mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcore._checks import check_counts, check_floating, check_ndim, check_positive, check_same_shape
from rlcore.algos.preference import pair_metrics
from rlcore.ops import acc_dtype

__all__ = ["bradley_terry_loss", "process_reward_loss"]


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: torch.Tensor | float | None = None,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair Bradley-Terry loss of a reward model, with an optional margin and reward centring.

    Bradley & Terry 1952, "Rank Analysis of Incomplete Block Designs"; the reward-model
    loss of Ouyang et al. 2022 (InstructGPT), arXiv:2203.02155, eq. 1; the margin of
    Touvron et al. 2023 (Llama 2), arXiv:2307.09288, eq. 2; the centring term of
    Eisenstein et al. 2023, "Helping or Herding?", arXiv:2312.09244, as TRL's
    ``RewardTrainer`` (``center_rewards_coefficient``).

    Formula, with ``r_w``, ``r_l`` the rewards of the chosen and rejected response::

        loss_i = -log sigmoid(r_w - r_l - margin_i) + center_coef * (r_w + r_l)^2

    The mean over pairs is TRL's loss. The centring term pulls the rewards towards mean
    0, which the pairwise term leaves free (it sees only differences).

    Args:
      chosen_rewards: ``[B]`` scalar rewards of the preferred responses (with gradient).
      rejected_rewards: ``[B]`` rewards of the other responses.
      margin: ``[B]`` per-pair margins (e.g. Llama 2's preference strength), a number, or
        ``None`` for 0.
      center_coef: weight of the centring term (>= 0; TRL suggests 0.01 when on).

    Returns:
      ``(loss, metrics)``: ``loss`` ``[B]`` in the input dtype; ``metrics`` holds detached
      ``[B]`` tensors ``chosen_rewards``, ``rejected_rewards``, ``margins`` (their
      difference) and ``accuracies`` (1 where the chosen reward is higher).

    >>> loss, m = bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), center_coef=0.01)
    >>> loss, m["accuracies"]
    (tensor([0.3233, 1.3233]), tensor([1., 0.]))
    """
    check_floating("chosen_rewards", chosen_rewards)
    check_ndim("chosen_rewards", chosen_rewards, 1)
    check_floating("rejected_rewards", rejected_rewards)
    check_same_shape("rejected_rewards", rejected_rewards, "chosen_rewards", chosen_rewards)
    check_positive("center_coef", center_coef, strict=False, finite=True)
    acc = acc_dtype(chosen_rewards.dtype)
    rw, rl = chosen_rewards.to(acc), rejected_rewards.to(acc)
    diff = rw - rl
    if isinstance(margin, torch.Tensor):
        check_floating("margin", margin)
        check_same_shape("margin", margin, "chosen_rewards", chosen_rewards)
        diff = diff - margin.detach().to(acc)
    elif margin is not None:
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise ValueError(f"margin: got {type(margin).__name__}, expected None, a number or a [B] tensor")
        diff = diff - margin
    loss = F.softplus(-diff)  # -log sigmoid(diff), stable for large |diff|
    if center_coef:
        loss = loss + center_coef * (rw + rl).square()
    return loss.to(chosen_rewards.dtype), pair_metrics(rw, rl, chosen_rewards.dtype)


def process_reward_loss(
    step_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-step loss of a process reward model: binary cross-entropy of each step's correctness.

    Lightman et al. 2023, "Let's Verify Step by Step", arXiv:2305.20050 (a PRM predicts,
    at the end of each reasoning step, whether the step is correct); Wang et al. 2024,
    "Math-Shepherd", arXiv:2312.08935 (soft labels: the rate at which rollouts from the
    step reach the answer). TRL's ``PRMTrainer`` trains the same with a two-class head.

    Formula, with ``z`` the step's logit and ``y`` its label in ``[0, 1]``::

        loss_s = -(y log sigmoid(z) + (1 - y) log sigmoid(-z))

    Args:
      step_logits: ``[B, S]`` one logit per step (the head's output at each step's last token).
      labels: ``[B, S]`` step labels, 1 correct, 0 wrong, or soft values in ``[0, 1]``.
      mask: ``[B, S]``, 1 where a step exists.

    Returns:
      ``(loss_s, metrics)``: ``loss_s`` ``[B, S]`` in ``step_logits.dtype``, 0 where the mask is 0;
      ``accuracy`` is the fraction of counted steps whose sign matches its label's side
      of 0.5 (a float32 scalar).

    >>> loss, m = process_reward_loss(torch.tensor([[2.0, -1.0]]), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
    >>> loss, m["accuracy"]
    (tensor([[0.1269, 1.3133]]), tensor(0.5000))
    """
    check_floating("step_logits", step_logits)
    check_ndim("step_logits", step_logits, 2)
    check_floating("labels", labels)
    check_same_shape("labels", labels, "step_logits", step_logits)
    check_same_shape("mask", mask, "step_logits", step_logits)
    if mask.dtype != torch.bool:
        check_counts("mask", mask)
    acc = acc_dtype(step_logits.dtype)
    keep = mask != 0
    z = torch.where(keep, step_logits.to(acc), 0.0)
    y = torch.where(keep, labels.detach().to(acc), 0.0)
    loss = torch.where(keep, F.binary_cross_entropy_with_logits(z, y, reduction="none"), 0.0)
    with torch.no_grad():
        weights = torch.where(keep, mask.to(acc), 0.0)
        right = ((z > 0) == (y > 0.5)).to(acc)
        total = weights.sum()
        accuracy = ((right * weights).sum() / torch.where(total > 0, total, 1.0)).float()
    return loss.to(step_logits.dtype), {"accuracy": accuracy}
