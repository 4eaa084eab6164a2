"""One RL step's stage graph: rollout and reward, the scoring forwards, the recipe's stages, the update.

The stages between the scoring and the update are the recipe's, found by its type
(:func:`rlcore.train.stages_for`); the deployment gives the rollout stage. This module
only places them: under context parallelism the rollout and the reward run once per
group and the forwards split each sequence; under data parallelism each update's rows
are dealt to the ranks by their tokens and the metrics are the whole batch's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, cast

from rlcore import algos
from rlcore.dataflow import Stage, StageGraph, on_device
from rlcore.rewards import RewardPool
from rlcore.train.agent_stages import multi_turn_graph
from rlcore.train.columns import COLUMNS
from rlcore.train.config import Config
from rlcore.train.context_parallel import DataParallelRecipe, cp_logprob_stage, replica_groups, replicate_stage
from rlcore.train.optim import Models, Optimiser
from rlcore.train.recipe_stages import StepParts, stages_for
from rlcore.train.replay import Replay
from rlcore.train.run_state import run_extras
from rlcore.train.scoring import ScoringPlan
from rlcore.train.stages import balanced_rows, logprob_stage, staleness_weighted, update_stage
from rlcore.train.step_metrics import StepMetrics
from rlcore.train.world import World

__all__ = ["host_threads", "step_graph"]


def _sampling_stages(
    cfg: Config,
    models: Models,
    rollout: Stage | None,
    rewards: RewardPool,
    task: Any,
    world: World,
    plan: ScoringPlan,
    sum_pi_squared: bool = False,
) -> tuple[list[Stage], list[Stage], list[str], Callable[[dict], dict] | None]:
    """Rollout and reward, the plan's scoring forwards, the columns the update reads to log them, its ``prepare``.

    Without a rollout a dataset gives the rows whole (offline preference pairs): no stage.
    With ``plan.old_in_update`` the old-policy forward is the update's ``prepare``. With
    ``sum_pi_squared`` (the recipe's estimator reads it) that forward also writes it.
    """
    if rollout is None:
        return [], [], ["prompt_mask", "iteration"], None
    rl = cfg.rl
    score: Any = logprob_stage
    reward = task.reward_stage(rewards)
    if world.cp is not None:  # sequences split over the cp ranks; rollout and reward once per cp group
        score = partial(cp_logprob_stage, group=world.cp[0], mode=world.cp[1])
        rollout, reward = (replicate_stage(s, replica_groups(world.mesh)) for s in (rollout, reward))
    scoring: list[Stage] = []
    logged = ["scores", "mask", "prompt_mask", "iteration", "version", "token_version", "rollout_logp"]
    prepare = None
    if plan.old_logp:
        outputs = ("old_logp", "entropy", "sum_pi_squared") if sum_pi_squared else ("old_logp", "entropy")
        old = score(models.policy, outputs=outputs, temperature=rl.temperature)
        if plan.old_in_update:
            prepare = old.fn
        else:
            scoring.append(old)
            logged += ["old_logp", "entropy"]
    if plan.ref_every and plan.ref_stage:
        scoring.append(score(models.reference, outputs=("ref_logp",), temperature=rl.temperature))
        logged.append("ref_logp")
    # The source's sampling: the rollout then the reward, or one stage over both (filter-and-refill).
    return task.sampling(rollout, reward), scoring, logged, prepare


def step_graph(
    cfg: Config,
    models: Models,
    recipe: algos.Recipe,
    opt: Optimiser,
    steps: StepMetrics,
    rollout: Stage | None,
    rewards: RewardPool,
    task: Any,
    world: World,
    on_step_end: Callable[[int], Any],
    plan: ScoringPlan,
    *,
    extras: Mapping[str, Any] | None = None,
) -> StageGraph:
    """The step's stages: rollout, reward and scoring forwards (when rows are sampled), the recipe's, the update.

    The graph checks every column against the trainer's schema (:data:`rlcore.train.COLUMNS`).

    Args:
      cfg: the run's config.
      models: the policy, the reference and the critic (or None).
      recipe: the recipe whose stages and loss the step runs.
      opt: the optimisers the update steps.
      steps: the step metrics every stage is timed into and the update reports to.
      rollout: the deployment's rollout stage, or None (a dataset's pairs).
      rewards: the reward pool the reward stage submits to.
      task: the prompt source (its tokenizer, reward stage and loader columns).
      world: this process's place in the mesh.
      on_step_end: called with each finished iteration (checkpoint, logs, weight sync).
      plan: the scoring forwards to run (:func:`rlcore.train.scoring_plan`).
      extras: the run's stateful parts (:func:`rlcore.train.run_state.run_extras`, made from the config
        when None): the ``replay`` buffer joins the update, the ``entropy_target`` sets its entropy bonus.
    """
    rl = cfg.rl
    sum_pi_squared = algos.scoring_needs(recipe).sum_pi_squared
    sampling, scoring, logged, prepare = _sampling_stages(
        cfg, models, rollout, rewards, task, world, plan, sum_pi_squared
    )
    # rl.replay: stored rows join each update's (its dispatch), weighted in its forward; metrics of the fresh rows.
    extras = run_extras(cfg, task) if extras is None else extras
    replay: Replay | None = extras.get("replay")
    entropy = extras.get("entropy_target")
    dispatch = balanced_rows(world.group) if world.group is not None else None
    on_metrics: Callable[..., Any] = steps.on_metrics
    if replay is not None:  # the config keeps it to one rank: no deal of the rows over ranks
        dispatch, on_metrics = replay.dispatch, replay.on_metrics(on_metrics)
    part = stages_for(recipe).graph(
        StepParts(
            models.policy,
            models.reference,
            models.critic,
            plan,
            temperature=rl.temperature,
            sampled=rollout is not None,
            logged=logged,
            epochs=rl.epochs,
            tokenizer=task.tokenizer,
            seed=cfg.trainer.seed,
            context_parallel=world.cp,
            dp_group=world.group,
            # Data parallel: each update's rows dealt to the ranks by their tokens.
            dispatch=dispatch,
            start=steps.start,
        )
    )
    stages = [*sampling, *part.ahead, *scoring, *part.stages]
    forward, inputs, loss = part.forward, part.inputs, part.recipe
    if rl.multi_turn is not None:  # the environments score; the forwards attend the observation tokens
        # The config takes multi-turn rollouts with the policy-gradient recipes only.
        stages, forward, inputs = multi_turn_graph(
            stages, forward, inputs, cast(algos.Algorithm, recipe), process_group=world.group
        )
    if steps.stale is not None:  # rl.stale_after: old rows dropped or discounted in the loss
        forward = staleness_weighted(forward, steps.stale, start=steps.start)
    if replay is not None:
        forward = replay.forward(forward)
    if entropy is not None:  # rl.entropy_target: the controller's coefficient is the recipe's bonus
        loss = entropy.recipe(loss)
    if world.cp is None and world.group is not None:  # the metrics of the whole batch on every rank
        loss = DataParallelRecipe(loss, world.group)
    stages.append(
        update_stage(
            forward,
            loss,
            opt,
            inputs=list(dict.fromkeys(inputs)),
            micro_batch=rl.mini_batch_size * rl.n_samples,
            process_group=world.group,
            on_metrics=on_metrics,
            on_iteration_end=on_step_end,
            epochs=part.epochs,
            dispatch=part.dispatch,
            prepare=prepare,
        )
    )
    if world.device.type != "cpu":  # the loader's and the host stages' columns are in host memory
        stages = [s if s.resource == "cpu" else on_device(s, world.device) for s in stages]
    return StageGraph([steps.timed(s) for s in stages], sources=task.columns, schema=COLUMNS)


def host_threads(world: World, graph: StageGraph) -> dict[str, int] | None:
    """:func:`rlcore.dataflow.run_pipeline`'s ``threads``: on a CPU device the host stages run single-threaded.

    The host stages (the reward's decoding, the advantages of a few hundred rows) then
    make no OpenMP team of their own beside the device's, which would make GNU OpenMP
    put the device's idle helpers to sleep between ops (:mod:`rlcore.dataflow.openmp`).
    On an accelerator the host's cores are not the device's: nothing is limited. A reward
    scored in the trainer's own process (``trainer.reward_workers: 0``) is one of those
    host stages: a heavy one (a reward model on the CPU) belongs in a worker process.
    """
    return {"cpu": 1} if world.device.type == "cpu" and "cpu" in graph.resources else None
