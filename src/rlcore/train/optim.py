"""The update's optimiser step: backward, gradient clipping and AdamW over the trained models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from rlcore.train.config import Config
from rlcore.train.parallel import clip_grad_norm
from rlcore.train.world import World

__all__ = ["Models", "Optimiser", "adamw", "clip_gradients"]


def clip_gradients(params: Sequence[torch.Tensor], max_norm: float, sharded: bool) -> None:
    """Clip the total gradient norm: DTensor-aware when the model is sharded, torch's own otherwise."""
    if sharded:
        clip_grad_norm(params, max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


class Models(NamedTuple):
    """The run's models: the policy, the reference (no gradient) and PPO's critic (or None)."""

    policy: torch.nn.Module
    reference: torch.nn.Module
    critic: torch.nn.Module | None

    def train(self) -> None:
        """Training mode for the models that train (the policy and the critic); the reference keeps its own."""
        self.policy.train()
        if self.critic is not None:
            self.critic.train()


def adamw(params: Sequence[Any], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """``torch.optim.AdamW``, its fused kernel where it runs (one call for all tensors, not ~10 per tensor).

    Fused AdamW takes plain CPU or CUDA tensors; sharded (DTensor) parameters and other
    devices keep the default implementation.
    """
    fused = bool(params) and all(
        not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params
    )
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


class Optimiser:
    """Backward (FSDP2 sums the gradients over ``dp``), clipping and the optimiser steps: the update stage's ``step``."""

    def __init__(self, models: Models, cfg: Config, world: World):
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
            clip_gradients(self.params, self.grad_clip, self.world.sharded)
        for opt in self.opts:
            opt.step()
