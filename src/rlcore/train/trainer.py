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

DPO replaces the scoring stages after the reward by ``pairs`` (chosen / rejected
sequences) and ``ref_pair_logps``, and runs the same update stage with the preference
recipe. The deployment (``deploy.*``) decides only how the pieces are placed:

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
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rlcore import algos, seeding
from rlcore.dataflow import (
    RayRolloutWorker,
    RolloutWorker,
    Stage,
    StageGraph,
    WeightSync,
    decoder_layout,
    load_into,
    param_meta,
    plan_reshard,
    run_pipeline,
    stage,
    unpack_weights,
)
from rlcore.device import get_device, memory_stats
from rlcore.memory import ColocatedSwitch, TrainState, allgather_swap_plan
from rlcore.models import (
    AdaptersOff,
    export_hf,
    from_hf,
    is_lora,
    sharded_token_logprobs,
    token_logprobs,
)
from rlcore.ops import masked_sum
from rlcore.rewards import RewardPool, reward_log_values
from rlcore.train.agent_stages import check_multi_turn, multi_turn_graph, multi_turn_rollout_stage
from rlcore.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from rlcore.train.config import Config, check_launch
from rlcore.train.context_parallel import (
    ContextParallelRecipe,
    DataParallelRecipe,
    check_context_parallel_model,
    cp_logprob_stage,
    cp_rl_forward,
    replica_groups,
    replicate_stage,
)
from rlcore.train.lora import adapter_modules, attach_lora, check_lora_launch
from rlcore.train.metrics import MetricsLog, plot_curves, plot_timeline, read_metrics
from rlcore.train.parallel import clip_grad_norm, device_mesh, full_state_dict, parallelize
from rlcore.train.prompts import PreferencePrompts, make_prompt_source, source_tokenizer, task_options
from rlcore.train.rollout import InferenceEngine, TorchEngine, left_pad
from rlcore.train.rundir import check_resume_config, check_resume_shapes, check_resume_steps, prepare_run_dir
from rlcore.train.stages import (
    PAIR_COLUMNS,
    advantages_stage,
    logprob_stage,
    preference_forward,
    preference_logps_stage,
    rl_forward,
    rollout_stage,
    update_stage,
    values_stage,
    with_logged_reference,
)
from rlcore.train.validation import Validator

__all__ = [
    "Run",
    "ScoringPlan",
    "build_algorithm",
    "build_model",
    "scoring_plan",
    "supervised_warmup",
    "train",
]

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
# Rows of a step written to samples.jsonl (trainer.log_samples), spread over the leader's batch.
_SAMPLE_ROWS = 4


class Run(NamedTuple):
    """What :func:`train` returns: the per-step metrics records and this rank's trained models."""

    records: list[dict[str, Any]]
    policy: torch.nn.Module
    critic: torch.nn.Module | None


def build_model(cfg: Config, vocab_size: int, *, critic: bool = False) -> torch.nn.Module:
    """A ``transformers`` causal LM (or, with ``critic=True``, a one-output token-classification head) from the config.

    ``model.model_name_or_path`` is a local directory or an inline HF config (random
    initialisation; ``vocab_size`` defaults to the task tokenizer's).
    """
    import transformers

    spec = cfg.model.model_name_or_path
    dtype = _DTYPES[cfg.model.torch_dtype]
    attn = "sdpa"
    if cfg.model.use_flash_attention:
        try:
            import flash_attn  # noqa: F401

            attn = "flash_attention_2" if torch.cuda.is_available() else "sdpa"
        except ImportError:
            warnings.warn(
                "model.use_flash_attention: flash-attn is not installed; using PyTorch SDPA attention", stacklevel=2
            )
    # transformers 4.56 renamed ``torch_dtype`` to ``dtype``.
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    extra: dict[str, Any] = {"dtype" if version >= (4, 56) else "torch_dtype": dtype, "attn_implementation": attn}
    auto = transformers.AutoModelForTokenClassification if critic else transformers.AutoModelForCausalLM
    head = {"num_labels": 1} if critic else {}
    if isinstance(spec, dict):
        options = {"vocab_size": vocab_size, **spec}
        hf_config = transformers.AutoConfig.for_model(options.pop("model_type"), **options, **head)
        model = auto.from_config(hf_config, **extra)
    else:
        model = auto.from_pretrained(spec, **extra, **head)
        # Weights loaded from safetensors may live in the file's memory map, whose storage cannot
        # be resized: the co-located swap offloads by resizing storages to 0.
        for p in model.parameters():
            p.data = p.data.clone()
    if model.config.vocab_size < vocab_size:
        raise ValueError(
            f"config key 'model.model_name_or_path': the model's vocab_size {model.config.vocab_size} is smaller "
            f"than the task tokenizer's {vocab_size}"
        )
    return model


def build_algorithm(cfg: Config) -> algos.Algorithm | algos.DPO:
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


# The loss is each rank's share of a loss normalised by global counts: summed over data-parallel ranks.
# The recipe's own metrics are already those of the whole batch (DataParallelRecipe, ContextParallelRecipe).
_SUMMED = frozenset({"loss"})


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

    def reduce(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step's metric sums combined over the data-parallel ranks (a sum and a max all-reduce).

        Sums (``_``-prefixed) and the loss (each rank holds its share of a loss normalised
        by global counts) are added; ``_lag_max`` is the maximum; the other metrics (the
        recipe's, already the whole batch's and equal on every rank) are averaged.
        """
        if self.group is None:
            return values
        names = [k for k in values if k != "_lag_max"]
        stacked = torch.stack([torch.as_tensor(values[k]).detach().float() for k in names])
        dist.all_reduce(stacked, group=self.group)
        out = {k: v if k.startswith("_") or k in _SUMMED else v / self.dp_size for k, v in zip(names, stacked)}
        if "_lag_max" in values:
            top = torch.as_tensor(values["_lag_max"]).detach().float().clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
            out["_lag_max"] = top
        return out


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


def _sequences(tok: Any, prompts: list[str], responses: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + response + <eos>`` ids with the response tokens marked, for SFT and DPO."""
    rows = [(tok.encode(p), tok.encode(r) + [tok.eos_token_id]) for p, r in zip(prompts, responses)]
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    attention, scored = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        scored[i, len(p) : len(p) + len(r)] = 1
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device), "mask": scored.to(device)}


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
                seq = _sequences(task.tokenizer, [s["prompt"] for s in samples], [s["answer"] for s in samples], device)
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


# --- the prompt loader and the DPO pairs ------------------------------------------------------


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


def _pairs_stage(task: Any, cfg: Config) -> Stage:
    """(reference answer, sampled answer) pairs; a correct sample is replaced by the answer plus a random letter."""
    tok = task.tokenizer

    def pairs(b: dict[str, torch.Tensor]) -> dict[str, Any]:
        step = int(b["iteration"][0])
        key = seeding.mix(cfg.trainer.seed, seeding.Purpose.PERTURB, step)
        keep = [(row, m != 0) for row, m in zip(b["prompts"], b["prompt_mask"])]
        prompts = [tok.decode(row[k].tolist()) for row, k in keep]
        answers = [tok.decode(row[k].tolist()) for row, k in zip(b["answers"], b["answers_mask"])]
        texts = [tok.decode(row[m != 0].tolist()) for row, m in zip(b["responses"], b["mask"])]
        noise = (seeding.row_uniforms(seeding.row_keys(key, b["row"]), 0) * len(tok.alphabet)).long().tolist()
        rejected = [
            t if s < 1 else a + tok.alphabet[k] for t, s, a, k in zip(texts, b["scores"].tolist(), answers, noise)
        ]
        out: dict[str, Any] = {}
        for side, responses in (("chosen", answers), ("rejected", rejected)):
            seq = _sequences(tok, prompts, responses, torch.device("cpu"))
            lengths = seq["attention_mask"].sum(-1).tolist()
            for k, v in seq.items():
                out[f"{side}_{k}"] = [row[:n] for row, n in zip(v, lengths)]
        return out

    return stage(
        pairs,
        inputs=["prompts", "prompt_mask", "answers", "responses", "mask", "scores", "iteration", "row"],
        outputs=list(PAIR_COLUMNS),
        name="pairs",
        resource="cpu",
    )


# --- which scoring forwards a step runs ---------------------------------------------------------


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

    DPO (its logged KL and entropy come from these forwards) and context parallelism
    (each rank's update holds its share of the tokens) keep both forwards.
    """
    rl = cfg.rl
    if isinstance(algo, algos.DPO) or context_parallel:
        return ScoringPlan(True, 1)
    needs = algos.scoring_needs(algo)
    # On-policy: the blocking pipeline samples with the weights the single update then trains.
    on_policy = not cfg.deploy.async_infer and rl.mini_batch_size == rl.batch_size and rl.epochs == 1
    skip_old = rl.old_logp == "auto" and on_policy and not needs.old_logp
    if needs.ref_logp:
        return ScoringPlan(not skip_old, 1)
    return ScoringPlan(not skip_old, cfg.trainer.log_ref_kl_every, ref_stage=False)


# --- per-step metrics and the timeline -------------------------------------------------------


class _Steps:
    """Accumulates one step's metrics over its updates; at the step's end, the record (logged, checkpointed)."""

    def __init__(self, updates: int, start: int, ref_every: int = 1):
        self.updates, self.start, self.ref_every = updates, start, ref_every
        self.lock = threading.Lock()
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.spans: list[tuple[str, str, float, float]] = []
        self.last_end = time.perf_counter()

    def on_metrics(self, b: dict[str, torch.Tensor], loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        step = int(b["iteration"][0])
        stats = {
            **{k: v.detach().float() / self.updates for k, v in {"loss": loss, **metrics}.items()},
            "_rows": torch.tensor(float(b["iteration"].shape[0])),
            "_prompt_length": (b["prompt_mask"] != 0).sum().float(),
        }
        if "scores" not in b:  # offline DPO: the dataset's pairs, no rollout (mean of both responses' lengths)
            stats["_response_length"] = ((b["chosen_mask"] != 0).sum() + (b["rejected_mask"] != 0).sum()).float() / 2
        else:
            mask = b["mask"]
            if self.ref_every and step % self.ref_every == 0:  # the steps the reference forward ran
                stats["_kl"] = masked_sum(algos.kl_penalty(b["old_logp"], b["ref_logp"], estimator="k3"), mask)
            stats.update(
                {
                    "_reward": b["scores"].float().sum(),
                    "_entropy": masked_sum(b["entropy"], mask),
                    "_tokens": mask.float().sum(),
                    "_response_length": (mask != 0).sum(-1).float().sum(),
                    # The scheduler counts versions from this run's first step.
                    "_lag": (b["iteration"] - self.start - b["version"]).float().sum(),
                    "_lag_max": (b["iteration"] - self.start - b["version"]).float().max(),
                }
            )
        with self.lock:
            acc = self.sums.setdefault(step, {})
            for k, v in stats.items():
                if k == "_lag_max":
                    acc[k] = torch.maximum(acc[k], v) if k in acc else v
                else:
                    acc[k] = acc[k] + v if k in acc else v

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
        self, step: int, reduce: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The step's metrics and its timing (busy seconds per stage, idle fraction per resource).

        ``reduce`` combines this rank's sums with the other data-parallel ranks' before
        the ratios are taken (:meth:`_World.reduce`).
        """
        with self.lock:
            acc = self.sums.pop(step)
            now = time.perf_counter()
            window = max(now - self.last_end, 1e-9)
            spans = [(n, r, max(a, self.last_end), min(b, now)) for n, r, a, b in self.spans if b > self.last_end]
            self.spans = [sp for sp in self.spans if sp[3] > now]
            self.last_end = now
        if reduce is not None:
            acc = reduce(acc)
        rows = acc.pop("_rows")
        out = {k: v for k, v in acc.items() if not k.startswith("_")}
        out.update(response_length=acc["_response_length"] / rows, prompt_length=acc["_prompt_length"] / rows)
        if "_reward" in acc:  # rollouts (not offline DPO)
            tokens = acc.pop("_tokens")
            out.update(
                reward=acc["_reward"] / rows,  # the task reward, before any shaping
                entropy=acc["_entropy"] / tokens,
                policy_lag=acc["_lag"] / rows,
                policy_lag_max=acc["_lag_max"],
            )
            if "_kl" in acc:  # k3 estimate of KL(rollout policy || reference) per token: the curve in the plot
                out["kl"] = acc["_kl"] / tokens
        timing: dict[str, float] = {"step_time_s": window}
        busy: dict[str, float] = {}
        for name, resource, a, b in spans:
            timing[f"busy_s/{name}"] = timing.get(f"busy_s/{name}", 0.0) + (b - a)
            busy[resource] = busy.get(resource, 0.0) + (b - a)
        for resource, seconds in busy.items():
            timing[f"bubble/{resource}"] = max(0.0, 1.0 - seconds / window)
        return out, timing


# --- deployment -------------------------------------------------------------------------------


def _serve_rollout(cfg_dict: dict[str, Any], vocab_size: int) -> Callable[..., dict[str, torch.Tensor]]:
    """Runs in the rollout worker process: an engine on a model of the config, loaded with each weights version."""
    from rlcore.train.config import parse_config

    cfg = parse_config(cfg_dict)
    model = build_model(cfg, vocab_size).eval()
    engine = _engine(cfg, model, source_tokenizer(cfg, task_options(cfg)))
    params = dict(model.named_parameters())
    loaded: list[Any] = [None]

    def generate(batch: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if loaded[0] is not weights:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name])
            loaded[0] = weights
        g = seeding.RowStream(cfg.trainer.seed, seeding.Purpose.SAMPLING, int(batch["iteration"][0]), batch["row"])
        r = engine.generate(batch["prompts"], batch["prompt_mask"], n=1, generator=g)
        return {"responses": r.responses, "mask": r.mask.float(), "version": batch["policy_version"].clone()}

    return generate


def _engine(cfg: Config, model: torch.nn.Module, tok: Any) -> TorchEngine:
    rl = cfg.rl
    return TorchEngine(
        model,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=rl.max_new_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=rl.top_k,
    )


def in_place_rollout(cfg: Config, device: torch.device) -> bool:
    """Whether a one-process co-located run samples from the training weights in place, without the swap.

    The AllGather-Swap frees device memory for the rollout by offloading the training
    state to the host and building the engine's weights in buckets. When the device *is*
    the host (the CPU), offloading moves bytes from RAM to RAM and frees nothing: the
    engine then reads the policy's own parameters (shared storage), which is exact in
    the blocking pipeline, where a rollout never overlaps an update. With
    ``deploy.async_infer`` the swap's snapshot keeps each rollout on one weights version.
    """
    return device.type == "cpu" and not cfg.deploy.async_infer


class _Deployment:
    """Where the rollout runs and how weights reach it: the pipeline's rollout stage, switch hook and sync.

    The rollout never runs on the sharded training module (ranks would run different
    numbers of forwards in its collectives): it runs on an unsharded replica, a user's
    engine or a worker process, fed through one :class:`rlcore.dataflow.WeightSync` from
    :func:`rlcore.train.parallel.full_state_dict` of the policy (collective: every rank
    publishes). A one-process co-located run instead swaps in place with the memory
    plan's AllGather-Swap.
    """

    def __init__(
        self,
        cfg: Config,
        models: _Models,
        opt: _Optimiser,
        world: _World,
        task: Any,
        engine: InferenceEngine | None,
        replica: torch.nn.Module,
    ):
        self.cfg, self.world = cfg, world
        self.worker: RolloutWorker | RayRolloutWorker | None = None
        self.switch: Callable[[str, str | None, str], None] | None = None
        self.syncs: list[tuple[float, int]] = []
        self.memory: dict[str, float] = {}
        self.rollout_metrics: Callable[[int], dict[str, torch.Tensor]] = lambda step: {}
        policy = models.policy
        self.device = next(replica.parameters()).device
        seed = cfg.trainer.seed
        timeout = cfg.deploy.rollout_timeout or None
        names = [name for name, _ in replica.named_parameters()]
        lora = is_lora(policy)

        def full_weights() -> dict[str, torch.Tensor]:
            weights = full_state_dict(policy)  # LoRA: the merged weights, under the base names
            return {name: weights[name] for name in names}

        def sync_to(receiver: Callable[[Any], Any]) -> Callable[[int], None]:
            sync = WeightSync(full_weights())

            def publish(version: int) -> None:
                sync.params = full_weights()  # gathered anew after each update (collective when sharded)
                self._record(sync.sync(version, receiver))

            return publish

        if engine is not None:  # a user's engine: weights after every update, through the sync path
            self.publish = sync_to(lambda p: engine.load_weights(unpack_weights(p)))
            self.publish(0)
            self.rollout = rollout_stage(engine, seed=seed, timeout=timeout)
        elif cfg.deploy.mode == "disaggregated":
            serve_args = (cfg.to_dict(), task.tokenizer.vocab_size)
            if cfg.deploy.backend == "ray":  # a Ray actor; the weight packets travel through Ray's object store
                self.worker = RayRolloutWorker(_serve_rollout, args=serve_args, threads=max(1, cfg.trainer.threads))
            else:
                self.worker = RolloutWorker(
                    _serve_rollout, args=serve_args, threads=max(1, cfg.trainer.threads), join_timeout=5.0
                )
            # Start-up (spawn, imports, model build) happens before the first step, not inside it.
            self.worker.wait_ready(timeout=max(120.0, cfg.deploy.rollout_timeout))
            worker = self.worker
            sync = WeightSync(full_weights())

            def publish(version: int) -> None:
                sync.params = full_weights()
                self._record(sync.sync(version, partial(worker.publish, version)))

            self.publish = publish
            self.publish(0)
            self.rollout = worker.stage(
                inputs=["prompts", "prompt_mask", "iteration", "row"],
                outputs=["responses", "mask", "version"],
                resource="rollout",
                timeout=timeout,
            )
        elif world.sharded or lora:  # an unsharded replica fed by the weight sync (LoRA: merged weights)
            self.publish = sync_to(load_into(replica))
            self.publish(0)
            self.rollout = rollout_stage(_engine(cfg, replica, task.tokenizer), seed=seed, timeout=timeout)
        else:  # co-located in one process: the engine samples the policy's current weights
            if in_place_rollout(cfg, self.device):  # the device is the host: no swap
                named = dict(policy.named_parameters())
                for name, p in replica.named_parameters():
                    p.data = named[name].data  # shared storage: each optimiser step is seen by the next rollout
            else:  # the engine's weights are built by the AllGather-Swap at each switch to rollout
                self.switch = self._swap(policy, replica, opt)
            self.publish = lambda version: None
            self.rollout = rollout_stage(_engine(cfg, replica, task.tokenizer), seed=seed, timeout=timeout)
            if cfg.rl.multi_turn is not None:  # rlcore.agent's multi-turn rollout, on the same weights
                agent = multi_turn_rollout_stage(cfg, replica, task, timeout=timeout)
                self.rollout, self.rollout_metrics = agent.stage, agent.pop_metrics

    def _swap(
        self, policy: torch.nn.Module, infer: torch.nn.Module, opt: _Optimiser
    ) -> Callable[[str, str | None, str], None]:
        """The co-located phase switch: the memory plan's AllGather-Swap builds ``infer``'s weights for each rollout."""
        engine_params = dict(infer.named_parameters())
        for p in engine_params.values():
            p.data = p.data.new_empty(0)  # bound to the inference buckets at each switch
        named = dict(policy.named_parameters())
        layout = decoder_layout(param_meta(named), dp=dist.get_world_size())
        plan = allgather_swap_plan(
            plan_reshard(param_meta(named), layout, layout),
            mesh=None,
            device=next(policy.parameters()).device,
            rank=dist.get_rank(),
        )
        state = TrainState(named)

        def bind(weights: dict[str, torch.Tensor]) -> None:
            for name, p in engine_params.items():
                p.data = weights[name]

        swap = ColocatedSwitch(state, plan, on_rollout=bind)
        peak = {
            "rollout": plan.memory.transition("train", "rollout").peak_bytes,
            "train": plan.memory.transition("rollout", "train").peak_bytes,
        }
        self.memory = {f"memory/predicted_peak_{k}_bytes": float(v) for k, v in peak.items()}

        def switch(resource: str, src: str | None, dst: str) -> None:
            if dst == "rollout":
                # The optimiser creates grads and its state lazily: the swap takes the current tensors.
                state.grads = [p.grad for p in policy.parameters()]
                state.optimizer = list(opt.opts[0].state.values())
                t0 = time.perf_counter()
                swap(resource, src, dst)
                self._record_sync(time.perf_counter() - t0, sum(b.nbytes for b in plan.reshard.buckets))
            else:
                swap(resource, src, dst)

        return switch

    def _record(self, record: Any) -> None:
        self._record_sync(record.seconds, record.nbytes)

    def _record_sync(self, seconds: float, nbytes: int) -> None:
        self.syncs.append((seconds, nbytes))

    def step_metrics(self) -> dict[str, float]:
        out = dict(self.memory)
        if self.syncs:
            seconds, nbytes = self.syncs[-1]
            out.update({"sync_s": seconds, "sync_bytes": float(nbytes)})
        stats = memory_stats(self.device)
        if stats.tracked and stats.peak_allocated is not None:
            out["memory/measured_peak_bytes"] = float(stats.peak_allocated)
        return out

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class _NoRollout:
    """The deployment of a run without rollouts (offline DPO on a preference dataset): nothing to place or sync."""

    switch = None
    rollout = None

    def publish(self, version: int) -> None:
        pass

    def rollout_metrics(self, step: int) -> dict[str, torch.Tensor]:
        return {}

    def step_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


# --- the assembly -----------------------------------------------------------------------------


def _graph(
    cfg: Config,
    models: _Models,
    algo: Any,
    opt: _Optimiser,
    steps: _Steps,
    rollout: Stage | None,
    rewards: RewardPool,
    task: Any,
    world: _World,
    on_step_end: Callable[[int], Any],
    plan: ScoringPlan,
) -> StageGraph:
    """The step's stages: rollout, reward, scoring, advantages (or DPO pairs), update; offline DPO: the pairs' update."""
    rl = cfg.rl
    if isinstance(task, PreferencePrompts):  # the dataset's pairs: reference log-probs, then the update
        update = update_stage(
            preference_forward(models.policy),
            algo if world.group is None else DataParallelRecipe(algo, world.group),
            opt,
            inputs=[*PAIR_COLUMNS, "ref_chosen_logps", "ref_rejected_logps", "prompt_mask", "iteration"],
            micro_batch=rl.mini_batch_size,
            process_group=world.group,
            on_metrics=steps.on_metrics,
            on_iteration_end=on_step_end,
        )
        stages = [preference_logps_stage(models.reference), update]
        return StageGraph(
            [steps.timed(s) for s in stages], sources=(*PAIR_COLUMNS, "prompt_mask", "iteration", "index")
        )
    assert rollout is not None
    n = 1 if rl.algo == "dpo" else rl.n_samples
    score: Any = logprob_stage
    reward = task.reward_stage(rewards)
    if world.cp is not None:  # sequences split over the cp ranks; rollout and reward once per cp group
        score = partial(cp_logprob_stage, group=world.cp[0], mode=world.cp[1])
        rollout, reward = (replicate_stage(s, replica_groups(world.mesh)) for s in (rollout, reward))
    stages = [rollout, reward]
    logged = ["scores", "mask", "prompt_mask", "iteration", "version"]
    if plan.old_logp:
        stages.append(score(models.policy, temperature=rl.temperature))
        logged += ["old_logp", "entropy"]
    if plan.ref_every and plan.ref_stage:
        stages.append(score(models.reference, outputs=("ref_logp",), temperature=rl.temperature))
        logged.append("ref_logp")
    if isinstance(algo, algos.DPO):
        recipe: Any = algo
        stages += [_pairs_stage(task, cfg), preference_logps_stage(models.reference)]
        forward = preference_forward(models.policy)
        inputs = [*PAIR_COLUMNS, "ref_chosen_logps", "ref_rejected_logps", *logged]
    else:
        recipe = algo
        needs = algos.scoring_needs(algo)
        scored = [
            "scores",
            "mask",
            "group",
            *(["old_logp"] if needs.old_logp else []),
            *(["ref_logp"] if needs.ref_logp else []),
        ]
        produced = ["advantages", "loss_mask"]
        if models.critic is not None:
            stages.append(values_stage(models.critic))
            scored.append("old_values")
            produced.append("returns")
        stages.append(advantages_stage(algo, inputs=scored, outputs=produced))
        forward = rl_forward(
            models.policy, critic=models.critic, temperature=rl.temperature, old_logp_from_update=not plan.old_logp
        )
        if plan.ref_every and not plan.ref_stage:  # logged only: no stage, the update runs it on its steps
            forward = with_logged_reference(forward, models.reference, every=plan.ref_every, temperature=rl.temperature)
        if world.cp is not None:
            forward = cp_rl_forward(models.policy, group=world.cp[0], mode=world.cp[1], temperature=rl.temperature)
            recipe = ContextParallelRecipe(algo, world.cp[0], dp_group=world.group)
        extra = ["old_values", "returns"] if models.critic is not None else []
        inputs = ["prompts", "responses", *produced[:2], *extra, *logged]
    if rl.multi_turn is not None:  # the environments score; the forwards attend the observation tokens
        stages, forward, inputs = multi_turn_graph(stages, forward, inputs, algo)
    if world.cp is None and world.group is not None:  # the metrics of the whole batch on every rank
        recipe = DataParallelRecipe(recipe, world.group)
    stages.append(
        update_stage(
            forward,
            recipe,
            opt,
            inputs=list(dict.fromkeys(inputs)),
            micro_batch=rl.mini_batch_size * n,
            process_group=world.group,
            on_metrics=steps.on_metrics,
            on_iteration_end=on_step_end,
            epochs=rl.epochs,
        )
    )
    sources = (
        "prompts",
        "prompt_mask",
        "answers",
        "group",
        "iteration",
        "row",
        *(("index",) if task.dataset is not None else ()),
    )
    return StageGraph([steps.timed(s) for s in stages], sources=sources)


def train(
    cfg: Config,
    *,
    resume: bool = False,
    engine: InferenceEngine | None = None,
    algo: algos.Algorithm | None = None,
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
      algo: an :class:`rlcore.algos.Algorithm` replacing the recipe named by ``rl.algo``.
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
    algo: algos.Algorithm | None,
    reward: Any,
    allow_config_change: bool,
) -> _Trained:
    tr, rl = cfg.trainer, cfg.rl
    # Every rank builds the same initial weights from the seed; the models are then sharded
    # (FSDP2 over "dp", tensor parallel over "tp"): the one place parallelism enters.
    torch.manual_seed(tr.seed)
    policy = build_model(cfg, task.tokenizer.vocab_size).to(device)
    critic = build_model(cfg, task.tokenizer.vocab_size, critic=True).to(device) if rl.algo == "ppo" else None
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
    n = 1 if rl.algo == "dpo" else rl.n_samples
    recipe = algo or build_algorithm(cfg)
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
    deployment: _Deployment | _NoRollout | None = None
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
        deployment = (
            _NoRollout()
            if isinstance(task, PreferencePrompts)
            else _Deployment(cfg, models, opt, world, task, engine, replica)
        )
        dep = deployment

        def on_step_end(i: int) -> None:
            step = start + i
            dep.publish(i + 1)  # weights version i + 1 for the rows the scheduler stamps next
            local, timing = steps.local(step, world.reduce)
            extra = dep.rollout_metrics(step)
            if extra:
                local.update(world.reduce(extra))
            metrics = {k: float(v) for k, v in local.items()}
            # The reward's counters (verified-maths timeouts, ...), summed over the data-parallel ranks.
            # Each weighted reward's mean raw score (reward/<name>) from the summed counters.
            counts = rewards.pop_metrics(step)
            if counts:
                summed = world.reduce({f"_{k}": torch.tensor(v) for k, v in sorted(counts.items())})
                logged = reward_log_values({k[1:]: float(v) for k, v in summed.items()})
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
