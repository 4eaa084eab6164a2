"""Supervised recipes: SFT on demonstrations and a reward model on preference pairs, in the :class:`Recipe` shape.

Like :class:`rlcore.algos.DPO`, each is tensor-in: a forward stage outside this package
turns token rows into the columns read here, and the one update stage calls
``recipe.loss(micro_batch, **recipe.global_counts(batch))``.

Batch layouts (dicts)::

    SFT:  logp [B, T]  the policy's log-prob of each token (with gradient);  mask [B, T]  1 on response tokens
    RM:   chosen_rewards, rejected_rewards [P]  the scalar head's rewards of both sides (with gradient)
          step_logits, step_labels, step_mask [B, S]  (optional) a process reward model's step outputs
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from rlcore._checks import check_choice, check_count, check_ndim, check_positive
from rlcore.algos.aggregate import aggregate, global_counts
from rlcore.algos.collectives import group_sum
from rlcore.algos.reward_model import bradley_terry_loss, process_reward_loss
from rlcore.algos.supervised import sft_loss

__all__ = ["RM", "SFT", "SFT_LOSS_MODES", "rm", "sft"]

Metrics = dict[str, torch.Tensor]
Count = int | float | torch.Tensor
#: ``rl.sft_loss`` -> the :func:`rlcore.algos.aggregate` mode it names.
SFT_LOSS_MODES = {"token-mean": "token-mean", "seq-mean": "seq-mean-token-mean"}


def _entry(batch: Mapping[str, Any], key: str, why: str) -> torch.Tensor:
    if key not in batch:
        raise ValueError(f"batch: got keys {sorted(batch)}, expected {key!r} ({why})")
    return batch[key]


class SFT(NamedTuple):
    """Supervised fine-tuning: ``loss = aggregate(-logp, mask, mode=agg_mode)`` with the whole batch's counts.

    Fields:
      agg_mode: ``"token-mean"`` (every response token weighs the same, TRL's default) or
        ``"seq-mean-token-mean"`` (every example weighs the same).

    >>> recipe = sft()
    >>> batch = {"logp": torch.tensor([[-1.0, -3.0], [-2.0, 0.0]]), "mask": torch.tensor([[1, 1], [1, 0]])}
    >>> recipe.loss(batch, **recipe.global_counts(batch))[0]
    tensor(2.)
    """

    agg_mode: str = "token-mean"

    def global_counts(self, batch: Mapping[str, Any], *, process_group: Any = None) -> dict[str, torch.Tensor]:
        """``{"num_tokens", "num_seqs"}`` of ``batch["mask"]`` (:func:`rlcore.algos.global_counts`)."""
        return global_counts(_entry(batch, "mask", "the response-token mask"), process_group=process_group)

    def metric_weight(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Its metrics are token means: weighted by the mask's total."""
        return _entry(batch, "mask", "the response-token mask").float().sum()

    def metric_reductions(self) -> dict[str, str]:
        """All metrics are weighted means (an empty dict)."""
        return {}

    def loss(
        self, batch: Mapping[str, Any], *, num_tokens: Count | None = None, num_seqs: Count | None = None
    ) -> tuple[torch.Tensor, Metrics]:
        """The scalar SFT loss of a (micro-)batch and detached metrics (``nll``, the token-mean NLL)."""
        logp = _entry(batch, "logp", "the policy's token log-probs")
        mask = _entry(batch, "mask", "the response-token mask")
        loss_t, metrics = sft_loss(logp, mask)
        return aggregate(loss_t, mask, mode=self.agg_mode, num_tokens=num_tokens, num_seqs=num_seqs), metrics


def sft(*, loss: str = "token-mean") -> SFT:
    """Build an SFT recipe; ``loss`` is ``"token-mean"`` or ``"seq-mean"`` (:data:`SFT_LOSS_MODES`)."""
    check_choice("loss", loss, SFT_LOSS_MODES)
    return SFT(agg_mode=SFT_LOSS_MODES[loss])


class RM(NamedTuple):
    """Reward-model training: Bradley-Terry over pairs, plus an optional process-reward loss over steps.

    ``loss = sum_p bt_p / num_pairs + process_coef * sum_s prm_s / num_steps`` with
    :func:`rlcore.algos.bradley_terry_loss` (``margin``, ``center_coef``) and
    :func:`rlcore.algos.process_reward_loss` (read only when the batch holds
    ``step_logits``). A batch column ``margins`` ``[P]`` overrides ``margin`` per pair.

    >>> recipe = rm()
    >>> batch = {"chosen_rewards": torch.tensor([0.0]), "rejected_rewards": torch.tensor([0.0])}
    >>> recipe.loss(batch, **recipe.global_counts(batch))[0]  # log 2
    tensor(0.6931)
    """

    margin: float | None = None
    center_coef: float = 0.0
    process_coef: float = 1.0

    def global_counts(self, batch: Mapping[str, Any], *, process_group: Any = None) -> dict[str, torch.Tensor]:
        """``{"num_pairs"}`` (and ``{"num_steps"}`` with step columns), summed over ``process_group`` (one all-reduce)."""
        pairs = _entry(batch, "chosen_rewards", "the chosen responses' rewards")
        check_ndim("chosen_rewards", pairs, 1)
        counts = [torch.tensor(float(pairs.shape[0]), device=pairs.device)]
        if "step_mask" in batch:
            counts.append(batch["step_mask"].float().sum())
        total = group_sum(torch.stack(counts), process_group=process_group)
        out = {"num_pairs": total[0]}
        if "step_mask" in batch:
            out["num_steps"] = total[1]
        return out

    def metric_weight(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Metrics are means over pairs: weighted by the pair count."""
        pairs = _entry(batch, "chosen_rewards", "the chosen responses' rewards")
        return torch.tensor(float(pairs.shape[0]), device=pairs.device)

    def metric_reductions(self) -> dict[str, str]:
        """All metrics are weighted means (an empty dict)."""
        return {}

    def loss(
        self, batch: Mapping[str, Any], *, num_pairs: Count | None = None, num_steps: Count | None = None
    ) -> tuple[torch.Tensor, Metrics]:
        """The scalar reward-model loss; metrics: the pair metrics' local means (``accuracies`` the ranking accuracy)."""
        check_count("num_pairs", num_pairs)
        chosen = _entry(batch, "chosen_rewards", "the chosen responses' rewards")
        rejected = _entry(batch, "rejected_rewards", "the rejected responses' rewards")
        margin = batch.get("margins", self.margin)
        per_pair, pair_metrics = bradley_terry_loss(chosen, rejected, margin=margin, center_coef=self.center_coef)
        den = torch.as_tensor(per_pair.shape[0] if num_pairs is None else num_pairs, device=per_pair.device).float()
        loss = per_pair.float().sum() / torch.where(den > 0, den, torch.ones_like(den))
        metrics = {k: v.float().sum() / max(v.numel(), 1) for k, v in pair_metrics.items()}
        if "step_logits" in batch:
            step_mask = _entry(batch, "step_mask", "the steps that exist")
            steps_t, step_metrics = process_reward_loss(
                batch["step_logits"], _entry(batch, "step_labels", "the step labels"), step_mask
            )
            loss = loss + self.process_coef * aggregate(steps_t.float(), step_mask, num_tokens=num_steps)
            metrics["step_accuracy"] = step_metrics["accuracy"]
        return loss, metrics


def rm(*, margin: float | None = None, center_coef: float = 0.0, process_coef: float = 1.0) -> RM:
    """Build a reward-model recipe (Bradley-Terry with ``margin`` and ``center_coef``; ``process_coef`` weighs step labels)."""
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))):
        raise ValueError(f"margin: got {margin!r}, expected None or a number")
    check_positive("center_coef", center_coef, strict=False, finite=True)
    check_positive("process_coef", process_coef, strict=False, finite=True)
    return RM(margin=margin, center_coef=float(center_coef), process_coef=float(process_coef))
