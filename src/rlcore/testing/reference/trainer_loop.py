"""The synchronous RL loop, written by hand: the oracle the pipeline trainer must reproduce.

This is the reference trainer as a plain loop (one process, no dock, no scheduler):
per step, sample the prompts, generate, score, compute the old / reference log-probs
(and critic values), the advantages of the whole batch, then one optimiser update per
mini-batch. :func:`rlcore.train.train` with a blocking, staleness-0 pipeline must give
the same losses and parameters (``tests/test_trainer_pipeline.py``).
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch

__all__ = ["LoopRun", "train_loop_ref"]


class LoopRun(NamedTuple):
    """The loop's per-update losses (step by step) and its trained models."""

    losses: list[list[float]]
    policy: torch.nn.Module
    critic: torch.nn.Module | None


def _logprobs(
    model: Any,
    prompts: torch.Tensor,
    pmask: torch.Tensor,
    responses: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from rlcore.models import token_logprobs

    apply, params = model
    batch = {"input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([pmask, mask.long()], 1)}
    logp, entropy = token_logprobs(apply, params, batch, temperature=temperature, with_entropy=True)
    width = prompts.shape[1]
    return logp[:, width:].float(), entropy[:, width:].float()


def _values(
    critic: torch.nn.Module, prompts: torch.Tensor, pmask: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    ids, attention = torch.cat([prompts, responses], 1), torch.cat([pmask, mask.long()], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return (
        critic(input_ids=ids, attention_mask=attention, position_ids=positions)
        .logits[:, prompts.shape[1] - 1 : -1, 0]
        .float()
    )


def train_loop_ref(cfg: Any, *, reward: Any = None) -> LoopRun:
    """Run ``cfg``'s policy-gradient job (not DPO) for ``trainer.steps`` steps as a hand-written loop.

    Same models, seeds, random streams and warm-up as :func:`rlcore.train.train`;
    rewards (the task's, or ``reward``) scored in this process; scoring models in eval mode.
    """
    # The trainer's building blocks (models, recipe, task, random streams) are shared;
    # imported here so that importing rlcore.testing does not load transformers.
    from rlcore import algos
    from rlcore.rewards import RewardPool
    from rlcore.seeding import Purpose, RowStream, generator
    from rlcore.train import (
        TorchEngine,
        build_algorithm,
        build_model,
        left_pad,
        make_task,
        supervised_warmup,
    )
    from rlcore.train.prompts import task_options

    rl, tr = cfg.rl, cfg.trainer
    if rl.algo == "dpo":
        raise ValueError("cfg: got rl.algo 'dpo', expected a policy-gradient algorithm")
    task = make_task(cfg.data.task, **task_options(cfg))
    tok = task.tokenizer
    torch.manual_seed(tr.seed)
    policy = build_model(cfg, tok.vocab_size)
    critic = build_model(cfg, tok.vocab_size, critic=True) if rl.algo == "ppo" else None
    if tr.warmup_steps:
        supervised_warmup(policy, task, cfg)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    params = list(policy.parameters())
    opts = [torch.optim.AdamW(params, lr=rl.lr, weight_decay=rl.weight_decay)]
    if critic is not None:
        params += list(critic.parameters())
        opts.append(torch.optim.AdamW(critic.parameters(), lr=rl.critic_lr, weight_decay=rl.weight_decay))
    algo = build_algorithm(cfg)
    assert isinstance(algo, algos.Algorithm), "DPO was refused above"
    from rlcore.models import from_hf

    policy_lm, reference_lm = from_hf(policy), from_hf(reference)
    engine = TorchEngine(
        policy,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=rl.max_new_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=rl.top_k,
    )
    rewards = RewardPool(task.reward if reward is None else reward, num_workers=0)
    n, losses = rl.n_samples, []
    policy.train()
    if critic is not None:
        critic.train()
    for step in range(tr.steps):
        samples = task.sample(rl.batch_size, generator(tr.seed, Purpose.DATA, step))
        prompts, pmask = left_pad([tok.encode(s["prompt"]) for s in samples], tok.pad_token_id)
        r = engine.generate(prompts, pmask, n=n, generator=RowStream(tr.seed, Purpose.SAMPLING, step))
        texts = [tok.decode(row) for row in r.responses.tolist()]
        repeated = [s for s in samples for _ in range(n)]
        scores = rewards.submit(
            [s["prompt"] for s in repeated], texts, batch=step, answers=[s["answer"] for s in repeated]
        ).result()
        mask = r.mask.float()
        for m in (policy, reference, critic):
            if m is not None:
                m.eval()
        with torch.no_grad():
            old_logp, _ = _logprobs(policy_lm, r.prompts, r.prompt_mask, r.responses, mask, rl.temperature)
            ref_logp, _ = _logprobs(reference_lm, r.prompts, r.prompt_mask, r.responses, mask, rl.temperature)
            extra = (
                {"old_values": _values(critic, r.prompts, r.prompt_mask, r.responses, mask)}
                if critic is not None
                else {}
            )
        policy.train()
        if critic is not None:
            critic.train()
        batch = {
            "scores": scores.float(),
            "group_ids": torch.arange(rl.batch_size).repeat_interleave(n),
            "mask": mask,
            "old_logp": old_logp,
            "ref_logp": ref_logp,
            **extra,
        }
        batch = algo.advantages(batch)
        per_update, step_losses = rl.mini_batch_size * n, []
        for start in range(0, rl.batch_size * n, per_update):
            idx = slice(start, start + per_update)
            mb = {k: v[idx] for k, v in batch.items() if k not in ("scores", "group_ids", "rewards")}
            mb["logp"], mb["entropy"] = _logprobs(
                policy_lm, r.prompts[idx], r.prompt_mask[idx], r.responses[idx], mask[idx], rl.temperature
            )
            if critic is not None:
                mb["values"] = _values(critic, r.prompts[idx], r.prompt_mask[idx], r.responses[idx], mask[idx])
            loss, _ = algo.loss(mb, **algos.global_counts(mb["mask"]))
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            if rl.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, rl.grad_clip)
            for opt in opts:
                opt.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
    rewards.close()
    return LoopRun(losses, policy, critic)
