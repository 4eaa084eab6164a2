"""How a run scores: its reward pool and validator, and which scoring forwards a step runs (only those read)."""

from __future__ import annotations

from typing import Any, NamedTuple

from rlcore import algos
from rlcore.rewards import RewardPool
from rlcore.train.config import Config
from rlcore.train.validation import Validator

__all__ = ["ScoringPlan", "scorers", "scoring_plan"]

# Rows of a step written to samples.jsonl (trainer.log_samples), spread over the leader's batch.
_SAMPLE_ROWS = 4


def scorers(
    cfg: Config, task: Any, reward: Any, world: Any, *, components: bool = False
) -> tuple[RewardPool, Validator | None]:
    """The run's reward pool and, with ``trainer.eval_every`` and a validation set, its validator.

    Args:
      cfg: the run's config (``trainer.reward_workers``, ``reward_timeout``, ``log_samples``, ``eval_every``;
        ``max_worker_restarts``: how often a reward worker that died or hung is replaced, its rows scored again).
      task: the prompt source: its rule reward, its validation set; a dataset of finished
        rows (``task.sampled`` false: offline pairs) scores nothing, so no worker starts.
      reward: a user's reward in place of the task's, or None.
      world: this process's place (the validator splits the validation set over the data-parallel ranks).
      components: the pool also gives each reward component's scores (the recipe normalises them one by one:
        GDPO, :func:`rlcore.algos.scoring_needs`), which the reward stage writes as ``score_parts``.
    """
    tr = cfg.trainer
    scorer = reward if reward is not None else task.reward
    rewards = RewardPool(
        scorer,
        num_workers=tr.reward_workers if task.sampled else 0,
        timeout=tr.reward_timeout,
        samples=_SAMPLE_ROWS * bool(tr.log_samples),
        max_restarts=tr.max_worker_restarts,
        components=components,
    )
    validator = None
    if tr.eval_every and task.val is not None:
        validator = Validator(
            cfg, task.val, task.tokenizer, scorer, rank=world.dp_rank, world_size=world.dp_size, group=world.group
        )
    return rewards, validator


class ScoringPlan(NamedTuple):
    """The scoring forwards of an RL step (:func:`scoring_plan`).

    Fields:
      old_logp: run the old-policy forward (``old_logp``, ``entropy``); else the
        update's own log-probs, detached, are the old policy's.
      ref_every: the reference forward runs every this many steps (1: every step; 0: never).
      ref_stage: it is a stage before the advantages (the recipe reads ``ref_logp``);
        else, logged only, it runs inside the update's forward on its steps.
      ahead: without the old-policy forward, the update's forward may run as a stage of
        its own while the host scores the rows (the blocking pipeline: no update can
        come between them); with ``deploy.async_infer`` it runs inside the update.
      old_in_update: the old-policy forward runs inside the update stage, once over each
        iteration's rows before its first optimiser update (``deploy.async_infer``,
        where a stage of its own could run between the updates of an earlier
        iteration): the proximal policy is then exactly the weights those updates start
        from, and its collectives stay in the update.
      interpolate: ``rl.prox_logp: interpolate``: no old-policy forward; the update's
        forward approximates ``old_logp`` from the sampler's and its own log-probs by
        version (:func:`rlcore.train.old_policy_interpolated`) over this many optimiser
        updates per step (0: off).
    """

    old_logp: bool
    ref_every: int
    ref_stage: bool = True
    ahead: bool = True
    old_in_update: bool = False
    interpolate: int = 0


def scoring_plan(cfg: Config, algo: Any, *, context_parallel: bool = False) -> ScoringPlan:
    """No forward the step does not need.

    * The old-policy forward is skipped (``rl.old_logp: auto``) when the policy that
      the ratio is anchored to is the one the single update trains: one optimiser
      update per batch (``rl.mini_batch_size == rl.batch_size``, ``rl.epochs == 1``),
      the recipe's advantages do not read ``old_logp`` (:func:`rlcore.algos.scoring_needs`:
      KL in the reward does), and either the blocking pipeline (the rows were sampled
      by those weights) or the decoupled objective (``rl.behaviour_weights``: the
      sampler's ``rollout_logp`` is the behaviour policy, ``old_logp`` the proximal one,
      which is the update's start). Then ``old_logp`` is the update's ``logp``
      detached: equal to the forward's value, and the ratio is 1 with the same gradient.
    * The reference forward runs every step when the recipe reads ``ref_logp`` (a KL
      term: ``rl.beta`` not 0); otherwise only every ``trainer.log_ref_kl_every`` steps,
      for the logged ``kl`` (0: never). With ``deploy.async_infer`` over data-parallel
      ranks a KL term in the loss takes it from inside the update's forward (every
      sharded forward's collectives then run in the update, in iteration order).
      A full-vocabulary distillation term (:attr:`rlcore.algos.Algorithm.distill`)
      reads the teacher's logits inside the update's forward every step, and the
      logged ``kl`` with them.

    Context parallelism (each rank's update holds its share of the tokens) keeps both
    forwards, and so does a recipe that is not an :class:`rlcore.algos.Algorithm`
    (:func:`rlcore.algos.scoring_needs` counts it as reading both): DPO's logged KL and
    entropy of the sampled answers come from these forwards.
    """
    blocking = not cfg.deploy.async_infer
    if context_parallel:
        return ScoringPlan(True, 1)
    needs = algos.scoring_needs(algo)
    plan = _plan(cfg, algo, needs, blocking)
    # The teacher's logits come in the update's forward, its log-probs of the samples with them: logged every step.
    return plan._replace(ref_every=1) if needs.logits else plan


def _plan(cfg: Config, algo: Any, needs: algos.ScoringNeeds, blocking: bool) -> ScoringPlan:
    rl = cfg.rl
    one_update = rl.mini_batch_size == rl.batch_size and rl.epochs == 1
    anchored = blocking or getattr(algo, "behaviour_weights", None) is not None
    skip_old = rl.old_logp == "auto" and one_update and anchored and not needs.old_logp
    # rl.prox_logp interpolate (async, behaviour weights on): AReaL's prox-approx instead of the forward.
    weighted = getattr(algo, "behaviour_weights", None) is not None
    interpolate = not blocking and weighted and not needs.old_logp and rl.prox_logp == "interpolate"
    if interpolate and not skip_old:
        updates = rl.batch_size // rl.mini_batch_size * rl.epochs
        every = 1 if needs.ref_logp else cfg.trainer.log_ref_kl_every
        ref_stage = needs.ref_logp and cfg.parallel.data_parallel == 1
        return ScoringPlan(False, every, ref_stage=ref_stage, ahead=False, interpolate=updates)
    # Async: the old-policy forward (when the advantages do not read it) runs in the update, before its first step.
    in_update = not blocking and not skip_old and not needs.old_logp
    # Async over ranks: the loss's reference runs inside the update, where the collectives meet (no KL reward there).
    ref_stage = needs.ref_logp and (needs.old_logp or blocking or cfg.parallel.data_parallel == 1)
    every = 1 if needs.ref_logp else cfg.trainer.log_ref_kl_every
    return ScoringPlan(not skip_old, every, ref_stage=ref_stage, ahead=blocking, old_in_update=in_update)
