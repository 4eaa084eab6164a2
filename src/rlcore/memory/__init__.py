"""Memory: host<->device swap of pytrees, the per-phase memory plan, AllGather-Swap, phase transforms, host malloc."""

from rlcore.memory.allgather_swap import (
    AllGatherSwapPlan,
    RolloutState,
    TrainState,
    allgather_swap_plan,
    enter_rollout,
    enter_train,
)
from rlcore.memory.host_malloc import (
    MAX_MIB,
    MMAP_THRESHOLD_LIMIT,
    START_THRESHOLD,
    keep_freed_host_memory,
    set_malloc_thresholds,
)
from rlcore.memory.phases import ColocatedSwitch, EngineSwitch, in_phase
from rlcore.memory.plan import ORDERS, RESIDENCIES, MemoryPlan, StateGroup, Step, Transition, colocated_plan
from rlcore.memory.swap import SwapHandle, host_copies, offload, reload

__all__ = [
    "MAX_MIB",
    "MMAP_THRESHOLD_LIMIT",
    "ORDERS",
    "RESIDENCIES",
    "START_THRESHOLD",
    "AllGatherSwapPlan",
    "ColocatedSwitch",
    "EngineSwitch",
    "MemoryPlan",
    "RolloutState",
    "StateGroup",
    "Step",
    "SwapHandle",
    "TrainState",
    "Transition",
    "allgather_swap_plan",
    "colocated_plan",
    "enter_rollout",
    "enter_train",
    "host_copies",
    "in_phase",
    "keep_freed_host_memory",
    "offload",
    "reload",
    "set_malloc_thresholds",
]
