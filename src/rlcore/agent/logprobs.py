"""Training-side log-probs of a trajectory batch: one padding-free forward over prompt, policy and observation tokens."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlcore.models import token_logprobs

__all__ = ["trajectory_logprobs"]


def trajectory_logprobs(
    apply: Callable[..., torch.Tensor],
    params: Any,
    traj: Mapping[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs ``[B, R]`` of every response token (policy and observation) under ``apply``; multiply by ``mask`` to train.

    The whole trajectory (prompt, then the response ids, observation tokens attended
    like any other) is one sequence of :func:`rlcore.models.token_logprobs`; the values
    are cut back to the response columns. Observation positions get values too: the
    recipes' ``mask`` (1 on policy tokens only) keeps them out of the loss and its
    gradient.

    Args:
      apply, params: the model function and its parameters (:func:`rlcore.models.from_hf`).
      traj: ``prompts``, ``prompt_mask`` ``[B, P]``, ``responses``, ``trajectory_mask``
        ``[B, R]`` (from :func:`rlcore.agent.multi_turn_rollout`).
      temperature: the sampling temperature.
      with_entropy: also return the entropies ``[B, R]``.

    Returns:
      ``logp`` (or ``(logp, entropy)``), 0 on padding.
    """
    batch = {
        "input_ids": torch.cat([traj["prompts"], traj["responses"]], 1),
        "attention_mask": torch.cat([traj["prompt_mask"].long(), (traj["trajectory_mask"] != 0).long()], 1),
    }
    width = traj["prompts"].shape[1]
    out = token_logprobs(apply, params, batch, temperature=temperature, with_entropy=with_entropy)
    if isinstance(out, tuple):
        return out[0][:, width:], out[1][:, width:]
    return out[:, width:]
