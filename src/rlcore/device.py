"""Backend detection and device facts: NPU -> CUDA -> CPU, through ``torch.accelerator``.

torch-npu is never imported at module top level. It is touched in exactly one
place, :func:`import_torch_npu`, so ``import rlcore`` works on machines where
torch-npu is installed but the Ascend toolkit (CANN) is missing, which makes
``import torch_npu`` itself raise.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import types
from typing import Literal

import torch

from rlcore._checks import check_choice

__all__ = [
    "DeviceKind",
    "MemoryStats",
    "collective_backend",
    "device_kind",
    "empty_cache",
    "get_device",
    "import_torch_npu",
    "memory_stats",
    "npu_available",
    "reset_peak_memory_stats",
    "synchronize",
]

DeviceKind = Literal["npu", "cuda", "cpu"]
_KINDS = ("npu", "cuda", "cpu")
_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


# --- NPU-only: the single place that imports torch_npu ----------------------------
@functools.cache
def import_torch_npu() -> tuple[types.ModuleType | None, str | None]:
    """Import torch_npu once. Returns ``(module, None)`` or ``(None, reason)``."""
    if importlib.util.find_spec("torch_npu") is None:
        return None, "torch-npu is not installed (pip install 'rlcore[npu]' with the torch-npu matching your torch)"
    try:
        module = importlib.import_module("torch_npu")
    except Exception as err:  # torch_npu raises ImportError/OSError/RuntimeError without CANN
        return None, (
            f"torch-npu is installed but failed to import ({type(err).__name__}: {err}); "
            "the Ascend toolkit (CANN) is missing or its environment is not set "
            "(source <ascend-toolkit>/set_env.sh)"
        )
    return module, None


def _npu_state() -> tuple[bool, str | None]:
    module, reason = import_torch_npu()
    if module is None:
        return False, reason
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available() or npu.device_count() == 0:
        return False, "torch-npu imported but no NPU device is visible (check ASCEND_RT_VISIBLE_DEVICES)"
    return True, None


# ---------------------------------------------------------------------------------


def npu_available() -> bool:
    """True when torch-npu imports and at least one NPU is present."""
    return _npu_state()[0]


def device_kind() -> DeviceKind:
    """The best backend here: ``"npu"`` if available, else ``"cuda"``, else ``"cpu"``."""
    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def get_device(kind: str | None = None, index: int | None = None) -> torch.device:
    """A ``torch.device`` of ``kind`` (default: the best available).

    Asking explicitly for a backend that is not usable raises ``RuntimeError``
    saying what is missing.

    >>> get_device("cpu")
    device(type='cpu')
    """
    if kind is None:
        kind = device_kind()
    check_choice("kind", kind, _KINDS)
    if kind == "npu":
        ok, reason = _npu_state()
        if not ok:
            raise RuntimeError(f"device 'npu' requested but unavailable: {reason}")
    elif kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but unavailable: no CUDA build of torch or no GPU visible")
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, 0 if index is None else index)


def collective_backend(device: torch.device | str | None = None) -> str:
    """The ``torch.distributed`` backend for ``device``: hccl (NPU), nccl (CUDA) or gloo (CPU).

    >>> collective_backend("cpu")
    'gloo'
    """
    kind: str
    if device is None:
        kind = device_kind()
    else:
        # Parse strings by hand: torch.device("npu") fails where torch-npu is not loaded.
        kind = device.split(":")[0] if isinstance(device, str) else device.type
    check_choice("device", kind, _KINDS)
    return _BACKENDS[kind]


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Allocator figures for one device, in bytes; ``None`` where the device does not track them."""

    device: str
    tracked: bool
    allocated: int | None = None
    reserved: int | None = None
    peak_allocated: int | None = None

    def __str__(self) -> str:
        if not self.tracked:
            return f"{self.device}: not tracked"
        assert self.allocated is not None and self.reserved is not None and self.peak_allocated is not None
        mib = 1 << 20
        return (
            f"{self.device}: allocated {self.allocated / mib:.1f} MiB, reserved {self.reserved / mib:.1f} MiB, "
            f"peak {self.peak_allocated / mib:.1f} MiB"
        )


def _accelerator_index(device: torch.device) -> int | None:
    if device.type == "cpu":
        return None
    return device.index if device.index is not None else torch.accelerator.current_device_index()


def memory_stats(device: torch.device | str | None = None) -> MemoryStats:
    """Allocated / reserved / peak bytes on ``device`` via ``torch.accelerator``.

    The CPU has no caching allocator to ask: its answer says "not tracked" rather
    than a fake zero.

    >>> memory_stats("cpu").tracked
    False
    """
    dev = get_device() if device is None else torch.device(device)
    idx = _accelerator_index(dev)
    if idx is None:
        return MemoryStats(device=str(dev), tracked=False)
    return MemoryStats(
        device=str(dev),
        tracked=True,
        allocated=torch.accelerator.memory_allocated(idx),
        reserved=torch.accelerator.memory_reserved(idx),
        peak_allocated=torch.accelerator.max_memory_allocated(idx),
    )


def reset_peak_memory_stats(device: torch.device | str | None = None) -> None:
    """Reset the peak counter of ``device`` (no-op on the CPU)."""
    dev = get_device() if device is None else torch.device(device)
    idx = _accelerator_index(dev)
    if idx is not None:
        torch.accelerator.reset_peak_memory_stats(idx)


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued work on ``device`` (no-op on the CPU)."""
    dev = get_device() if device is None else torch.device(device)
    idx = _accelerator_index(dev)
    if idx is not None:
        torch.accelerator.synchronize(idx)


def empty_cache() -> None:
    """Return cached, unused accelerator memory to the driver (no-op on the CPU)."""
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()
