"""Which scoring forwards an RL step runs: the old policy's and the reference's, only where something reads them."""

from __future__ import annotations

from typing import Any, NamedTuple

from rlcore import algos
from rlcore.train.config import Config

__all__ = ["ScoringPlan", "scoring_plan"]


class ScoringPlan(NamedTuple):
    """The scoring forwards of an RL step (:func:`scoring_plan`).

    Fields:
      old_logp: run the old-policy forward (``old_logp``, ``entropy``); else the
        update's own log-probs, detached, are the old policy's.
      ref_every: the reference forward runs every this many steps (1: every step; 0: never).
      ref_stage: it is a stage before the advantages (the recipe reads ``ref_logp``);
        else, logged only, it runs inside the update's forward on its steps.
    """

    old_logp: bool
    ref_every: int
    ref_stage: bool = True


def scoring_plan(cfg: Config, algo: Any, *, context_parallel: bool = False) -> ScoringPlan:
    """No forward the step does not need.

    * The old-policy forward is skipped (``rl.old_logp: auto``) when the policy that
      sampled is the one the single update trains: the blocking pipeline (no
      ``deploy.async_infer``, whose rows may come from an older policy), one optimiser
      update per batch (``rl.mini_batch_size == rl.batch_size``, ``rl.epochs == 1``), and the recipe's
      advantages do not read ``old_logp`` (:func:`rlcore.algos.scoring_needs`: KL in the
      reward does). Then ``old_logp`` is the update's ``logp`` detached: equal to the
      forward's value, and the ratio is 1 with the same gradient.
    * The reference forward runs every step when the recipe reads ``ref_logp`` (a KL
      term: ``rl.beta`` not 0); otherwise only every ``trainer.log_ref_kl_every`` steps,
      for the logged ``kl`` (0: never).

    Context parallelism (each rank's update holds its share of the tokens) keeps both
    forwards, and so does a recipe that is not an :class:`rlcore.algos.Algorithm`
    (:func:`rlcore.algos.scoring_needs` counts it as reading both): DPO's logged KL and
    entropy of the sampled answers come from these forwards.
    """
    rl = cfg.rl
    if context_parallel:
        return ScoringPlan(True, 1)
    needs = algos.scoring_needs(algo)
    # On-policy: the blocking pipeline samples with the weights the single update then trains.
    on_policy = not cfg.deploy.async_infer and rl.mini_batch_size == rl.batch_size and rl.epochs == 1
    skip_old = rl.old_logp == "auto" and on_policy and not needs.old_logp
    if needs.ref_logp:
        return ScoringPlan(not skip_old, 1)
    return ScoringPlan(not skip_old, cfg.trainer.log_ref_kl_every, ref_stage=False)
