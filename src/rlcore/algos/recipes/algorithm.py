"""The ``Algorithm`` NamedTuple: an RL algorithm as a composition of pure functions.

Like an optax optimiser, an algorithm is a value, not a class hierarchy: a tuple of the
functions it is made of (advantage estimator, policy loss, KL term, value loss,
shaping) and its coefficients. ``algo._replace(policy_loss=...)`` makes a new one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from rlcore._checks import check_shape
from rlcore.algos.aggregate import aggregate, global_counts
from rlcore.algos.kl import KLController
from rlcore.algos.metric_reduction import RL_METRIC_REDUCTIONS
from rlcore.algos.sharded_aggregate import sequence_sharded_aggregate
from rlcore.ops import masked_mean

__all__ = ["Algorithm", "Batch", "chain"]

Batch = dict[str, Any]
Metrics = dict[str, torch.Tensor]
Count = int | float | torch.Tensor


def batch_entry(batch: Batch, key: str, why: str) -> torch.Tensor:
    if key not in batch:
        raise ValueError(f"batch: got keys {sorted(batch)}, expected a {key!r} entry ({why})")
    return batch[key]


def takes_group(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes a ``process_group`` keyword (or any keyword).

    >>> takes_group(lambda b: b), takes_group(lambda b, *, process_group=None: b)
    (False, True)
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return "process_group" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def with_group(fn: Callable[..., Any], process_group: Any) -> Callable[..., Any]:
    """``fn`` with ``process_group`` bound when a group is given and ``fn`` takes that keyword, else ``fn``."""
    return fn if process_group is None or not takes_group(fn) else partial(fn, process_group=process_group)


def chain(*steps: Callable[[Batch], Batch]) -> Callable[[Batch], Batch]:
    """Compose batch transforms (shaping, filters) left to right, like ``optax.chain``.

    >>> double = lambda b: {**b, "scores": 2 * b["scores"]}
    >>> chain(double, double)({"scores": torch.tensor([1.0])})["scores"]
    tensor([4.])
    """

    def chained(batch: Batch) -> Batch:
        for step in steps:
            batch = step(batch)
        return batch

    chained.steps = steps  # type: ignore[attr-defined]  # read by rlcore.algos.scoring_needs
    return chained


class Algorithm(NamedTuple):
    """An RL algorithm: the pure functions it is composed of, plus its coefficients.

    Fields:
      advantage_estimator: ``batch -> dict`` of new leaves, at least ``"advantages"``
        ``[B, T]`` (GAE also gives ``"returns"``). See :mod:`rlcore.algos.recipes.adapters`.
      policy_loss: ``(logp, old_logp, advantages, mask) -> (loss_t, metrics)``, e.g.
        ``functools.partial(ppo_clip_loss, clip_high=0.28)``.
      kl: ``(logp, ref_logp) -> kl_t`` per-token KL *loss term* (e.g.
        ``partial(kl_penalty, estimator="k3")``), or ``None``.
      kl_coef: weight of ``kl`` in the loss: a number, or a KL controller (an ``(init,
        update)`` pair such as :func:`rlcore.algos.adaptive_kl_controller`), whose
        current coefficient the batch then carries per sample as ``"kl_coef"`` ``[B]``
        (``{**batch, "kl_coef": state.kl_coef.expand(B)}``, so micro-batch slicing
        keeps it); after the step,
        ``state = algo.kl_coef.update(metrics["kl"], state, n_steps=...)``.
      agg_mode: :func:`rlcore.algos.aggregate` mode.
      horizon: ``aggregate``'s horizon for ``"seq-mean-token-sum-norm"``.
      shaping: ``batch -> batch`` applied before the estimator (reward shaping, KL in
        reward, sample filters that zero the mask), or ``None``.
      entropy_coef: weight of the entropy bonus (subtracted from the loss).
      value_loss: ``(values, old_values, returns, mask) -> (loss_t, metrics)``, or ``None``.
      vf_coef: weight of the value loss.
      behaviour_weights: ``(old_logp, rollout_logp, mask) -> w_t``, the decoupled
        objective's per-token weight of the proximal policy (``old_logp``) over the
        behaviour policy that sampled (``rollout_logp``), multiplied into the policy
        loss (:func:`rlcore.algos.decoupled`), or ``None``.
      distill: ``(logits, teacher_logits, mask) -> (loss_t, metrics)``, a per-token
        distillation loss over the vocabulary (e.g. ``partial(generalized_jsd_loss,
        beta=0.0)``, the forward KL), or ``None``.
      distill_coef: weight of ``distill`` in the loss.

    Batch keys (all token leaves ``[B, T]``, sequence leaves ``[B]``): ``mask``, ``logp``
    (current policy, with gradient), ``old_logp`` (rollout policy); ``advantages``, or
    what the estimator reads (``scores`` + ``group_ids``; ``rewards``;
    ``old_values``); ``ref_logp`` for a KL term; ``entropy`` for an entropy bonus (from
    ``rlcore.ops.logprobs_from_logits(..., with_entropy=True)``); ``values``,
    ``old_values``, ``returns`` for a value loss; optional ``is_weights`` (detached
    per-token weights, e.g. :func:`rlcore.algos.truncated_is_weights`, multiplied into
    the policy loss); ``rollout_logp`` (the sampler's log-probs) with ``behaviour_weights``;
    ``logits`` and ``teacher_logits`` ``[B, T, V]`` (the policy's, with gradient, and the
    teacher's at the same positions, each divided by the sampling temperature) with ``distill``.
    """

    advantage_estimator: Callable[[Batch], Batch]
    policy_loss: Callable[..., tuple[torch.Tensor, Metrics]]
    kl: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    kl_coef: float | KLController = 0.0
    agg_mode: str = "token-mean"
    horizon: int | None = None
    shaping: Callable[[Batch], Batch] | None = None
    entropy_coef: float = 0.0
    value_loss: Callable[..., tuple[torch.Tensor, Metrics]] | None = None
    vf_coef: float = 1.0
    behaviour_weights: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    distill: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Metrics]] | None = None
    distill_coef: float = 0.0

    def advantages(self, batch: Batch, *, process_group: Any = None) -> Batch:
        """The batch after shaping, with ``"advantages"`` (and the estimator's other leaves) added.

        Call it once on the whole batch, before splitting it into micro-batches: group
        baselines and batch whitening need every sample. Take the counts for
        :meth:`loss` (:func:`rlcore.algos.global_counts`) from the mask it returns.

        Under data parallelism each rank holds whole groups but only its share of the
        batch: pass the data-parallel ``process_group`` and an estimator that whitens
        over the batch (GAE's, REINFORCE++'s, GRPO's ``scale="batch"``) takes its
        moments over every rank, so the advantages do not depend on the world size. It
        reaches estimators that take a ``process_group`` keyword (the built-in adapters
        do); group-local estimators need none.
        """
        if self.shaping is not None:
            batch = self.shaping(batch)
        return {**batch, **with_group(self.advantage_estimator, process_group)(batch)}

    def global_counts(self, batch: Batch, *, process_group: Any = None) -> dict[str, torch.Tensor]:
        """``{"num_tokens", "num_seqs"}`` of ``batch["mask"]``, summed over ``process_group`` when given.

        :func:`rlcore.algos.global_counts` of the batch's mask: take it from the whole
        local batch after :meth:`advantages` (filters may zero rows of the mask) and
        before splitting it, and pass it to :meth:`loss` as ``**counts``.
        """
        return global_counts(batch_entry(batch, "mask", "the token mask"), process_group=process_group)

    def metric_weight(self, batch: Batch) -> torch.Tensor:
        """The weight of this batch's mean metrics when ranks combine them: the mask's total (its counted tokens).

        The policy and value losses' metrics are means over the mask's weights;
        :func:`rlcore.algos.reduce_metrics` weights each rank's by this.
        """
        mask = batch_entry(batch, "mask", "the token mask")
        if mask.dtype == torch.bool:
            return torch.count_nonzero(mask).float()
        return mask.sum(dtype=torch.float64 if mask.dtype == torch.float64 else torch.float32).float()

    def metric_reductions(self) -> dict[str, str]:
        """How :meth:`loss`'s metrics combine over ranks: :data:`rlcore.algos.RL_METRIC_REDUCTIONS` (others: means)."""
        return dict(RL_METRIC_REDUCTIONS)

    def loss(
        self,
        batch: Batch,
        *,
        num_tokens: Count | None = None,
        num_seqs: Count | None = None,
        seq_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
        """The scalar training loss of a (micro-)batch and detached metrics.

        ``loss = aggregate(policy_t + kl_coef * kl_t - entropy_coef * entropy_t)
        + vf_coef * aggregate(value_t)``, all with ``agg_mode``. The batch must hold
        ``"advantages"`` (from :meth:`advantages` on the whole batch: a grouped
        estimator run on a micro-batch would be silently wrong, so a missing entry is a
        ``ValueError``). With the global counts of the whole batch
        (:meth:`global_counts`), the losses of its micro-batches add up to the loss of
        the whole batch (see :func:`rlcore.algos.aggregate`).

        With context parallelism the batch's ``mask`` is this rank's part of each
        sequence's tokens; pass the counts of :func:`rlcore.algos.sequence_sharded_counts`
        (``num_tokens``, ``num_seqs`` and the per-sequence ``seq_tokens`` ``[B]``) and every
        term is aggregated by :func:`rlcore.algos.sequence_sharded_aggregate`, so the losses
        of the ``cp x dp`` ranks add up to the loss of the whole batch.

        Returns:
          ``(loss, metrics)``: the policy loss's metrics plus ``pg_loss``, and ``kl``,
          ``entropy``, ``vf_loss`` (each term aggregated like the loss), ``vf_clip_frac``,
          ``vf_mse`` where those terms are on.
        """
        advantages = batch_entry(
            batch, "advantages", "call algo.advantages(batch) once on the whole batch before splitting it"
        )
        mask = batch_entry(batch, "mask", "the token mask")
        keep = mask != 0
        counts = {"num_tokens": num_tokens, "num_seqs": num_seqs}

        def agg(x: torch.Tensor) -> torch.Tensor:
            if seq_tokens is not None:
                if num_tokens is None or num_seqs is None:
                    raise ValueError(
                        "seq_tokens: given without num_tokens and num_seqs, expected the three counts of "
                        "rlcore.algos.sequence_sharded_counts"
                    )
                return sequence_sharded_aggregate(
                    x,
                    mask,
                    seq_tokens=seq_tokens,
                    mode=self.agg_mode,
                    num_tokens=num_tokens,
                    num_seqs=num_seqs,
                    horizon=self.horizon,
                )
            return aggregate(x, mask, mode=self.agg_mode, horizon=self.horizon, **counts)

        logp = batch_entry(batch, "logp", "current-policy log-probs")
        old_logp = batch_entry(batch, "old_logp", "rollout-policy log-probs")
        pg_t, metrics = self.policy_loss(logp, old_logp, advantages, mask)
        if "is_weights" in batch:
            pg_t = pg_t * torch.where(keep, batch["is_weights"].detach(), 0.0).to(pg_t.dtype)
        if self.behaviour_weights is not None:
            behav = batch_entry(batch, "rollout_logp", "the sampler's log-probs, for behaviour_weights")
            w = torch.where(keep, self.behaviour_weights(old_logp, behav, mask).detach(), 0.0)
            pg_t = pg_t * w.to(pg_t.dtype)
            metrics = {**metrics, "behaviour_weight": masked_mean(w.float(), keep).detach()}
        # aggregate is linear in loss_t, so each term is aggregated on its own: the
        # total is the aggregate of the summed per-token loss, and each part is a metric.
        loss = agg(pg_t)
        metrics = {**metrics, "pg_loss": loss.detach()}
        kl_coef = self.kl_coef
        if isinstance(kl_coef, KLController) or kl_coef != 0:
            if self.kl is None:
                raise ValueError(f"kl: got None with kl_coef={self.kl_coef!r}, expected a KL function")
            ref_logp = batch_entry(batch, "ref_logp", "reference log-probs for the KL term")
            # Padding may hold nan: it must reach neither the value nor the gradient.
            kl_t = self.kl(torch.where(keep, logp, 0.0), torch.where(keep, ref_logp, 0.0))
            kl = agg(kl_t)
            if isinstance(kl_coef, KLController):
                coef = batch_entry(
                    batch, "kl_coef", "the KL controller's coefficient per sample, state.kl_coef.expand(B)"
                )
                check_shape("kl_coef", coef, (mask.shape[0],), what="the controller's coefficient, one per sample")
                loss = loss + agg(kl_t * coef.detach()[:, None].to(kl_t.dtype))
            else:
                loss = loss + kl_coef * kl
            metrics["kl"] = kl.detach()

        def term(out: tuple[torch.Tensor, Metrics], name: str, prefix: str) -> torch.Tensor:
            # A per-token loss term and its metrics: aggregated like the loss, logged under name and prefix.
            per_token, extra = out
            value = agg(per_token)
            metrics[name] = value.detach()
            metrics.update({f"{prefix}{k}": v for k, v in extra.items()})
            return value

        if self.distill is not None and self.distill_coef != 0:
            out = self.distill(
                batch_entry(batch, "logits", "the policy's logits over the vocabulary, for the distillation loss"),
                batch_entry(batch, "teacher_logits", "the teacher's logits at the same positions"),
                mask,
            )
            loss = loss + self.distill_coef * term(out, "distill", "distill_")
        if self.entropy_coef != 0:
            entropy = agg(torch.where(keep, batch_entry(batch, "entropy", "per-token entropy for the bonus"), 0.0))
            loss = loss - self.entropy_coef * entropy
            metrics["entropy"] = entropy.detach()
        if self.value_loss is not None and self.vf_coef != 0:
            out = self.value_loss(
                batch_entry(batch, "values", "current critic values"),
                batch_entry(batch, "old_values", "rollout critic values"),
                batch_entry(batch, "returns", "value targets"),
                mask,
            )
            loss = loss + self.vf_coef * term(out, "vf_loss", "vf_")
        return loss, metrics
