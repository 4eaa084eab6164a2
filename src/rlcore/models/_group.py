"""The process group behind a ``ProcessGroup`` or a 1-D ``DeviceMesh`` argument."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["as_process_group"]


def as_process_group(name: str, group: Any) -> Any:
    """``group`` as a ``ProcessGroup``: a 1-D ``DeviceMesh`` gives its group; needs an initialised default group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}: got {group!r}, expected a process group, but torch.distributed is not initialised")
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{name}: got a {group.ndim}-D DeviceMesh, expected a 1-D mesh (e.g. mesh['cp'])")
        return group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{name}: got {type(group).__name__}, expected a torch.distributed ProcessGroup or 1-D DeviceMesh"
        )
    return group
