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

import copy
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rlcore import algos, seeding
from rlcore.dataflow import Stage, StageGraph, run_pipeline
from rlcore.device import get_device
from rlcore.models import (
    AdaptersOff,
    export_hf,
    from_hf,
    is_lora,
    load_causal_lm,
    sharded_token_logprobs,
    token_logprobs,
)
from rlcore.ops import masked_sum
from rlcore.rewards import RewardPool, reward_log_values
from rlcore.train.agent_stages import check_multi_turn, multi_turn_graph
from rlcore.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from rlcore.train.config import Config, check_launch
from rlcore.train.context_parallel import (
    DataParallelRecipe,
    check_context_parallel_model,
    cp_logprob_stage,
    replica_groups,
    replicate_stage,
)
from rlcore.train.deploy import Deployment, make_deployment
from rlcore.train.lora import adapter_modules, attach_lora, check_lora_launch
from rlcore.train.metrics import MetricsLog, plot_curves, plot_timeline, read_metrics
from rlcore.train.parallel import clip_grad_norm, device_mesh, full_state_dict, parallelize
from rlcore.train.prompts import PreferencePrompts, make_prompt_source, task_options
from rlcore.train.recipe_stages import StepParts, stages_for
from rlcore.train.rollout import InferenceEngine, left_pad
from rlcore.train.rundir import check_resume_config, check_resume_shapes, check_resume_steps, prepare_run_dir
from rlcore.train.scoring import ScoringPlan, scoring_plan
from rlcore.train.stages import (
    balanced_rows,
    logprob_stage,
    response_sequences,
    update_stage,
)
from rlcore.train.tagged_metrics import Metric, all_reduce_metrics, as_tensors, maximum, mean, merge_into, total
from rlcore.train.validation import Validator

__all__ = [
    "Run",
    "build_algorithm",
    "build_model",
    "supervised_warmup",
    "train",
]

# Rows of a step written to samples.jsonl (trainer.log_samples), spread over the leader's batch.
_SAMPLE_ROWS = 4


class Run(NamedTuple):
    """What :func:`train` returns: the per-step metrics records and this rank's trained models."""

    records: list[dict[str, Any]]
    policy: torch.nn.Module
    critic: torch.nn.Module | None


def build_model(cfg: Config, vocab_size: int, *, critic: bool = False) -> torch.nn.Module:
    """The config's model through :func:`rlcore.models.load_causal_lm`: a causal LM, or with ``critic=True`` a value head.

    ``model.model_name_or_path`` is a local directory or an inline HF config (random
    initialisation from the global stream, which the trainer seeds; ``vocab_size``
    defaults to the task tokenizer's).
    """
    m = cfg.model
    return load_causal_lm(
        m.model_name_or_path,
        dtype=m.torch_dtype,
        seed=None,
        vocab_size=vocab_size,
        value_head=critic,
        use_flash_attention=m.use_flash_attention,
        what="config key 'model.model_name_or_path'",
    )


def build_algorithm(cfg: Config) -> algos.Recipe:
    """The rlcore recipe named by ``rl.algo``, with ``rl.beta`` as its KL coefficient when set."""
    rl, beta = cfg.rl, cfg.rl.beta
    if rl.algo == "dpo":
        return algos.dpo() if beta is None else algos.dpo(beta=beta)
    if rl.algo in ("grpo", "ppo", "rloo", "reinforce_pp"):
        recipe = getattr(algos, rl.algo)
        return recipe() if beta is None else recipe(kl_coef=beta)
    if rl.algo == "dapo":
        # Soft overlong punishment over the last quarter of the generation budget.
        algo = algos.dapo(max_length=rl.max_new_tokens, cache_length=max(1, rl.max_new_tokens // 4))
    else:
        algo = getattr(algos, rl.algo)()
    # Recipes without a KL term get one by composition when beta is set.
    return algo if not beta else algo._replace(kl=partial(algos.kl_penalty, estimator="k3"), kl_coef=beta)


class _World:
    """This process's place in the ``("dp", "cp", "tp")`` device mesh (one process when not launched by torchrun).

    Every sum over data (global counts, metric means, the data split of the prompts) uses
    the data-parallel group; the models' gradients cross ranks only inside FSDP2 and
    DTensor (:func:`rlcore.train.parallel.parallelize`). The ranks of a context-parallel
    group hold the same rows and split each sequence (:mod:`rlcore.train.context_parallel`).
    """

    def __init__(self, cfg: Config, device: torch.device):
        par = cfg.parallel
        self.owns_group = not dist.is_initialized()
        self.mesh = device_mesh(
            par.data_parallel,
            par.tensor_parallel,
            pipeline_parallel=par.pipeline_parallel,
            context_parallel=par.context_parallel,
            device=device,
        )
        self.size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.dp_size = self.mesh["dp"].size()
        self.dp_rank = self.mesh.get_local_rank("dp")
        # The data-parallel group the counts and metrics are summed over (None: nothing to sum).
        self.group = self.mesh.get_group("dp") if self.dp_size > 1 else None
        self.sharded = self.size > 1
        # The context-parallel group and mode the forwards split sequences over (None: cp = 1).
        self.cp: tuple[Any, str] | None = None
        if self.mesh["cp"].size() > 1:
            self.cp = (self.mesh.get_group("cp"), par.cp_mode)

    def close(self, *, ok: bool = True) -> None:
        """Destroy the process group this trainer started: after a barrier when the run succeeded.

        After an error no barrier is entered (a peer may never reach it); the group is
        destroyed all the same so that the process can exit.
        """
        if self.owns_group and dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()
            self.owns_group = False

    def any(self, flag: torch.Tensor) -> bool:
        """True on every rank when ``flag`` (a 0-d float) is non-zero on any rank."""
        if self.sharded:
            dist.all_reduce(flag)
        return bool(flag.item() > 0)  # sync-ok: the trainer's stop decision

    def reduce(self, metrics: dict[str, Metric]) -> dict[str, Metric]:
        """One step's metrics merged over the data-parallel ranks, each as it declares (:mod:`rlcore.train.tagged_metrics`)."""
        return all_reduce_metrics(metrics, self.group)


def _clip(params: Sequence[torch.Tensor], max_norm: float, sharded: bool) -> None:
    """Clip the total gradient norm: DTensor-aware when the model is sharded, torch's own otherwise."""
    if sharded:
        clip_grad_norm(params, max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def _shard_critic(critic: torch.nn.Module, world: _World) -> None:
    """FSDP2 over ``dp`` for the critic (a token-classification head: one unit per decoder layer and the root)."""
    if world.mesh["tp"].size() > 1:
        raise ValueError(
            "config key 'parallel.tensor_parallel': got "
            f"{world.mesh['tp'].size()} with rl.algo 'ppo', expected 1 (the critic is not tensor parallel; "
            "use data parallelism)"
        )
    if world.dp_size == 1:
        return
    backbone: Any = getattr(critic, str(critic.base_model_prefix))
    layers = backbone.layers
    units = [fully_shard(layer, mesh=world.mesh["dp"]) for layer in layers]
    units.append(fully_shard(critic, mesh=world.mesh["dp"]))
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)


class _Models(NamedTuple):
    policy: torch.nn.Module
    reference: torch.nn.Module
    critic: torch.nn.Module | None


def adamw(params: Sequence[Any], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """``torch.optim.AdamW``, its fused kernel where it runs (one call for all tensors, not ~10 per tensor).

    Fused AdamW takes plain CPU or CUDA tensors; sharded (DTensor) parameters and other
    devices keep the default implementation.
    """
    fused = bool(params) and all(
        not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params
    )
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


class _Optimiser:
    """Backward (FSDP2 sums the gradients over ``dp``), clipping and the optimiser steps: the update stage's ``step``."""

    def __init__(self, models: _Models, cfg: Config, world: _World):
        rl = cfg.rl
        self.params = [p for p in models.policy.parameters() if p.requires_grad]  # LoRA: the adapters
        self.opts = [adamw(self.params, lr=rl.lr, weight_decay=rl.weight_decay)]
        if models.critic is not None:
            self.params += list(models.critic.parameters())
            self.opts.append(adamw(list(models.critic.parameters()), lr=rl.critic_lr, weight_decay=rl.weight_decay))
        self.world, self.grad_clip = world, rl.grad_clip

    def __call__(self, loss: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        step = int(rows["iteration"][0])
        if self.world.any((~torch.isfinite(loss.detach())).float()):
            raise FloatingPointError(
                f"step {step}: the loss is not finite ({loss.item()}); stopped before the optimiser step, "
                "the last checkpoint is untouched"
            )
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_clip:
            _clip(self.params, self.grad_clip, self.world.sharded)
        for opt in self.opts:
            opt.step()


# --- checkpoints: the one place the run's state is saved and restored -------------------------


def _state(step: int, models: _Models, opt: _Optimiser, cfg: Config) -> dict[str, Any]:
    """What a checkpoint holds: the models with their optimisers (DCP shards), the step, the random streams."""
    lora = is_lora(models.policy)  # the adapters alone; the base (and reference) is the model directory's
    state: dict[str, Any] = {
        "step": step,
        "policy": (adapter_modules(models.policy) if lora else models.policy, opt.opts[0]),
        **({} if lora else {"reference": models.reference}),
        # The global stream: the update's dropout (critic) draws from it.
        "rng": rng_state(),
        "config": cfg.to_dict(),
    }
    if models.critic is not None:
        state["critic"] = (models.critic, opt.opts[1])
    return state


def _save(out: Path, step: int, models: _Models, opt: _Optimiser, cfg: Config, shapes: dict[str, list[int]]) -> None:
    """Every rank calls it: DCP writes each rank's shards (a run saved at 2 ranks resumes at 1).

    ``shapes`` (the model's tensor shapes, checked by a resume before anything loads) is saved beside the state.
    """
    save_checkpoint(out, {**_state(step, models, opt, cfg), "model_shapes": shapes}, step=step + 1)


def _restore(out: Path, models: _Models, opt: _Optimiser, cfg: Config) -> int:
    """Load the committed checkpoint into the (sharded) models and optimisers, in place; the next step."""
    data = load_checkpoint(out, _state(0, models, opt, cfg))
    for o in opt.opts:
        # Loaded tensors may share the file's storage, which cannot be resized: the
        # co-located swap offloads the optimiser state by resizing storages to 0.
        for values in o.state.values():
            for k, v in values.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                    values[k] = v.clone()
    set_rng_state(data["rng"])
    return int(data["step"]) + 1


# --- the supervised warm-up ------------------------------------------------------------------


def supervised_warmup(
    policy: torch.nn.Module,
    task: Any,
    cfg: Config,
    *,
    process_group: Any = None,
    rank: int = 0,
    progress: bool = False,
    context_parallel: tuple[Any, str] | None = None,
) -> torch.Tensor:
    """Supervised warm-up on the task's reference answers (token-mean cross-entropy over the response).

    Args:
      policy: the policy, unsharded or sharded by :func:`rlcore.train.parallel.parallelize`
        (FSDP2 then sums the gradients over the data-parallel ranks).
      task: the task whose reference answers are the targets.
      cfg: the run's config (``trainer.warmup_*``, ``rl.weight_decay``, ``rl.grad_clip``).
      process_group: the data-parallel group (None: one data-parallel rank). Each step
        samples ``warmup_batch_size`` prompts per rank as one global batch and this rank
        takes its share, so the run is the same at any data-parallel size.
      rank: this process's rank in ``process_group``.
      progress: show a progress bar.
      context_parallel: ``(group, mode)``: split each sequence over that context-parallel
        group (every rank of it takes the same rows), or None.

    Returns:
      ``[warmup_steps]`` the detached loss of each step (this rank's value).
    """
    tr = cfg.trainer
    params = [p for p in policy.parameters() if p.requires_grad]
    sharded = any(isinstance(p, DTensor) for p in params)
    apply, named = from_hf(policy)
    opt = adamw(params, lr=tr.warmup_lr, weight_decay=cfg.rl.weight_decay)
    device = params[0].to_local().device if isinstance(params[0], DTensor) else params[0].device
    ranks = dist.get_world_size(process_group) if process_group is not None else 1
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=tr.warmup_steps, desc="warm-up", dynamic_ncols=True)
    # The prompt source names the task's own traces (``warmup_batch``, None: prompt + answer).
    traces = getattr(task, "warmup_batch", None)
    losses = []
    policy.train()
    try:
        for step in range(tr.warmup_steps):
            size = tr.warmup_batch_size
            samples = task.sample(size * ranks, seeding.generator(tr.seed, seeding.Purpose.WARMUP, step))[
                rank * size : (rank + 1) * size
            ]
            if traces is not None:  # a task with its own traces (rlcore.agent.Multiplication: tool calls)
                seq = {k: v.to(device) for k, v in traces(samples).items()}
            else:
                seq = response_sequences(
                    task.tokenizer, [s["prompt"] for s in samples], [s["answer"] for s in samples], device
                )
            if context_parallel is None:
                logp = token_logprobs(apply, named, seq)  # aligned with the token it scores, like seq["mask"]
                mask = seq["mask"]
                counts = algos.global_counts(mask, process_group=process_group)
            else:  # this rank's share of the tokens, with the counts of the whole batch
                cp_group, cp_mode = context_parallel
                logp, _, scored = sharded_token_logprobs(apply, named, seq, group=cp_group, mode=cp_mode)
                mask = seq["mask"] * scored
                counts = algos.sequence_sharded_counts(mask, cp_group=cp_group, dp_group=process_group)
            loss = algos.aggregate(-logp, mask, mode="token-mean", num_tokens=counts["num_tokens"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            _clip(params, cfg.rl.grad_clip or math.inf, sharded)
            opt.step()
            losses.append(loss.detach())
            if bar is not None:
                bar.set_postfix({"loss": f"{loss.item():.3g}"}, refresh=False)  # sync-ok: progress display
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return torch.stack(losses) if losses else torch.zeros(0)


# --- the prompt loader ------------------------------------------------------------------------


def _loader(task: Any, cfg: Config, rank: int, start: int, n: int, ranks: int = 1) -> Callable[[int], dict[str, Any]]:
    """Pipeline iteration ``i`` -> the source columns of step ``start + i``: each prompt repeated ``n`` times.

    The step's global batch (``rl.batch_size`` prompts per data-parallel rank) is drawn
    from one stream and data-parallel rank ``rank`` of ``ranks`` takes its share; ``row``
    is each row's index in the global batch (``rank * rows + local row``), which keys
    its sampling stream.
    """
    tok = task.tokenizer
    size = cfg.rl.batch_size

    def load(i: int) -> dict[str, Any]:
        step = start + i
        drawn = task.sample(size * ranks, seeding.generator(cfg.trainer.seed, seeding.Purpose.DATA, step))
        samples = drawn[rank * size : (rank + 1) * size]
        prompts, pmask = left_pad([tok.encode(s["prompt"]) for s in samples], tok.pad_token_id)
        rows = len(samples) * n
        return {
            "prompts": prompts.repeat_interleave(n, 0),
            "prompt_mask": pmask.repeat_interleave(n, 0),
            "answers": [a for a in (torch.tensor(tok.encode(s["answer"])) for s in samples) for _ in range(n)],
            "group": torch.arange(len(samples)).repeat_interleave(n),
            "iteration": torch.full((rows,), step, dtype=torch.int64),
            "row": torch.arange(rows) + rank * rows,
        }

    return load


# --- per-step metrics and the timeline -------------------------------------------------------


class _Steps:
    """Accumulates one step's metrics over its updates; at the step's end, the record (logged, checkpointed)."""

    def __init__(self, updates: int, start: int, ref_every: int = 1):
        self.updates, self.start, self.ref_every = updates, start, ref_every
        self.lock = threading.Lock()
        # Per step: the logged metrics, and the counts the logged ratios are made of.
        self.sums: dict[int, tuple[dict[str, Metric], dict[str, Metric]]] = {}
        self.spans: list[tuple[str, str, float, float]] = []
        self.last_end = time.perf_counter()

    def on_metrics(self, b: dict[str, torch.Tensor], loss: torch.Tensor, metrics: dict[str, Any]) -> None:
        step = int(b["iteration"][0])
        # The recipe's metrics are the whole batch's on every rank (DataParallelRecipe): averaged;
        # the update's own (e.g. the dispatch's balance) come tagged. The loss is this rank's share
        # of a loss normalised by global counts: the step's loss adds the shares' means over updates.
        stats = {
            "loss": total(loss.detach().float() / self.updates),
            **{k: v if isinstance(v, Metric) else mean(v) for k, v in metrics.items()},
        }
        counts = {
            "rows": total(float(b["iteration"].shape[0])),
            "prompt_tokens": total((b["prompt_mask"] != 0).sum()),
        }
        if "scores" not in b:  # offline DPO: the dataset's pairs, no rollout (mean of both responses' lengths)
            counts["response_tokens"] = total(((b["chosen_mask"] != 0).sum() + (b["rejected_mask"] != 0).sum()) / 2)
        else:
            mask = b["mask"]
            lag = (b["iteration"] - self.start - b["version"]).float()  # versions counted from this run's first step
            if self.ref_every and step % self.ref_every == 0:  # the steps the reference forward ran
                counts["kl"] = total(masked_sum(algos.kl_penalty(b["old_logp"], b["ref_logp"], estimator="k3"), mask))
            counts.update(
                reward=total(b["scores"].float().sum()),
                entropy=total(masked_sum(b["entropy"], mask)),
                tokens=total(mask.float().sum()),
                response_tokens=total((mask != 0).sum(-1).float().sum()),
                lag=total(lag.sum()),
                lag_max=maximum(lag.max()),
            )
        with self.lock:
            acc = self.sums.setdefault(step, ({}, {}))
            merge_into(acc[0], stats)
            merge_into(acc[1], counts)

    def timed(self, s: Stage) -> Stage:
        fn = s.fn

        def run(b: dict[str, torch.Tensor]) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(b)
            finally:
                with self.lock:
                    self.spans.append((s.name, s.resource, t0, time.perf_counter()))

        return dataclasses.replace(s, fn=run)

    def local(
        self, step: int, reduce: Callable[[dict[str, Metric]], dict[str, Metric]] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The step's metrics and its timing (busy seconds per stage, idle fraction per resource).

        ``reduce`` merges this rank's metrics with the other data-parallel ranks' before
        the ratios are taken (:meth:`_World.reduce`).
        """
        with self.lock:
            acc = self.sums.pop(step)
            now = time.perf_counter()
            window = max(now - self.last_end, 1e-9)
            spans = [(n, r, max(a, self.last_end), min(b, now)) for n, r, a, b in self.spans if b > self.last_end]
            self.spans = [sp for sp in self.spans if sp[3] > now]
            self.last_end = now
        stats, counts = acc
        if reduce is not None:
            stats, counts = reduce(stats), reduce(counts)
        out, c = as_tensors(stats), as_tensors(counts)
        rows = c["rows"]
        out.update(response_length=c["response_tokens"] / rows, prompt_length=c["prompt_tokens"] / rows)
        if "reward" in c:  # rollouts (not offline DPO)
            out.update(
                reward=c["reward"] / rows,  # the task reward, before any shaping
                entropy=c["entropy"] / c["tokens"],
                policy_lag=c["lag"] / rows,
                policy_lag_max=c["lag_max"],
            )
            if "kl" in c:  # k3 estimate of KL(rollout policy || reference) per token: the curve in the plot
                out["kl"] = c["kl"] / c["tokens"]
        timing: dict[str, float] = {"step_time_s": window}
        busy: dict[str, float] = {}
        for name, resource, a, b in spans:
            timing[f"busy_s/{name}"] = timing.get(f"busy_s/{name}", 0.0) + (b - a)
            busy[resource] = busy.get(resource, 0.0) + (b - a)
        for resource, seconds in busy.items():
            timing[f"bubble/{resource}"] = max(0.0, 1.0 - seconds / window)
        return out, timing


# --- deployment: rlcore.train.deploy places the rollout; the trainer gives it the rollout's random stream -----


def _sampling_stream(seed: int, batch: dict[str, torch.Tensor]) -> torch.Generator:
    """The random streams a rollout micro-batch samples with: one per row, keyed by its step and global row."""
    return seeding.RowStream(seed, seeding.Purpose.SAMPLING, int(batch["iteration"][0]), batch["row"])


# --- the assembly -----------------------------------------------------------------------------


def _sampling_stages(
    cfg: Config,
    models: _Models,
    rollout: Stage | None,
    rewards: RewardPool,
    task: Any,
    world: _World,
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
    models: _Models,
    algo: algos.Recipe,
    opt: _Optimiser,
    steps: _Steps,
    rollout: Stage | None,
    rewards: RewardPool,
    task: Any,
    world: _World,
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
    return StageGraph([steps.timed(s) for s in stages], sources=task.columns)


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
    world = _World(cfg, device)
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
    world: _World,
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
    # Every rank builds the same initial weights from the seed; the models are then sharded
    # (FSDP2 over "dp", tensor parallel over "tp"): the one place parallelism enters.
    torch.manual_seed(tr.seed)
    policy = build_model(cfg, task.tokenizer.vocab_size).to(device)
    critic = build_model(cfg, task.tokenizer.vocab_size, critic=True).to(device) if stages_for(recipe).critic else None
    replica = copy.deepcopy(policy).eval().requires_grad_(False)  # rollout / reference template, unsharded
    shapes = {name: list(t.shape) for name, t in replica.state_dict().items()}  # recorded by every checkpoint
    if world.cp is not None:
        check_context_parallel_model(policy.config, context_parallel=world.mesh["cp"].size(), mode=world.cp[1])
    if cfg.model.lora is not None:  # only the adapters train; the warm-up trains them too
        policy = attach_lora(policy, cfg)
    parallelize(policy, world.mesh, grad_reduce="sum")  # LoRA: FSDP2 over dp, base and adapters in each unit
    if critic is not None:
        _shard_critic(critic, world)
    out = Path(tr.output_dir)
    leader = world.rank == 0
    if resume:
        saved = load_checkpoint(out)
        check_resume_config(saved.get("config"), cfg.to_dict(), allow_change=allow_config_change)
        # The same model directory may hold other weights now: refuse before anything loads.
        check_resume_shapes(
            saved.get("model_shapes"), shapes, checkpoint=out / "checkpoint", model=str(cfg.model.model_name_or_path)
        )
        check_resume_steps(saved.get("step"), tr.steps, checkpoint=out / "checkpoint")
    if not resume and tr.warmup_steps:
        supervised_warmup(
            policy,
            task,
            cfg,
            process_group=world.group,
            rank=world.dp_rank,
            progress=tr.progress and leader,
            context_parallel=world.cp,
        )
    # The reference: the (warmed-up) policy's weights in a model of its own, sharded the same way.
    if is_lora(policy):  # the policy's own (sharded) modules with the adapters off: no second copy
        reference: torch.nn.Module = AdaptersOff(policy)
    else:
        reference = copy.deepcopy(replica)
        reference.load_state_dict(full_state_dict(policy))
        parallelize(reference, world.mesh, grad_reduce="sum")
    models = _Models(policy, reference, critic)
    opt = _Optimiser(models, cfg, world)
    start = _restore(out, models, opt, cfg) if resume else 0
    n = rl.n_samples
    plan = scoring_plan(cfg, recipe, context_parallel=world.cp is not None)
    steps = _Steps(updates=rl.batch_size // rl.mini_batch_size * rl.epochs, start=start, ref_every=plan.ref_every)
    log = (
        MetricsLog(
            out / "metrics.jsonl",
            total=tr.steps,
            start=start,
            progress=tr.progress,
            resume_step=start - 1 if resume else None,
        )
        if leader
        else None
    )
    records: list[dict[str, Any]] = []
    result = None
    scorer = reward if reward is not None else task.reward
    # Offline DPO scores nothing during training: no reward worker processes.
    workers = 0 if isinstance(task, PreferencePrompts) else tr.reward_workers
    rewards = RewardPool(
        scorer, num_workers=workers, timeout=tr.reward_timeout, samples=_SAMPLE_ROWS * bool(tr.log_samples)
    )
    sample_log = (
        MetricsLog(
            out / "samples.jsonl",
            total=tr.steps,
            start=start,
            progress=False,
            resume_step=start - 1 if resume else None,
        )
        if leader and tr.log_samples
        else None
    )
    deployment: Deployment | None = None
    validator = None
    if tr.eval_every and task.val is not None:
        validator = Validator(
            cfg,
            task.val,
            task.tokenizer,
            reward if reward is not None else task.reward,
            rank=world.dp_rank,
            world_size=world.dp_size,
            group=world.group,
        )
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
            sampling=partial(_sampling_stream, tr.seed),
            build_model=build_model,
        )
        dep = deployment

        def on_step_end(i: int) -> None:
            step = start + i
            dep.publish(i + 1)  # weights version i + 1 for the rows the scheduler stamps next
            local, timing = steps.local(step, world.reduce)
            extra = dep.rollout_metrics(step)
            if extra:  # the rollout's per-trajectory means, averaged over the ranks
                local.update(as_tensors(world.reduce({k: mean(v) for k, v in extra.items()})))
            metrics = {k: float(v) for k, v in local.items()}
            # The reward's counters (verified-maths timeouts, ...), summed over the data-parallel ranks.
            # Each weighted reward's mean raw score (reward/<name>) from the summed counters.
            counts = rewards.pop_metrics(step)
            if counts:
                summed = as_tensors(world.reduce({k: total(v) for k, v in counts.items()}))
                logged = reward_log_values({k: float(v) for k, v in summed.items()})
                metrics.update({f"reward/{k}": v for k, v in logged.items()})
            rows = rewards.pop_samples(step)
            if sample_log is not None and step % tr.log_samples == 0:
                for row in rows:
                    sample_log.write({"step": step, **row})
            samples = world.dp_size * rl.batch_size * n
            # As the seed system defines it: (prompt + response tokens) x samples / devices / step time.
            metrics["tokens_per_s_device"] = (
                (metrics["prompt_length"] + metrics["response_length"]) * samples / world.size / timing["step_time_s"]
            )
            record = {"step": step, **metrics, **timing, **dep.step_metrics(), **task.step_metrics(step)}
            if validator is not None and validator.due(step):
                record.update(validator(models.policy if world.size == 1 else replica, step))
            records.append(record)
            if log is not None:
                log.write(record)
            if (tr.save_every and (step + 1) % tr.save_every == 0) or step + 1 == tr.steps:
                _save(out, step, models, opt, cfg, shapes)  # every rank: DCP writes each rank's shards
                if tr.export:  # the policy as a Hugging Face directory beside the checkpoint
                    # A built-in task's character tokenizer is written as a transformers one.
                    hf_tok = task.tokenizer if task.hf_tokenizer is None else task.hf_tokenizer
                    if world.size == 1:
                        export_hf(models.policy, out / "hf", tokenizer=hf_tok)
                    else:  # gathered (collective), written into the unsharded architecture by rank 0
                        weights = full_state_dict(models.policy)
                        if leader:
                            export_hf(replica, out / "hf", tokenizer=hf_tok, params=weights)

        graph = _graph(cfg, models, recipe, opt, steps, dep.rollout, rewards, task, world, on_step_end, plan)
        policy.train()
        if critic is not None:
            critic.train()
        steps.last_end = time.perf_counter()
        if tr.steps > start:
            blocking = not cfg.deploy.async_infer
            result = run_pipeline(
                graph,
                _loader(task, cfg, world.dp_rank, start, n, world.dp_size)
                if task.dataset is None
                else task.loader(world.dp_rank, start, n),
                num_prompts=rl.batch_size,
                n_samples=n,
                num_iterations=tr.steps - start,
                staleness=0 if blocking else cfg.deploy.staleness,
                blocking=blocking,
                switch=dep.switch,
            )
    finally:
        rewards.close()
        if deployment is not None:
            deployment.close()
        if log is not None:
            log.close()
    return _Trained(records, policy, critic, result.tasks if result is not None else None, start)
