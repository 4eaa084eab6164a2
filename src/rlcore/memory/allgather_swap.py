"""AllGather-Swap: switch co-located ranks between training and rollout with no redundant copy.

MindSpeed-RL (Feng et al., arXiv:2507.19017) removes the redundant memory of the
resharding flow by swapping training state to the host around the all-gather of the
inference weights. rlcore runs the steps of a :class:`~rlcore.memory.plan.MemoryPlan`
transition in its ``"swap"`` order:

* :func:`enter_rollout`: offload grads and optimizer state to host buckets
  (:func:`~rlcore.memory.swap.offload`), then build the inference weights one
  reshard bucket at a time (:func:`~rlcore.dataflow.reshard.reshard_bucket`, each
  bucket allocated from the inference layout's sizes just before it is filled) and
  offload each bucket's training params as soon as no later bucket reads them.
* :func:`enter_train`: free the inference weights' buckets, then reload params,
  grads and optimizer state into the very same tensor objects, so the optimizer,
  the module and any other reference carry on unchanged.

The KV cache of the plan is accounting only: the inference engine allocates and
frees it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from rlcore.dataflow.reshard import ReshardPlan, check_reshard_params, reshard_bucket
from rlcore.memory.plan import MemoryPlan, colocated_plan
from rlcore.memory.swap import SwapHandle, offload, reload

__all__ = [
    "AllGatherSwapPlan",
    "RolloutState",
    "TrainState",
    "allgather_swap_plan",
    "enter_rollout",
    "enter_train",
]

_TRAIN_GROUPS = ("params", "grads", "optimizer")
_ENGINE_GROUPS = ("kv_cache",)


@dataclasses.dataclass(eq=False)
class TrainState:
    """A rank's training state: its param shards (name -> tensor), and pytrees of grads and optimizer state."""

    params: Mapping[str, torch.Tensor]
    grads: Any = None
    optimizer: Any = None


@dataclasses.dataclass(eq=False)
class RolloutState:
    """What :func:`enter_rollout` returns: the inference weights, their buckets, and the swapped training state."""

    weights: dict[str, torch.Tensor]
    buffers: list[torch.Tensor]
    handles: dict[str, list[SwapHandle]]
    train: TrainState


@dataclasses.dataclass(frozen=True)
class AllGatherSwapPlan:
    """A reshard plan, the memory plan whose ``train -> rollout`` steps are run, the mesh and the device."""

    reshard: ReshardPlan
    memory: MemoryPlan
    mesh: Any
    device: torch.device


def allgather_swap_plan(
    reshard_plan: ReshardPlan,
    *,
    mesh: Any,
    device: torch.device | str,
    rank: int,
    kv_cache_bytes: int = 0,
    **sizes: int,
) -> AllGatherSwapPlan:
    """Bundle ``reshard_plan`` with :func:`~rlcore.memory.plan.colocated_plan` for ``rank``.

    ``sizes`` are ``grad_bytes`` and ``optimizer_bytes`` for :func:`colocated_plan`.
    """
    memory = colocated_plan(reshard_plan, rank=rank, kv_cache_bytes=kv_cache_bytes, **sizes)
    return AllGatherSwapPlan(reshard_plan, memory, mesh, torch.device(device))


def _release_after(params: Mapping[str, torch.Tensor], plan: ReshardPlan) -> dict[str, int]:
    """Per param name, the last bucket reading its storage (tied weights share one)."""
    key = {n: t.untyped_storage().data_ptr() for n, t in params.items()}
    last: dict[int, int] = {}
    for i, b in enumerate(plan.buckets):
        for n in b.names:
            if n in params:
                last[key[n]] = i
    return {n: last[k] for n, k in key.items()}


def _check_steps(steps: Any, allowed: dict[str, tuple[str, ...]], what: str) -> None:
    for s in steps:
        if s.group not in allowed.get(s.action, ()):
            want = "; ".join(f"{a} of {', '.join(g)}" for a, g in allowed.items())
            raise ValueError(f"plan: got step {s.action!r} of {s.group!r} in {what}, expected only: {want}")


def enter_rollout(state: TrainState, plan: AllGatherSwapPlan) -> RolloutState:
    """Swap the training state out and build the inference weights, in the plan's lowest-peak order.

    Collective over ``plan.mesh``. Reference: AllGather-Swap, arXiv:2507.19017.
    Device bytes follow ``plan.memory.transition("train", "rollout")``: the peak
    exceeds ``max(resident(train), resident(rollout))`` by at most one bucket.

    Args:
      state: this rank's :class:`TrainState` (training-layout shards).
      plan: from :func:`allgather_swap_plan`.

    Returns:
      A :class:`RolloutState`; ``weights`` maps every parameter name to this rank's
      inference shard.

    >>> import torch.distributed as dist
    >>> from rlcore.dataflow import decoder_layout, plan_reshard
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> w = torch.nn.Parameter(torch.ones(4, 2))
    >>> lay = decoder_layout({"lm_head.weight": w})
    >>> plan = allgather_swap_plan(plan_reshard({"lm_head.weight": w}, lay, lay), mesh=lay.device_mesh("cpu"),
    ...                            device="cpu", rank=0)
    >>> rollout = enter_rollout(TrainState({"lm_head.weight": w}), plan)
    >>> w.untyped_storage().nbytes(), rollout.weights["lm_head.weight"].sum().item()
    (0, 8.0)
    >>> enter_train(rollout, plan).params["lm_head.weight"] is w, w.sum().item()
    (True, 8.0)
    >>> dist.destroy_process_group()
    """
    import torch.distributed as dist

    check_reshard_params(state.params, plan.reshard, dist.get_rank(), plan.reshard.params)
    steps = plan.memory.transition("train", "rollout").steps
    _check_steps(
        steps,
        {"offload": _TRAIN_GROUPS, "build": ("inference_weights",), "alloc": _ENGINE_GROUPS},
        "train -> rollout",
    )
    trees = {"params": dict(state.params), "grads": state.grads, "optimizer": state.optimizer}
    stream = plan.memory.residency["params"]["rollout"] != "device"
    handles: dict[str, list[SwapHandle]] = {}
    weights: dict[str, torch.Tensor] = {}
    buffers: list[torch.Tensor] = []
    for step in steps:
        if step.action == "offload":
            handles.setdefault(step.group, []).append(offload(trees[step.group]))
        elif step.action == "build":
            params = trees["params"]
            release = _release_after(params, plan.reshard)
            for i, bucket in enumerate(plan.reshard.buckets):
                numel = bucket.nbytes // bucket.dtype.itemsize
                buffers.append(torch.empty(numel, dtype=bucket.dtype, device=plan.device))
                weights.update(reshard_bucket(params, plan.reshard, i, mesh=plan.mesh, out=buffers[-1]))
                done = {n: t for n, t in params.items() if release[n] == i}
                if stream and done:
                    handles.setdefault("params", []).append(offload(done))
    return RolloutState(weights, buffers, handles, state)


def enter_train(state: RolloutState, plan: AllGatherSwapPlan) -> TrainState:
    """Free the inference weights and reload the training state into its original tensors.

    Follows ``plan.memory.transition("rollout", "train")``: every release before any
    reload, so the peak never exceeds the larger phase.

    Args:
      state: what :func:`enter_rollout` returned.
      plan: the same plan.

    Returns:
      The original :class:`TrainState`, its tensors holding their data again.
    """
    steps = plan.memory.transition("rollout", "train").steps
    _check_steps(steps, {"free": ("inference_weights", *_ENGINE_GROUPS), "reload": _TRAIN_GROUPS}, "rollout -> train")
    for step in steps:
        if step.action == "free" and step.group == "inference_weights":
            for buf in state.buffers:
                buf.untyped_storage().resize_(0)
            state.weights.clear()
            state.buffers.clear()
        elif step.action == "reload":
            for handle in state.handles.pop(step.group, []):
                reload(handle)
    return state.train
