"""The supervised warm-up: token-mean cross-entropy on the task's reference answers before RL."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlcore import algos, seeding
from rlcore.models import from_hf, sharded_token_logprobs, token_logprobs
from rlcore.train.config import Config
from rlcore.train.optim import adamw, clip_gradients
from rlcore.train.stages import response_sequences

__all__ = ["supervised_warmup"]


def supervised_warmup(
    policy: torch.nn.Module,
    task: Any,
    cfg: Config,
    world: Any = None,
    *,
    progress: bool = False,
) -> torch.Tensor:
    """Supervised warm-up on the task's reference answers (token-mean cross-entropy over the response).

    Args:
      policy: the policy, unsharded or sharded by :func:`rlcore.train.parallel.parallelize`
        (FSDP2 then sums the gradients over the data-parallel ranks).
      task: the task whose reference answers are the targets.
      cfg: the run's config (``trainer.warmup_*``, ``rl.weight_decay``, ``rl.grad_clip``).
      world: the run's :class:`rlcore.train.World`, or None (one process). Each step
        samples ``warmup_batch_size`` prompts per data-parallel rank as one global batch
        and this rank takes its share, so the run is the same at any data-parallel size;
        with context parallelism each sequence is split over the context-parallel group
        (every rank of it takes the same rows).
      progress: show a progress bar.

    Returns:
      ``[warmup_steps]`` the detached loss of each step (this rank's value).
    """
    tr = cfg.trainer
    process_group, rank, context_parallel = (world.group, world.dp_rank, world.cp) if world else (None, 0, None)
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
            clip_gradients(params, cfg.rl.grad_clip or math.inf, sharded)
            opt.step()
            losses.append(loss.detach())
            if bar is not None:
                bar.set_postfix({"loss": f"{loss.item():.3g}"}, refresh=False)  # sync-ok: progress display
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return torch.stack(losses) if losses else torch.zeros(0)
