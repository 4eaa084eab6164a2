"""The reference trainer: rlcore's pieces assembled into an RL loop you can read in one sitting.

One step, for the policy-gradient algorithms (``rl.algo`` = grpo, dapo, ppo, ...)::

    prompts   = task.sample(...)                          # on-the-fly verifiable task
    rollout   = engine.generate(prompts, n=num_rollouts)  # KV-cached sampling
    scores    = rewards.submit(prompts, responses)        # process pool, overlaps the next two lines
    old_logp  = logprobs(policy, rollout)                 # rlcore.models.token_logprobs: packed, padding-free
    ref_logp  = logprobs(reference, rollout)
    batch     = algo.advantages(batch)                    # rlcore.algos recipe: shaping + estimator
    for mini-batch: loss = algo.loss(mb, **global_counts) -> backward -> all-reduce -> optimiser step

and for ``dpo`` the step scores (correct answer, sampled answer) pairs with
:func:`rlcore.algos.dpo`. Nothing here is a framework: copy the file and change the loop.
Data parallelism (``torchrun``) splits the prompts; the loss is normalised by global
token / sequence counts, so summing gradients over ranks gives exactly the gradient of
the global batch and the parameters stay identical on every rank.
"""

from __future__ import annotations

import copy
import math
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rlcore import algos
from rlcore.device import collective_backend, get_device
from rlcore.models import HFCausalLM, from_hf, token_logprobs
from rlcore.ops import masked_mean
from rlcore.rewards import RewardPool
from rlcore.train.checkpoint import load_checkpoint, save_checkpoint
from rlcore.train.config import Config, check_launch
from rlcore.train.metrics import MetricsLog, plot_curves, read_metrics
from rlcore.train.rollout import InferenceEngine, Rollout, TorchEngine, left_pad
from rlcore.train.tasks import make_task

__all__ = ["Run", "build_algorithm", "build_model", "train"]

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


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


class _World:
    """This process's place in the data-parallel group (a single process when not launched by torchrun)."""

    def __init__(self, device: torch.device):
        self.size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.group = None
        if self.size > 1:
            if not dist.is_initialized():
                dist.init_process_group(collective_backend(device))
            self.group = dist.group.WORLD

    def sum_grads(self, params: Sequence[torch.Tensor]) -> None:
        # Losses are normalised by global counts, so the global gradient is the sum.
        if self.group is not None:
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.group)

    def mean(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        stacked = torch.stack([v.detach().float() for v in values.values()])
        if self.group is not None:
            dist.all_reduce(stacked, group=self.group)
            stacked /= self.size
        return dict(zip(values, stacked.tolist()))

    def broadcast(self, params: Sequence[torch.Tensor]) -> None:
        if self.group is not None:
            for p in params:
                dist.broadcast(p.data, 0, group=self.group)


def _generator(seed: int, rank: int, step: int, phase: int) -> torch.Generator:
    # Each (phase, step, rank) gets its own stream, so a resumed run replays the data
    # and the sampling noise of an uninterrupted one exactly.
    return torch.Generator().manual_seed(((seed * 1_000_003 + phase) * 1_000_003 + step) * 1_009 + rank)


def _forward(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=attention, position_ids=positions).logits


# A causal LM as rlcore.models.from_hf gives it: the packed forward and its parameters.
_LM = tuple[HFCausalLM, dict[str, torch.Tensor]]


def _logprobs(model: _LM, r: Rollout, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[N, R]`` of the response tokens under ``model`` (one packed forward pass).

    The padding-free path: pack the real prompt + response tokens into one row, run the
    backbone with packed attention, and score them with the fused hidden x lm_head
    kernel (the ``[N, T, V]`` logits are never built). Padding scores 0.
    """
    apply, params = model
    batch = {
        "input_ids": torch.cat([r.prompts, r.responses], 1),
        "attention_mask": torch.cat([r.prompt_mask, r.mask], 1),
    }
    logp, entropy = token_logprobs(apply, params, batch, temperature=temperature, with_entropy=True)
    # token_logprobs puts each value on the token it scores: the responses are the last R columns.
    width = r.prompts.shape[1]
    return logp[:, width:].float(), entropy[:, width:].float()


def _values(critic: torch.nn.Module, r: Rollout) -> torch.Tensor:
    """Critic values ``[N, R]`` of the states before each response token."""
    out = _forward(critic, torch.cat([r.prompts, r.responses], 1), torch.cat([r.prompt_mask, r.mask], 1))
    return out[:, r.prompts.shape[1] - 1 : -1, 0].float()


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


def _warmup(policy: torch.nn.Module, task: Any, cfg: Config, world: _World, device: torch.device) -> None:
    """Supervised warm-up on the task's reference answers (token-mean cross-entropy over the response)."""
    tr = cfg.trainer
    params = [p for p in policy.parameters() if p.requires_grad]
    apply, named = from_hf(policy)
    opt = torch.optim.AdamW(params, lr=tr.warmup_lr, weight_decay=cfg.rl.weight_decay)
    per_rank = tr.warmup_batch_size
    policy.train()
    for step in range(tr.warmup_steps):
        samples = task.sample(per_rank, _generator(tr.seed, world.rank, step, phase=1))
        seq = _sequences(task.tokenizer, [s["prompt"] for s in samples], [s["answer"] for s in samples], device)
        logp = token_logprobs(apply, named, seq)  # aligned with the token it scores, like seq["mask"]
        mask = seq["mask"]
        counts = algos.global_counts(mask, process_group=world.group)
        loss = algos.aggregate(-logp, mask, mode="token-mean", num_tokens=counts["num_tokens"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        world.sum_grads(params)
        torch.nn.utils.clip_grad_norm_(params, cfg.rl.grad_clip or math.inf)
        opt.step()


def _check_finite(loss: torch.Tensor, step: int, world: _World) -> None:
    bad = (~torch.isfinite(loss.detach())).float()
    if world.group is not None:
        dist.all_reduce(bad, group=world.group)
    if bad.item() > 0:  # sync-ok: the trainer stops the run on a non-finite loss, before any update
        raise FloatingPointError(
            f"step {step}: the loss is not finite ({loss.item()}); stopped before the optimiser step, "
            "the last checkpoint is untouched"
        )


def _optimise(
    loss: torch.Tensor,
    step: int,
    params: list[torch.Tensor],
    opts: list[torch.optim.Optimizer],
    world: _World,
    grad_clip: float,
) -> None:
    _check_finite(loss, step, world)
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    world.sum_grads(params)
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    for opt in opts:
        opt.step()


def _rl_step(step: int, state: dict[str, Any], cfg: Config, world: _World) -> dict[str, torch.Tensor]:
    """One policy-gradient step; returns the local metrics to average over ranks."""
    rl, task, device = cfg.rl, state["task"], state["device"]
    n, local_prompts = rl.num_rollouts, rl.batch_size
    g = _generator(cfg.trainer.seed, world.rank, step, phase=0)
    samples = task.sample(local_prompts, g)
    prompts, pmask = left_pad([task.tokenizer.encode(s["prompt"]) for s in samples], task.tokenizer.pad_token_id)
    rollout = state["engine"].generate(prompts.to(device), pmask.to(device), n=n, generator=g)
    texts = [task.tokenizer.decode(row) for row in rollout.responses.tolist()]
    repeated = [s for s in samples for _ in range(n)]
    scores = state["rewards"].submit(
        [s["prompt"] for s in repeated], texts, batch=step, answers=[s["answer"] for s in repeated]
    )
    with torch.no_grad():  # overlaps the reward workers
        old_logp, entropy = _logprobs(state["policy_lm"], rollout, rl.temperature)
        ref_logp, _ = _logprobs(state["reference_lm"], rollout, rl.temperature)
        extra = {"old_values": _values(state["critic"], rollout)} if state["critic"] is not None else {}
    mask = rollout.mask.float()
    raw_scores = scores.result().to(device)
    batch = {
        "scores": raw_scores,
        "group_ids": torch.arange(local_prompts, device=device).repeat_interleave(n),
        "mask": mask,
        "old_logp": old_logp,
        "ref_logp": ref_logp,
        **extra,
    }
    batch = state["algo"].advantages(batch)
    rows = local_prompts * n
    per_update = rl.mini_batch_size * n
    sums: dict[str, torch.Tensor] = {}
    for _ in range(rl.epochs):
        for start in range(0, rows, per_update):
            idx = slice(start, start + per_update)
            mb = {k: v[idx] for k, v in batch.items()}
            sub = Rollout(*(x[idx] for x in rollout))
            mb["logp"], mb["entropy"] = _logprobs(state["policy_lm"], sub, rl.temperature)
            if state["critic"] is not None:
                mb["values"] = _values(state["critic"], sub)
            counts = algos.global_counts(mb["mask"], process_group=world.group)
            loss, metrics = state["algo"].loss(mb, **counts)
            _optimise(loss, step, state["params"], state["opts"], world, rl.grad_clip)
            for k, v in {"loss": loss.detach(), **metrics}.items():
                sums[k] = sums.get(k, 0) + v.float() / (rows // per_update * rl.epochs)
    lengths = rollout.mask.sum(-1).float()
    return {
        **sums,
        "reward": raw_scores.mean(),  # the task reward, before any shaping
        # k3 estimate of KL(rollout policy || reference) per token: the curve in the plot.
        "kl": masked_mean(algos.kl_penalty(old_logp, ref_logp, estimator="k3"), mask),
        "entropy": masked_mean(entropy, mask),
        "response_length": lengths.mean(),
        "prompt_length": rollout.prompt_mask.sum(-1).float().mean(),
    }


def _dpo_step(step: int, state: dict[str, Any], cfg: Config, world: _World) -> dict[str, torch.Tensor]:
    """One DPO step on (reference answer, sampled answer) pairs; a correct sample is replaced by a perturbed answer."""
    rl, task, device = cfg.rl, state["task"], state["device"]
    local_prompts = rl.batch_size
    g = _generator(cfg.trainer.seed, world.rank, step, phase=0)
    samples = task.sample(local_prompts, g)
    prompts, pmask = left_pad([task.tokenizer.encode(s["prompt"]) for s in samples], task.tokenizer.pad_token_id)
    rollout = state["engine"].generate(prompts.to(device), pmask.to(device), n=1, generator=g)
    texts = [task.tokenizer.decode(row) for row in rollout.responses.tolist()]
    scores = (
        state["rewards"]
        .submit([s["prompt"] for s in samples], texts, batch=step, answers=[s["answer"] for s in samples])
        .result()
    )
    alphabet = task.tokenizer.alphabet
    noise = torch.randint(0, len(alphabet), (local_prompts,), generator=g).tolist()
    rejected = [
        t if s < 1 else s_["answer"] + alphabet[k] for t, s, s_, k in zip(texts, scores.tolist(), samples, noise)
    ]
    pairs = {}
    for side, answers in (("chosen", [s["answer"] for s in samples]), ("rejected", rejected)):
        seq = _sequences(task.tokenizer, [s["prompt"] for s in samples], answers, device)
        pairs.update({f"{side}_{k}": v for k, v in seq.items()})
    mask = rollout.mask.float()
    with torch.no_grad():
        old_logp, entropy = _logprobs(state["policy_lm"], rollout, rl.temperature)
        ref_logp, _ = _logprobs(state["reference_lm"], rollout, rl.temperature)
    model = lambda m: lambda ids, am: _forward(m, ids, am)  # noqa: E731 -- the DPO recipe's model callable
    sums: dict[str, torch.Tensor] = {}
    per_update = rl.mini_batch_size
    for start in range(0, local_prompts, per_update):
        mb = {k: v[start : start + per_update] for k, v in pairs.items()}
        loss, metrics = state["algo"](
            model(state["policy"]), mb, model(state["reference"]), num_pairs=rl.mini_batch_size * world.size
        )
        _optimise(loss, step, state["params"], state["opts"], world, rl.grad_clip)
        for k, v in {"loss": loss.detach(), **metrics}.items():
            sums[k] = sums.get(k, 0) + v.float() / (local_prompts // per_update)
    return {
        **sums,
        "reward": scores.to(device).mean(),
        "kl": masked_mean(algos.kl_penalty(old_logp, ref_logp, estimator="k3"), mask),
        "entropy": masked_mean(entropy, mask),
        "response_length": mask.sum(-1).mean(),
        "prompt_length": rollout.prompt_mask.sum(-1).float().mean(),
    }


def train(
    cfg: Config,
    *,
    resume: bool = False,
    engine: InferenceEngine | None = None,
    algo: algos.Algorithm | None = None,
    reward: Any = None,
) -> Run:
    """Run the config's training job; rank 0 writes metrics JSONL, checkpoints and the plot to ``trainer.output_dir``.

    Args:
      cfg: a validated :class:`rlcore.train.config.Config`.
      resume: continue from ``trainer.output_dir/checkpoint.pt`` (same seed, same data order).
      engine: an :class:`InferenceEngine` to sample with instead of the in-process one.
      algo: an :class:`rlcore.algos.Algorithm` replacing the recipe named by ``rl.algo``.
      reward: a reward replacing the task's rule reward (a ``(prompts, responses, **columns)``
        callable or a ``BaseReward``-style object; it receives ``answers``).
    """
    tr = cfg.trainer
    if tr.threads:
        torch.set_num_threads(tr.threads)
    device = get_device()
    if device.type != "cpu":
        device = get_device(index=int(os.environ.get("LOCAL_RANK", "0")))
    world = _World(device)
    if engine is None:
        check_launch(cfg, world.size)
    else:
        check_launch(replace(cfg, deploy=replace(cfg.deploy, mode="co-located")), world.size)
    task = make_task(cfg.data.task, **_task_options(cfg))
    torch.manual_seed(tr.seed)
    policy = build_model(cfg, task.tokenizer.vocab_size).to(device)
    critic = build_model(cfg, task.tokenizer.vocab_size, critic=True).to(device) if cfg.rl.algo == "ppo" else None
    world.broadcast(list(policy.parameters()) + (list(critic.parameters()) if critic is not None else []))
    out = Path(tr.output_dir)
    checkpoint = load_checkpoint(out) if resume else None
    if checkpoint is None and tr.warmup_steps:
        _warmup(policy, task, cfg, world, device)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    params = list(policy.parameters())
    opts = [torch.optim.AdamW(params, lr=cfg.rl.lr, weight_decay=cfg.rl.weight_decay)]
    if critic is not None:
        params += list(critic.parameters())
        opts.append(torch.optim.AdamW(critic.parameters(), lr=cfg.rl.critic_lr, weight_decay=cfg.rl.weight_decay))
    start = 0
    if checkpoint is not None:
        policy.load_state_dict(checkpoint["policy"])
        reference.load_state_dict(checkpoint["reference"])
        if critic is not None:
            critic.load_state_dict(checkpoint["critic"])
        for opt, saved in zip(opts, checkpoint["optimizers"]):
            opt.load_state_dict(saved)
        start = checkpoint["step"] + 1
    rl = cfg.rl
    sampler = engine or TorchEngine(
        policy,
        eos_token_id=task.tokenizer.eos_token_id,
        pad_token_id=task.tokenizer.pad_token_id,
        max_new_tokens=rl.max_new_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=rl.top_k,
    )
    workers = max(1, tr.reward_workers) if cfg.deploy.async_infer else 0
    rewards = RewardPool(reward if reward is not None else task.reward, num_workers=workers)
    state: dict[str, Any] = {
        "task": task,
        "policy": policy,
        "reference": reference,
        # The packed forwards read the modules' own parameter tensors, which the optimiser
        # and load_state_dict update in place, so they are built once.
        "policy_lm": from_hf(policy),
        "reference_lm": from_hf(reference),
        "critic": critic,
        "device": device,
        "engine": sampler,
        "algo": algo or build_algorithm(cfg),
        "params": params,
        "opts": opts,
        "rewards": rewards,
    }
    step_fn = _dpo_step if rl.algo == "dpo" else _rl_step
    leader = world.rank == 0
    log = (
        MetricsLog(
            out / "metrics.jsonl",
            total=tr.steps,
            start=start,
            progress=tr.progress and leader,
            resume_step=start - 1 if checkpoint is not None else None,
        )
        if leader
        else None
    )
    records: list[dict[str, Any]] = []
    try:
        policy.train()
        for step in range(start, tr.steps):
            t0 = time.perf_counter()
            local = step_fn(step, state, cfg, world)
            if engine is not None:
                engine.load_weights(dict(policy.named_parameters()))
            metrics = world.mean(local)
            seconds = time.perf_counter() - t0
            samples = world.size * rl.batch_size * (1 if rl.algo == "dpo" else rl.num_rollouts)
            # As the seed system defines it: (prompt + response tokens) x samples / devices / step time.
            metrics["tokens_per_s_device"] = (
                (metrics["prompt_length"] + metrics["response_length"]) * samples / world.size / seconds
            )
            record = {"step": step, **metrics, "step_time_s": seconds}
            records.append(record)
            if log is not None:
                log.write(record)
                if (tr.save_every and (step + 1) % tr.save_every == 0) or step + 1 == tr.steps:
                    save_checkpoint(
                        out,
                        {
                            "step": step,
                            "policy": policy.state_dict(),
                            "reference": reference.state_dict(),
                            "critic": critic.state_dict() if critic is not None else None,
                            "optimizers": [o.state_dict() for o in opts],
                            "config": cfg.to_dict(),
                        },
                    )
    finally:
        rewards.close()
        if log is not None:
            log.close()
    if leader and tr.plot:
        plot_curves(read_metrics(out / "metrics.jsonl"), out / "curves.png")
    return Run(records, policy, critic)


def _task_options(cfg: Config) -> dict[str, Any]:
    d = cfg.data
    if d.task == "addition":
        return {"digits": d.digits}
    return {"length": d.length, "min_length": d.min_length, "letters": d.letters}
