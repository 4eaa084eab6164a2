"""The reference trainer: rlcore's stages assembled into a pipeline over the Transfer Dock.

One RL step is a :class:`rlcore.dataflow.StageGraph` of the stages in
:mod:`rlcore.train.stages`, run by :func:`rlcore.dataflow.run_pipeline`::

    loader(step)      -> prompts, prompt_mask, answers, group, iteration   (the task, seeded per step)
    rollout           -> responses, mask, version     (in-process engine, or a worker process)
    reward            -> scores                       (RewardPool; CPU resource, overlaps the forwards)
    old_logp          -> old_logp, entropy            (policy, eval mode)
    ref_logp          -> ref_logp                     (reference, eval mode)
    old_values        -> old_values                   (critic, PPO)
    advantages        -> advantages, loss_mask (+ returns)   (the recipe, whole groups)
    update            -> loss    forward -> algo.loss(batch, **counts) -> backward -> optimiser step

The stages between the scoring and the update are the recipe's, found by its type
(:func:`rlcore.train.stages_for`): the advantages (PPO: after the critic's values); for
DPO, ``pairs`` (chosen / rejected sequences) and ``ref_pair_logps`` (offline DPO: the
dataset's pairs, no rollout). Every recipe runs the same update stage. The deployment
(``deploy.*``; :func:`rlcore.train.deploy.make_deployment`, one class per mode) decides
only how the pieces are placed:

* ``co-located``: one device resource; every switch to the rollout phase runs the
  memory plan's AllGather-Swap (:class:`rlcore.memory.ColocatedSwitch`): optimiser
  state, gradients and training weights are offloaded and the engine's weights are
  built bucket by bucket; the predicted peak of each phase is logged.
* ``disaggregated``: the rollout runs in a :class:`rlcore.dataflow.RolloutWorker`
  process (a :class:`rlcore.dataflow.RayRolloutWorker` actor with ``deploy.backend:
  ray``), receiving weights through :class:`rlcore.dataflow.WeightSync`.
* ``async_infer``: the rollout of the next iterations overlaps the current update, up
  to ``deploy.staleness`` versions behind; otherwise the pipeline is blocking with
  staleness 0, which is exactly the synchronous loop
  (:func:`rlcore.testing.reference.train_loop_ref`).

Nothing here is a framework: copy the file and change the assembly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from rlcore import algos
from rlcore.dataflow import Stage, StageGraph, run_pipeline
from rlcore.device import get_device
from rlcore.rewards import RewardPool
from rlcore.train.agent_stages import check_multi_turn, multi_turn_graph
from rlcore.train.build import build_algorithm, build_model, build_models, build_reference
from rlcore.train.columns import COLUMNS
from rlcore.train.config import Config, check_launch
from rlcore.train.context_parallel import (
    DataParallelRecipe,
    cp_logprob_stage,
    replica_groups,
    replicate_stage,
)
from rlcore.train.deploy import Deployment, make_deployment
from rlcore.train.lora import check_lora_launch
from rlcore.train.metrics import plot_curves, plot_timeline, read_metrics
from rlcore.train.optim import Models, Optimiser
from rlcore.train.prompts import PreferencePrompts, make_prompt_source, task_options
from rlcore.train.recipe_stages import StepParts, stages_for
from rlcore.train.rollout import InferenceEngine
from rlcore.train.run_state import check_resume, restore_run
from rlcore.train.rundir import prepare_run_dir
from rlcore.train.scoring import ScoringPlan, scoring_plan
from rlcore.train.stages import (
    balanced_rows,
    logprob_stage,
    update_stage,
)
from rlcore.train.step_end import StepEnd
from rlcore.train.step_metrics import StepMetrics
from rlcore.train.validation import Validator
from rlcore.train.warmup import supervised_warmup
from rlcore.train.world import World

__all__ = [
    "Run",
    "train",
]

# Rows of a step written to samples.jsonl (trainer.log_samples), spread over the leader's batch.
_SAMPLE_ROWS = 4


class Run(NamedTuple):
    """What :func:`train` returns: the per-step metrics records and this rank's trained models."""

    records: list[dict[str, Any]]
    policy: torch.nn.Module
    critic: torch.nn.Module | None


# --- the assembly -----------------------------------------------------------------------------


def _sampling_stages(
    cfg: Config,
    models: Models,
    rollout: Stage | None,
    rewards: RewardPool,
    task: Any,
    world: World,
    plan: ScoringPlan,
) -> tuple[list[Stage], list[Stage], list[str]]:
    """Rollout and reward, the plan's scoring forwards, and the columns the update reads to log them.

    Without a rollout a dataset gives the rows whole (offline preference pairs): no stage.
    """
    if rollout is None:
        return [], [], ["prompt_mask", "iteration"]
    rl = cfg.rl
    score: Any = logprob_stage
    reward = task.reward_stage(rewards)
    if world.cp is not None:  # sequences split over the cp ranks; rollout and reward once per cp group
        score = partial(cp_logprob_stage, group=world.cp[0], mode=world.cp[1])
        rollout, reward = (replicate_stage(s, replica_groups(world.mesh)) for s in (rollout, reward))
    scoring: list[Stage] = []
    logged = ["scores", "mask", "prompt_mask", "iteration", "version"]
    if plan.old_logp:
        scoring.append(score(models.policy, temperature=rl.temperature))
        logged += ["old_logp", "entropy"]
    if plan.ref_every and plan.ref_stage:
        scoring.append(score(models.reference, outputs=("ref_logp",), temperature=rl.temperature))
        logged.append("ref_logp")
    return [rollout, reward], scoring, logged


def _graph(
    cfg: Config,
    models: Models,
    algo: algos.Recipe,
    opt: Optimiser,
    steps: StepMetrics,
    rollout: Stage | None,
    rewards: RewardPool,
    task: Any,
    world: World,
    on_step_end: Callable[[int], Any],
    plan: ScoringPlan,
) -> StageGraph:
    """The step's stages: rollout, reward and scoring forwards (when rows are sampled), the recipe's, the update."""
    rl = cfg.rl
    sampling, scoring, logged = _sampling_stages(cfg, models, rollout, rewards, task, world, plan)
    part = stages_for(algo).graph(
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
            dispatch=balanced_rows(world.group) if world.group is not None else None,
        )
    )
    stages = [*sampling, *part.ahead, *scoring, *part.stages]
    forward, inputs, recipe = part.forward, part.inputs, part.recipe
    if rl.multi_turn is not None:  # the environments score; the forwards attend the observation tokens
        # The config takes multi-turn rollouts with the policy-gradient recipes only.
        stages, forward, inputs = multi_turn_graph(stages, forward, inputs, cast(algos.Algorithm, algo))
    if world.cp is None and world.group is not None:  # the metrics of the whole batch on every rank
        recipe = DataParallelRecipe(recipe, world.group)
    stages.append(
        update_stage(
            forward,
            recipe,
            opt,
            inputs=list(dict.fromkeys(inputs)),
            micro_batch=rl.mini_batch_size * rl.n_samples,
            process_group=world.group,
            on_metrics=steps.on_metrics,
            on_iteration_end=on_step_end,
            epochs=part.epochs,
            dispatch=part.dispatch,
        )
    )
    return StageGraph([steps.timed(s) for s in stages], sources=task.columns, schema=COLUMNS)


def train(
    cfg: Config,
    *,
    resume: bool = False,
    engine: InferenceEngine | None = None,
    algo: algos.Recipe | None = None,
    reward: Any = None,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> Run:
    """Run the config's training job; rank 0 writes metrics JSONL, checkpoints and the plots to ``trainer.output_dir``.

    Args:
      cfg: a validated :class:`rlcore.train.config.Config`.
      resume: continue from the DCP checkpoint in ``trainer.output_dir/checkpoint/`` (saved at any world size; same seed, same data order).
      engine: an :class:`InferenceEngine` to sample with instead of the in-process one
        (it receives the weights after every update through the weight-sync path).
      algo: a recipe (an :class:`rlcore.algos.Algorithm` or :class:`rlcore.algos.DPO`) replacing the one
        named by ``rl.algo``.
      reward: a reward replacing the task's rule reward (a ``(prompts, responses, **columns)``
        callable or a ``BaseReward``-style object; it receives ``answers``).
      overwrite: replace a run already in ``trainer.output_dir`` (else a new run there is refused).
      allow_config_change: resume with hyper-parameters that differ from the checkpoint's.
    """
    tr = cfg.trainer
    if tr.threads:
        torch.set_num_threads(tr.threads)
    device = get_device()
    if device.type != "cpu":
        device = get_device(index=int(os.environ.get("LOCAL_RANK", "0")))
    launched = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_launch(cfg if engine is None else replace(cfg, deploy=replace(cfg.deploy, mode="co-located")), launched)
    if cfg.deploy.async_infer and launched > 1:
        raise ValueError(
            "config key 'deploy.async_infer': got true at world size "
            f"{launched}, expected false (the sharded models' collectives need every rank to run the stages in one "
            "order, which the blocking pipeline guarantees; asynchronous rollout runs at world size 1)"
        )
    if engine is not None and cfg.rl.multi_turn is not None:
        raise ValueError(
            "engine: got an InferenceEngine with rl.multi_turn set, expected None (that rollout samples itself)"
        )
    check_lora_launch(cfg, launched)
    world = World(cfg, device)
    ok = False
    try:
        prepare_run_dir(tr.output_dir, resume=resume, overwrite=overwrite, leader=world.rank == 0)
        task = make_prompt_source(cfg, task_options(cfg), world_size=world.dp_size)
        if cfg.rl.multi_turn is not None:  # tools, environment and stop tokens: refused before the warm-up
            check_multi_turn(cfg, task)
        if task.dataset is not None and world.rank == 0:
            print(task.summary(), flush=True)
        run = _train(
            cfg,
            world,
            task,
            device,
            resume=resume,
            engine=engine,
            algo=algo,
            reward=reward,
            allow_config_change=allow_config_change,
        )
        ok = True
    finally:
        world.close(ok=ok)
    out = Path(tr.output_dir)
    if world.rank == 0 and tr.plot:
        plot_curves(read_metrics(out / "metrics.jsonl"), out / "curves.png")
        if run.tasks is not None:
            plot_timeline(run.tasks, out / "timeline.png", last=tr.timeline_iterations, offset=run.start)
    return Run(run.records, run.policy, run.critic)


class _Trained(NamedTuple):
    records: list[dict[str, Any]]
    policy: torch.nn.Module
    critic: torch.nn.Module | None
    tasks: Any
    start: int


def _train(
    cfg: Config,
    world: World,
    task: Any,
    device: torch.device,
    *,
    resume: bool,
    engine: InferenceEngine | None,
    algo: algos.Recipe | None,
    reward: Any,
    allow_config_change: bool,
) -> _Trained:
    tr, rl = cfg.trainer, cfg.rl
    recipe = algo or build_algorithm(cfg)
    policy, critic, replica = build_models(
        cfg, world, task.tokenizer.vocab_size, device, critic=stages_for(recipe).critic
    )
    shapes = {name: list(t.shape) for name, t in replica.state_dict().items()}  # recorded by every checkpoint
    out = Path(tr.output_dir)
    if resume:  # refused before anything loads: another config, other weights, fewer steps
        check_resume(out, cfg, shapes, allow_change=allow_config_change)
    if not resume and tr.warmup_steps:
        supervised_warmup(
            policy,
            task,
            cfg,
            process_group=world.group,
            rank=world.dp_rank,
            progress=tr.progress and world.rank == 0,
            context_parallel=world.cp,
        )
    reference = build_reference(policy, replica, world)
    models = Models(policy, reference, critic)
    opt = Optimiser(models, cfg, world)
    start = restore_run(out, models, opt, cfg) if resume else 0
    plan = scoring_plan(cfg, recipe, context_parallel=world.cp is not None)
    steps = StepMetrics(updates=rl.batch_size // rl.mini_batch_size * rl.epochs, start=start, ref_every=plan.ref_every)
    scorer = reward if reward is not None else task.reward
    # Offline DPO scores nothing during training: no reward worker processes.
    workers = 0 if isinstance(task, PreferencePrompts) else tr.reward_workers
    rewards = RewardPool(
        scorer, num_workers=workers, timeout=tr.reward_timeout, samples=_SAMPLE_ROWS * bool(tr.log_samples)
    )
    validator = None
    if tr.eval_every and task.val is not None:
        validator = Validator(
            cfg, task.val, task.tokenizer, scorer, rank=world.dp_rank, world_size=world.dp_size, group=world.group
        )
    deployment: Deployment | None = None
    end: StepEnd | None = None
    result = None
    # KeyboardInterrupt (Ctrl-C, and SIGTERM through the CLI) is not caught: it unwinds through
    # the finally below, which stops the reward workers and the rollout worker.
    try:
        deployment = make_deployment(
            cfg,
            models,
            opt,
            world,
            task,
            engine,
            replica,
            build_model=build_model,
        )
        end = StepEnd(
            cfg,
            world,
            task,
            models,
            opt,
            replica,
            deployment=deployment,
            rewards=rewards,
            steps=steps,
            start=start,
            resume=resume,
            shapes=shapes,
            validator=validator,
        )
        graph = _graph(cfg, models, recipe, opt, steps, deployment.rollout, rewards, task, world, end, plan)
        policy.train()
        if critic is not None:
            critic.train()
        steps.last_end = time.perf_counter()
        if tr.steps > start:
            blocking = not cfg.deploy.async_infer
            result = run_pipeline(
                graph,
                task.loader(world.dp_rank, start, rl.n_samples),
                num_prompts=rl.batch_size,
                n_samples=rl.n_samples,
                num_iterations=tr.steps - start,
                staleness=0 if blocking else cfg.deploy.staleness,
                blocking=blocking,
                switch=deployment.switch,
            )
    finally:
        rewards.close()
        if deployment is not None:
            deployment.close()
        if end is not None:
            end.close()
    records = end.records if end is not None else []
    return _Trained(records, policy, critic, result.tasks if result is not None else None, start)
