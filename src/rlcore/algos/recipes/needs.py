"""Which scoring forwards a recipe needs before its update: the rollout policy's and the reference's log-probs.

A step can skip a forward pass only when nothing reads its column. An
:class:`~rlcore.algos.Algorithm` reads

* ``ref_logp`` in its loss when the KL term is on (``kl_coef`` not 0, or a KL
  controller), and in its shaping when it folds the KL into the reward
  (:func:`~rlcore.algos.kl_reward_shaping`, :func:`~rlcore.algos.kl_score_shaping`
  with ``kl_coef`` not 0);
* ``old_logp`` before the update only in such KL shaping. Its loss always reads
  ``old_logp``; with one optimiser update per batch the update's own log-probs,
  detached, are exactly those (TRL's ``GRPOTrainer`` and verl skip the forward then).

A shaping step this module does not know (a user's function) counts as reading both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from rlcore.algos.advantages import gdpo_advantages
from rlcore.algos.kl import KLController
from rlcore.algos.recipes.adapters import (
    dynamic_sampling_filter,
    kl_reward_shaping,
    kl_score_shaping,
    outcome_advantages,
    overlong_shaping,
    score_scaling,
    token_baseline_advantages,
    token_rewards_shaping,
)
from rlcore.algos.recipes.algorithm import Algorithm

__all__ = ["ScoringNeeds", "scoring_needs"]

_KL_SHAPING = (kl_reward_shaping, kl_score_shaping)
_READS_NO_LOGPS = (token_rewards_shaping, dynamic_sampling_filter, overlong_shaping, score_scaling)


class ScoringNeeds(NamedTuple):
    """What :func:`scoring_needs` found.

    Fields:
      old_logp: the recipe's advantages (its shaping) read the rollout policy's
        log-probs, so they must come from a forward before the update.
      ref_logp: the recipe reads the reference's log-probs (loss or shaping).
      score_parts: the estimator reads each reward component's scores, ``scores`` ``[B, K]``
        (GDPO: :func:`~rlcore.algos.gdpo_advantages` under
        :func:`~rlcore.algos.recipes.adapters.outcome_advantages`), not their weighted sum.
      sum_pi_squared: the estimator reads the rollout policy's ``sum_v pi(v)^2`` per token
        from the old-policy forward (the optimal token baseline,
        :func:`~rlcore.algos.token_baseline_advantages`), and so its ``old_logp`` too.
      logits: the loss reads the policy's and the teacher's ``logits`` over the vocabulary
        (a distillation term, :attr:`~rlcore.algos.Algorithm.distill`), which the update's
        forward gives.
    """

    old_logp: bool
    ref_logp: bool
    score_parts: bool = False
    sum_pi_squared: bool = False
    logits: bool = False


def _steps(shaping: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    inner = getattr(shaping, "steps", None)  # rlcore.algos.chain
    if inner is None:
        yield shaping
        return
    for step in inner:
        yield from _steps(step)


def scoring_needs(algo: Any) -> ScoringNeeds:
    """Which of ``old_logp`` (before the update), ``ref_logp``, the component scores, ``sum_pi_squared`` and the logits ``algo`` reads.

    Args:
      algo: an :class:`~rlcore.algos.Algorithm`; anything else counts as reading both.

    >>> from rlcore import algos
    >>> scoring_needs(algos.grpo(kl_coef=0.0)).old_logp, scoring_needs(algos.grpo(kl_coef=0.0)).ref_logp, scoring_needs(
    ...     algos.grpo()).ref_logp
    (False, False, True)
    >>> tuple(scoring_needs(algos.ppo()))
    (True, True, False, False, False)
    >>> scoring_needs(algos.on_policy_distillation(loss="jsd")).logits
    True
    >>> scoring_needs(algos.gdpo()).score_parts, scoring_needs(algos.grpo()._replace(
    ...     advantage_estimator=algos.token_baseline_advantages)).sum_pi_squared
    (True, True)
    """
    if not isinstance(algo, Algorithm):
        return ScoringNeeds(True, True)
    parts = _reads_score_parts(algo.advantage_estimator)
    est = algo.advantage_estimator
    sps = (est.func if isinstance(est, functools.partial) else est) is token_baseline_advantages
    logits = algo.distill is not None and algo.distill_coef != 0
    coef = algo.kl_coef
    ref = isinstance(coef, KLController) or coef != 0
    old = sps
    for step in _steps(algo.shaping) if algo.shaping is not None else ():
        fn = step.func if isinstance(step, functools.partial) else step
        if fn in _KL_SHAPING:
            reads = step.keywords.get("kl_coef", 1) != 0 if isinstance(step, functools.partial) else True
            old, ref = old or reads, ref or reads
        elif fn not in _READS_NO_LOGPS:
            return ScoringNeeds(True, True, parts, sps, logits)
    return ScoringNeeds(old, ref, parts, sps, logits)


def _reads_score_parts(estimator: Callable[..., Any]) -> bool:
    """The estimator is :func:`outcome_advantages` over :func:`gdpo_advantages`: it normalises each component."""
    if not (isinstance(estimator, functools.partial) and estimator.func is outcome_advantages):
        return False
    inner = estimator.keywords.get("estimator")
    return (inner.func if isinstance(inner, functools.partial) else inner) is gdpo_advantages
