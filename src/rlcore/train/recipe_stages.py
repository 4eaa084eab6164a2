"""The stages each kind of recipe adds to an RL step, found by the recipe's type.

A recipe (:class:`rlcore.algos.Recipe`) is maths only; the stages that produce the
columns its batch reads hold models, so they are assembled here, one class per kind:

* :class:`PolicyGradientStages` (:class:`rlcore.algos.Algorithm`: GRPO, DAPO, RLOO,
  REINFORCE++, PPO, ...): the critic's ``old_values`` when the recipe has a value loss
  (PPO's GAE reads them), then the advantages stage; the update's forward gives the
  policy's log-probs (and the critic's values).
* :class:`PreferenceStages` (:class:`rlcore.algos.DPO`): the pairs (online: each
  sampled answer against the reference answer; offline: a preference dataset's rows)
  and the reference's log-probs of both sides; the update scores both sides in one forward.

The trainer runs the rollout, the reward and the scoring forwards, then whatever
``stages_for(recipe).graph(parts)`` gives, then the one update stage: a new kind of
recipe is a new class registered with ``stages_for.register(RecipeType, Class)``, never
a new branch in the trainer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from rlcore import algos
from rlcore.dataflow import Stage
from rlcore.train.columns import COLUMNS
from rlcore.train.context_parallel import ContextParallelRecipe, cp_rl_forward
from rlcore.train.scoring import ScoringPlan
from rlcore.train.stages import (
    PAIR_TOKEN_COLUMNS,
    advantages_stage,
    forward_ahead,
    old_policy_interpolated,
    old_policy_is_updated,
    pairs_stage,
    preference_forward,
    preference_logps_stage,
    rl_outputs,
    update_forward,
    values_stage,
    with_logged_reference,
    with_teacher_logits,
)
from rlcore.train.supervised_stages import SFT_COLUMNS, reward_pair_forward, sft_forward

__all__ = [
    "PolicyGradientStages",
    "PreferenceStages",
    "RecipeGraph",
    "RecipeStages",
    "RewardModelStages",
    "StepParts",
    "SupervisedStages",
    "stages_for",
]

Batch = dict[str, torch.Tensor]
# What the reference's forward over the pairs writes (preference_logps_stage).
REF_PAIR_LOGPS = COLUMNS.select("ref_chosen_logps", "ref_rejected_logps")


class StepParts(NamedTuple):
    """What the trainer hands a recipe's stages: the models, the scoring plan and the step's options.

    Fields:
      policy: the policy being trained.
      reference: the reference policy (scored in eval mode, no gradient).
      critic: the value model, built when the recipe's stages ask for one
        (``RecipeStages.critic``), else None.
      plan: the step's scoring forwards (:func:`rlcore.train.scoring_plan`).
      temperature: the sampling temperature (``rl.temperature``).
      sampled: a rollout samples the rows; False when a dataset gives them whole
        (offline DPO on a preference dataset: no rollout, reward or scoring forward).
      logged: dock columns the update reads only for the step's metrics (what the
        rollout, the reward and the scoring forwards wrote, or the loader's
        ``prompt_mask`` and ``iteration``).
      epochs: passes of the update over each step's rows (``rl.epochs``).
      tokenizer: the task's tokenizer (online DPO decodes the answers and the samples).
      seed: ``trainer.seed``, which keys the random stream of a row's perturbed answer
        (online DPO, :mod:`rlcore.seeding`).
      context_parallel: ``(group, mode)`` when each sequence is split over the
        context-parallel ranks, else None.
      dp_group: the data-parallel group, or None.
      dispatch: deals each update's rows over the data-parallel ranks by their tokens
        (:func:`rlcore.train.stages.balanced_rows`), or None; a recipe whose rows may move
        passes it on in its :class:`RecipeGraph`.
      start: the run's first step (policy versions count from it; a resumed run's is its checkpoint's).
    """

    policy: torch.nn.Module
    reference: torch.nn.Module
    critic: torch.nn.Module | None
    plan: ScoringPlan
    temperature: float = 1.0
    sampled: bool = True
    logged: Sequence[str] = ()
    epochs: int = 1
    tokenizer: Any = None
    seed: int | None = None
    context_parallel: tuple[Any, str] | None = None
    dp_group: Any = None
    dispatch: Callable[[Batch], tuple[Batch, dict[str, Any]]] | None = None
    start: int = 0


class RecipeGraph(NamedTuple):
    """A recipe's part of the step: its stages, and what the update runs.

    Fields:
      stages: run after the rollout, reward and scoring stages, before the update.
      forward: the update's forward: dock rows -> the recipe's batch, with gradient.
      inputs: dock columns the update reads.
      recipe: what the update calls ``global_counts`` and ``loss`` on (the recipe, or
        a wrapper of it such as :class:`rlcore.train.ContextParallelRecipe`).
      epochs: passes of the update over each step's rows.
      ahead: stages run right after the rollout and the reward, before the scoring
        forwards (the update's own forward run ahead while the host scores the rows,
        :func:`rlcore.train.stages.forward_ahead`).
      dispatch: the update's ``dispatch`` (``StepParts.dispatch`` when the rows may
        change ranks), or None.
    """

    stages: list[Stage]
    forward: Callable[[Batch], Batch]
    inputs: list[str]
    recipe: Any
    epochs: int
    ahead: Sequence[Stage] = ()
    dispatch: Callable[[Batch], tuple[Batch, dict[str, Any]]] | None = None


class RecipeStages(Protocol):
    """The stages one kind of recipe needs; a class per kind, made from the recipe (``Kind(recipe)``).

    Members:
      critic: the step needs a value model beside the policy (built by the trainer and
        passed back as ``StepParts.critic``).
      graph: ``parts -> RecipeGraph``.
    """

    @property
    def critic(self) -> bool: ...

    def graph(self, parts: StepParts) -> RecipeGraph: ...


# Columns the host has before any device forward: the reward's, and the rollout's mask and the loader's groups.
_HOST_COLUMNS = frozenset({"scores", "score_parts", "mask", "group"})


class PolicyGradientStages:
    """:class:`rlcore.algos.Algorithm`: the critic's values when it has a value loss (PPO), then the advantages.

    The advantages stage (:func:`rlcore.train.stages.advantages_stage`) runs the
    recipe's shaping and estimator over whole groups and reads only what they read:
    ``old_logp`` and ``ref_logp`` as :func:`rlcore.algos.scoring_needs` says, the
    critic's ``old_values`` for GAE. The update's forward gives the policy's log-probs
    and, with a critic, its values. When the plan runs no old-policy forward, that
    forward runs ahead as a stage of its own while the host scores the rows
    (:func:`rlcore.train.stages.forward_ahead`: its ``logp``, detached, is ``old_logp``).
    Under context parallelism it gives each rank's share of the tokens
    (:class:`rlcore.train.ContextParallelRecipe` counts over the group).

    >>> PolicyGradientStages(algos.ppo()).critic, PolicyGradientStages(algos.grpo()).critic
    (True, False)
    """

    def __init__(self, recipe: algos.Algorithm):
        self.recipe = recipe

    @property
    def critic(self) -> bool:
        """A value model when the recipe has a value loss (it trains the model; GAE reads its values)."""
        return self.recipe.value_loss is not None

    def graph(self, parts: StepParts) -> RecipeGraph:
        """The critic's values (PPO) and the advantages stage; the policy-gradient forward for the update."""
        if not parts.sampled:
            raise ValueError(
                "parts.sampled: got False, expected rows sampled by a rollout (a policy-gradient recipe learns from "
                "its own samples, not from a dataset's finished rows)"
            )
        if self.critic != (parts.critic is not None):
            raise ValueError(
                f"parts.critic: got {type(parts.critic).__name__}, expected "
                f"{'a value model (the recipe has a value loss)' if self.critic else 'None (the recipe has no value loss)'}"
            )
        plan, critic = parts.plan, parts.critic
        needs = algos.scoring_needs(self.recipe)
        scored = [
            "scores",
            # GDPO: each reward component's scores, which the stage passes as the recipe's scores [B, K].
            *(["score_parts"] if needs.score_parts else []),
            # The optimal token baseline: the old policy's sum_v pi(v)^2 per token, from its forward.
            *(["sum_pi_squared"] if needs.sum_pi_squared else []),
            "mask",
            "group",
            *(["old_logp"] if needs.old_logp else []),
            # The reference's log-probs when a stage gives them (else the loss's come from the update's forward).
            *(["ref_logp"] if needs.ref_logp and plan.ref_stage else []),
        ]
        produced = ["advantages", "loss_mask"]
        stages: list[Stage] = []
        if critic is not None:
            stages.append(values_stage(critic))
            scored.append("old_values")
            produced.append("returns")
        # An estimator that reads only the host's columns (the scores, the mask, the groups) and makes no collective
        # runs on the host thread as soon as the reward is in, beside the device's forward: not as a device call
        # between the forward and the update, where each hand-off of the dock costs the device its time.
        on_host = parts.dp_group is None and parts.context_parallel is None and set(scored) <= _HOST_COLUMNS
        stages.append(
            advantages_stage(
                self.recipe,
                inputs=scored,
                outputs=produced,
                process_group=parts.dp_group,
                resource="cpu" if on_host else "device",
            )
        )
        # A full-vocabulary distillation term (rl.opd_loss: jsd): the policy's logits, and the teacher's beside them.
        outputs = rl_outputs(parts.policy, critic=critic, temperature=parts.temperature, with_logits=needs.logits)
        if needs.logits:
            if parts.reference is None:
                raise ValueError(
                    "parts.reference: got None with a distillation term in the recipe, expected the teacher model"
                )
            # Its log-probs of the sampled tokens come with its logits: ref_logp on every step, no stage.
            outputs = with_teacher_logits(outputs, parts.reference, temperature=parts.temperature)
        elif plan.ref_every and not plan.ref_stage:  # logged only: no stage, the update's forward runs it on its steps
            outputs = with_logged_reference(
                outputs, parts.reference, every=plan.ref_every, temperature=parts.temperature
            )
        ahead: list[Stage] = []
        logged = list(parts.logged)
        forward: Callable[[Batch], Batch]
        if plan.old_logp:
            forward = update_forward(outputs)
        elif plan.interpolate:  # rl.prox_logp interpolate: old_logp from the versions, no forward
            forward = update_forward(old_policy_interpolated(outputs, updates=plan.interpolate, start=parts.start))
        elif parts.dispatch is not None or not plan.ahead:
            # Rows change ranks before the update, or an update may come between the scoring and this
            # one (async): the forward runs inside the update, on its rows and weights.
            forward = update_forward(old_policy_is_updated(outputs))
        else:  # the update's forward runs while the rows are scored; its logp, detached, is old_logp
            run_ahead, forward = forward_ahead(outputs)
            ahead.append(run_ahead)
            logged += ["old_logp", "entropy"]
        recipe: Any = self.recipe
        if parts.context_parallel is not None:
            group, mode = parts.context_parallel
            forward = cp_rl_forward(parts.policy, group=group, mode=mode, temperature=parts.temperature)
            recipe = ContextParallelRecipe(self.recipe, group, dp_group=parts.dp_group)
        values = ["old_values", "returns"] if critic is not None else []
        inputs = ["prompts", "responses", "advantages", "loss_mask", *values, *logged]
        # Each update's rows may go to any rank: the advantages are computed, the losses use global counts.
        dispatch = parts.dispatch if parts.context_parallel is None else None
        return RecipeGraph(stages, forward, inputs, recipe, parts.epochs, ahead, dispatch)


class PreferenceStages:
    """:class:`rlcore.algos.DPO`: the pairs and the reference's log-probs of both sides; one packed forward to update.

    Sampled rows (online DPO) become pairs (:func:`rlcore.train.stages.pairs_stage`:
    the reference answer chosen, the sample rejected); a preference dataset's rows
    (offline DPO) are pairs already. Either way the reference scores both sides
    (:func:`rlcore.train.stages.preference_logps_stage`) and the update's forward the
    policy's (:func:`rlcore.train.stages.preference_forward`).
    """

    critic = False

    def __init__(self, recipe: algos.DPO):
        self.recipe = recipe

    def graph(self, parts: StepParts) -> RecipeGraph:
        """The pairs (online) and their reference log-probs; the preference forward for the update."""
        if parts.context_parallel is not None:
            raise ValueError(
                f"parts.context_parallel: got {parts.context_parallel!r}, expected None (the pairs are not split "
                "over sequence shards)"
            )
        stages = [preference_logps_stage(parts.reference)]
        if parts.sampled:
            if parts.seed is None or parts.tokenizer is None:
                raise ValueError("parts.seed, parts.tokenizer: got None, expected both for pairs of sampled rows")
            stages.insert(0, pairs_stage(parts.tokenizer, parts.seed))
        inputs = [*PAIR_TOKEN_COLUMNS, *REF_PAIR_LOGPS, *parts.logged]
        # rl.epochs passes over each step's pairs, sampled or a dataset's.
        return RecipeGraph(stages, preference_forward(parts.policy), inputs, self.recipe, parts.epochs)


def _dataset_rows(parts: StepParts, kind: str) -> None:
    """Supervised recipes learn from a dataset's rows, whole on each rank."""
    if parts.sampled:
        raise ValueError(
            f"parts.sampled: got True, expected a dataset's finished rows ({kind} learns from data.path, not samples)"
        )
    if parts.context_parallel is not None:
        raise ValueError(
            f"parts.context_parallel: got {parts.context_parallel!r}, expected None ({kind} rows are not split over "
            "sequence shards)"
        )


class SupervisedStages:
    """:class:`rlcore.algos.SFT`: no stage before the update; its forward packs the demonstrations and scores them.

    >>> SupervisedStages(algos.sft()).critic
    False
    """

    critic = False

    def __init__(self, recipe: algos.SFT):
        self.recipe = recipe

    def graph(self, parts: StepParts) -> RecipeGraph:
        """The SFT forward for the update (:func:`rlcore.train.supervised_stages.sft_forward`)."""
        _dataset_rows(parts, "SFT")
        inputs = [*SFT_COLUMNS, *parts.logged]
        return RecipeGraph([], sft_forward(parts.policy), inputs, self.recipe, parts.epochs)


class RewardModelStages:
    """:class:`rlcore.algos.RM`: the reward model is the step's scalar-head model (``critic``); it scores the pairs.

    >>> RewardModelStages(algos.rm()).critic
    True
    """

    critic = True

    def __init__(self, recipe: algos.RM):
        self.recipe = recipe

    def graph(self, parts: StepParts) -> RecipeGraph:
        """The pair forward of the reward model for the update (both sides in one padded forward)."""
        _dataset_rows(parts, "reward-model training")
        if parts.critic is None:
            raise ValueError("parts.critic: got None, expected the reward model (a one-output scalar-head model)")
        inputs = [*PAIR_TOKEN_COLUMNS, *parts.logged]
        return RecipeGraph([], reward_pair_forward(parts.critic), inputs, self.recipe, parts.epochs)


@functools.singledispatch
def stages_for(recipe: Any) -> RecipeStages:
    """The stages of ``recipe``'s kind, found by its type (the nearest registered class of its MRO).

    :class:`rlcore.algos.Algorithm` -> :class:`PolicyGradientStages`,
    :class:`rlcore.algos.DPO` -> :class:`PreferenceStages`; register another kind with
    ``stages_for.register(RecipeType, Kind)`` (``Kind(recipe)`` is a :class:`RecipeStages`).

    >>> type(stages_for(algos.dapo())).__name__, type(stages_for(algos.dpo())).__name__
    ('PolicyGradientStages', 'PreferenceStages')
    """
    kinds = sorted(c.__name__ for c in stages_for.registry if c is not object)
    raise ValueError(
        f"recipe: got a {type(recipe).__name__}, expected a recipe of a kind with registered stages "
        f"({', '.join(kinds)}; add one with rlcore.train.stages_for.register)"
    )


stages_for.register(algos.Algorithm, PolicyGradientStages)
stages_for.register(algos.DPO, PreferenceStages)
stages_for.register(algos.SFT, SupervisedStages)
stages_for.register(algos.RM, RewardModelStages)
