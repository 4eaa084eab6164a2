"""Memory: host<->device swap of pytrees, the per-phase memory plan, AllGather-Swap."""

from rlcore.memory.swap import SwapHandle, offload, reload

__all__ = ["SwapHandle", "offload", "reload"]
