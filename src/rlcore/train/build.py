"""The run's models and recipe, built from the config: the one place the models are made and sharded."""

from __future__ import annotations

import copy
from functools import partial

import torch

from rlcore import algos
from rlcore.models import AdaptersOff, is_lora, load_causal_lm
from rlcore.rewards import reward_weights
from rlcore.train.config import Config
from rlcore.train.context_parallel import check_context_parallel_model
from rlcore.train.lora import attach_lora
from rlcore.train.parallel import full_state_dict, parallelize
from rlcore.train.recipe_options import apply_recipe_options
from rlcore.train.world import World, shard_critic

__all__ = ["build_algorithm", "build_model", "build_models", "build_reference"]


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


def behaviour_mode(cfg: Config) -> str:
    """``rl.behaviour_weights`` resolved: ``auto`` is ``truncate`` with ``deploy.async_infer``, else ``none``."""
    mode = cfg.rl.behaviour_weights
    if mode != "auto":
        return mode
    return "truncate" if cfg.deploy.async_infer else "none"


def build_algorithm(cfg: Config) -> algos.Recipe:
    """The rlcore recipe named by ``rl.algo``, with ``rl.beta`` as its KL coefficient when set.

    ``rl.algo: opd`` is :func:`rlcore.algos.on_policy_distillation` (its teacher is the
    reference, :func:`build_reference`); ``rl.policy_loss`` and ``rl.entropy_coef`` change
    the recipe's policy loss and entropy bonus (:mod:`rlcore.train.recipe_options`).
    A policy-gradient recipe takes the decoupled objective (:func:`rlcore.algos.decoupled`)
    as :func:`behaviour_mode` says.
    """
    rl, beta = cfg.rl, cfg.rl.beta
    if rl.algo == "sft":
        return algos.sft(loss=rl.sft_loss)
    if rl.algo == "rm":
        return algos.rm(margin=rl.rm_margin, center_coef=rl.rm_center_coef)
    if rl.algo == "dpo":
        return algos.dpo() if beta is None else algos.dpo(beta=beta)
    if rl.algo == "opd":  # the teacher is the reference model (build_reference)
        algo = algos.on_policy_distillation(
            teacher_coef=rl.teacher_coef,
            task_coef=rl.task_coef,
            loss=rl.opd_loss,
            beta=rl.opd_beta,
            top_k=rl.opd_top_k,
        )
    elif rl.algo == "gdpo":  # one score column per entry of the rewards list, weighted after normalisation
        weights = None if cfg.rewards is None else reward_weights(cfg.rewards)
        algo = algos.gdpo(weights=weights, batch_norm=rl.gdpo_batch_norm)
        algo = algo if not beta else algo._replace(kl=partial(algos.kl_penalty, estimator="k3"), kl_coef=beta)
    elif rl.algo in ("grpo", "ppo", "rloo", "reinforce_pp"):
        recipe = getattr(algos, rl.algo)
        algo = recipe() if beta is None else recipe(kl_coef=beta)
    else:
        if rl.algo == "dapo":
            # Soft overlong punishment over the last quarter of the generation budget.
            algo = algos.dapo(max_length=rl.max_new_tokens, cache_length=max(1, rl.max_new_tokens // 4))
        else:
            algo = getattr(algos, rl.algo)()
        # Recipes without a KL term get one by composition when beta is set.
        algo = algo if not beta else algo._replace(kl=partial(algos.kl_penalty, estimator="k3"), kl_coef=beta)
    algo = apply_recipe_options(algo, rl)  # rl.policy_loss, rl.entropy_coef
    mode = behaviour_mode(cfg)
    return algo if mode == "none" else algos.decoupled(algo, cap=rl.behaviour_cap, mode=mode)


def build_models(
    cfg: Config, world: World, vocab_size: int, device: torch.device, *, critic: bool
) -> tuple[torch.nn.Module, torch.nn.Module | None, torch.nn.Module]:
    """The policy (with LoRA adapters when configured) and, with ``critic``, a value model, sharded over ``world``.

    Every rank builds the same initial weights from ``trainer.seed``; the models are then
    sharded (FSDP2 over "dp", tensor parallel over "tp"): the one place parallelism
    enters. Also returns an unsharded copy of the policy (eval mode, no gradient): the
    rollout's and the reference's template.
    """
    torch.manual_seed(cfg.trainer.seed)
    policy = build_model(cfg, vocab_size).to(device)
    value = build_model(cfg, vocab_size, critic=True).to(device) if critic else None
    replica = copy.deepcopy(policy).eval().requires_grad_(False)
    if world.cp is not None:
        check_context_parallel_model(policy.config, context_parallel=world.mesh["cp"].size(), mode=world.cp[1])
    if cfg.model.lora is not None:  # only the adapters train; the warm-up trains them too
        policy = attach_lora(policy, cfg)
    parallelize(policy, world.mesh, grad_reduce="sum")  # LoRA: FSDP2 over dp, base and adapters in each unit
    if value is not None:
        shard_critic(value, world)
    return policy, value, replica


def build_reference(
    policy: torch.nn.Module, replica: torch.nn.Module, world: World, *, teacher: str | None = None
) -> torch.nn.Module:
    """The reference: the (warmed-up) policy's weights in a model of its own, sharded the same way.

    With LoRA, the policy's own (sharded) modules with the adapters off: no second copy.
    With ``teacher`` (``model.teacher``, on-policy distillation), that causal LM directory
    instead, frozen, in eval mode, sharded the same way: another frozen model the
    reference's scoring stage runs. Its vocabulary must be the policy's.
    """
    if teacher is not None:
        return _teacher(teacher, replica, world)
    if is_lora(policy):
        return AdaptersOff(policy)
    reference = copy.deepcopy(replica)
    reference.load_state_dict(full_state_dict(policy))
    parallelize(reference, world.mesh, grad_reduce="sum")
    return reference


def _teacher(path: str, replica: torch.nn.Module, world: World) -> torch.nn.Module:
    vocab = getattr(replica.config, "vocab_size", None)
    first = next(replica.parameters())
    model = load_causal_lm(path, dtype=first.dtype, seed=None, what="config key 'model.teacher'")
    if getattr(model.config, "vocab_size", None) != vocab:
        raise ValueError(
            f"config key 'model.teacher': got a model of vocab_size {getattr(model.config, 'vocab_size', None)} ({path!r}), expected "
            f"{vocab}, the policy's (the teacher scores the student's token ids)"
        )
    model = model.to(first.device).eval().requires_grad_(False)
    parallelize(model, world.mesh, grad_reduce="sum")
    return model
