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

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import torch

from rlcore import algos
from rlcore.dataflow import TaskRecord, run_pipeline
from rlcore.train.build import build_algorithm, build_model, build_models, build_reference
from rlcore.train.carry import with_carry_over
from rlcore.train.chain import made_by_configs
from rlcore.train.config import Config
from rlcore.train.deploy import make_deployment
from rlcore.train.metrics import plot_run
from rlcore.train.optim import Models, Optimiser
from rlcore.train.preemption import StopRequest, stop_on_signals
from rlcore.train.prompts import run_prompt_source
from rlcore.train.recipe_stages import stages_for
from rlcore.train.rollout import InferenceEngine
from rlcore.train.run_state import check_resume, restore_run, run_extras
from rlcore.train.rundir import prepare_run_dir
from rlcore.train.scoring import scorers, scoring_plan
from rlcore.train.step_end import StepEnd
from rlcore.train.step_graph import host_threads, step_graph
from rlcore.train.step_metrics import StepMetrics
from rlcore.train.warmup import supervised_warmup
from rlcore.train.world import World, check_run, local_device, process_settings

__all__ = [
    "Run",
    "train",
]


class Run(NamedTuple):
    """What :func:`train` returns: the per-step metrics records, this rank's trained models, the pipeline's calls.

    ``tasks`` are the stage calls of the steps this run made (:class:`rlcore.dataflow.TaskRecord`:
    stage, iteration from the run's start, the dock's row ids, the policy version), or None when no
    step ran: a call whose worker died and handed its rows back is not among them.
    """

    records: list[dict[str, Any]]
    policy: torch.nn.Module
    critic: torch.nn.Module | None
    tasks: list[TaskRecord] | None = None


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
      algo: a recipe (an :class:`rlcore.algos.Algorithm` or :class:`rlcore.algos.DPO`) replacing ``rl.algo``'s.
      reward: a reward replacing the task's rule reward (a ``(prompts, responses, **columns)``
        callable or a ``BaseReward``-style object; it receives ``answers``).
      overwrite: replace a run already in ``trainer.output_dir`` (else a new run there is refused).
      allow_config_change: resume with hyper-parameters that differ from the checkpoint's.

    Raises:
      Preempted: a signal of ``trainer.stop_signals`` arrived; the step under way finished and
        is saved (``resume=True`` continues), :func:`rlcore.train.preemption.stop_on_signals`.
    """
    # model.teacher / model.init_from given as configs: their models are trained first.
    cfg = made_by_configs(cfg, resume=resume, overwrite=overwrite)
    tr = cfg.trainer
    process_settings(cfg)
    check_run(cfg, engine=engine is not None)
    with (
        stop_on_signals(tr.stop_signals, timeout=tr.stop_timeout) as stop,
        World(cfg, local_device()).session() as world,
    ):
        prepare_run_dir(tr.output_dir, resume=resume, overwrite=overwrite, leader=world.rank == 0)
        task = run_prompt_source(cfg, world_size=world.dp_size, leader=world.rank == 0)
        run = _train(cfg, world, task, resume, engine, algo or build_algorithm(cfg), reward, allow_config_change, stop)
    if world.rank == 0 and tr.plot:
        plot_run(tr.output_dir, run.tasks, last=tr.timeline_iterations, offset=run.start)
    return Run(run.records, run.models.policy, run.models.critic, run.tasks)


class _Trained(NamedTuple):
    records: list[dict[str, Any]]
    models: Models
    tasks: list[TaskRecord] | None
    start: int


def _train(
    cfg: Config,
    world: World,
    task: Any,
    resume: bool,
    engine: InferenceEngine | None,
    recipe: algos.Recipe,
    reward: Any,
    allow_config_change: bool,
    stop: StopRequest,
) -> _Trained:
    """Build the models, the optimisers and the step's stages over the deployment; run the pipeline."""
    tr, rl, out = cfg.trainer, cfg.rl, Path(cfg.trainer.output_dir)
    policy, critic, replica = build_models(
        cfg, world, task.tokenizer.vocab_size, world.device, critic=stages_for(recipe).critic
    )
    shapes = {name: list(t.shape) for name, t in replica.state_dict().items()}  # recorded by every checkpoint
    if resume:  # refused before anything loads: another config, other weights, fewer steps
        check_resume(out, cfg, shapes, allow_change=allow_config_change)
    elif tr.warmup_steps:
        supervised_warmup(policy, task, cfg, world, progress=tr.progress and world.rank == 0)
    models = Models(policy, build_reference(policy, replica, world, teacher=cfg.model.teacher), critic)
    opt = Optimiser(models, cfg, world)
    # The replay buffer, the curriculum, the entropy controller, the carried rows: saved with the run.
    extras = run_extras(cfg, task, ranks=world.dp_size)
    start = restore_run(out, models, opt, cfg, extras) if resume else 0
    plan = scoring_plan(cfg, recipe, context_parallel=world.cp is not None)
    steps = StepMetrics.of_run(cfg, start=start, ref_every=plan.ref_every)
    rewards, validator = scorers(cfg, task, reward, world, components=algos.scoring_needs(recipe).score_parts)
    result = None
    # Errors, Preempted (a stop signal) and KeyboardInterrupt (Ctrl-C) unwind the stack: workers and writers stop.
    with ExitStack() as stack:
        stack.callback(rewards.close)
        deployment = make_deployment(cfg, models, opt, world, task, engine, replica, build_model=build_model)
        stack.callback(deployment.close)
        carry = with_carry_over(cfg, deployment.rollout, task, world, start, extras)
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
            stop=stop,
            extras=extras,
        )
        stack.callback(end.close)
        source = carry.source
        graph = step_graph(
            cfg, models, recipe, opt, steps, carry.rollout, rewards, source, world, end, plan, extras=extras
        )
        models.train()
        steps.last_end = time.perf_counter()
        if tr.steps > start:
            result = run_pipeline(
                graph,
                source.loader(world.dp_rank, start, rl.n_samples),
                num_prompts=rl.batch_size,
                n_samples=rl.n_samples,
                num_iterations=tr.steps - start,
                staleness=cfg.deploy.staleness if cfg.deploy.async_infer else 0,
                blocking=not cfg.deploy.async_infer,
                switch=deployment.switch,
                threads=host_threads(world, graph),
            )
    return _Trained(end.records, models, result.tasks if result is not None else None, start)
