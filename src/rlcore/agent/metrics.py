"""Per-step metrics of a trajectory batch: turns, tool calls, tool errors, tool latency."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["trajectory_metrics"]


def trajectory_metrics(traj: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Means over a batch from :func:`rlcore.agent.multi_turn_rollout`, as float32 scalars (no host sync).

    Returns ``turns`` (policy turns per trajectory), ``tool_calls`` (per trajectory),
    ``tool_call_rate`` (share of trajectories with a call), ``tool_errors`` (per
    trajectory), ``tool_error_rate`` (errors per call), ``tool_latency_s`` (seconds per
    call), ``env_errors`` (per trajectory), ``truncated`` (share stopped by a budget),
    ``policy_tokens`` and ``observation_tokens`` (per trajectory).

    >>> traj = {"num_turns": torch.tensor([2, 1]), "num_tool_calls": torch.tensor([1, 0]),
    ...         "num_tool_errors": torch.tensor([1, 0]), "tool_latency": torch.tensor([0.5, 0.0]),
    ...         "num_env_errors": torch.tensor([0, 0]), "truncated": torch.tensor([False, True]),
    ...         "mask": torch.tensor([[1, 0, 1], [1, 0, 0]]), "trajectory_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}
    >>> {k: round(float(v), 2) for k, v in trajectory_metrics(traj).items()}["tool_error_rate"]
    1.0
    """
    calls = traj["num_tool_calls"].float()
    total_calls = calls.sum().clamp(min=1)
    policy = traj["mask"].float().sum(-1)
    return {
        "turns": traj["num_turns"].float().mean(),
        "tool_calls": calls.mean(),
        "tool_call_rate": (calls > 0).float().mean(),
        "tool_errors": traj["num_tool_errors"].float().mean(),
        "tool_error_rate": traj["num_tool_errors"].float().sum() / total_calls,
        "tool_latency_s": traj["tool_latency"].float().sum() / total_calls,
        "env_errors": traj["num_env_errors"].float().mean(),
        "truncated": traj["truncated"].float().mean(),
        "policy_tokens": policy.mean(),
        "observation_tokens": (traj["trajectory_mask"].float().sum(-1) - policy).mean(),
    }
