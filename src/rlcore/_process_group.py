"""The process group behind a ``ProcessGroup`` or a 1-D ``DeviceMesh`` argument: the one conversion."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["as_process_group"]


def as_process_group(name: str, group: Any, *, optional: bool = False) -> Any:
    """``group`` as a ``torch.distributed`` ``ProcessGroup``: a 1-D ``DeviceMesh`` gives its group.

    Every function that takes a group accepts either form (``mesh["dp"]`` or
    ``mesh.get_group("dp")``); this is where the two meet.

    Args:
      name: the argument's name, for the error message.
      group: a ``ProcessGroup``, a 1-D ``DeviceMesh``, or ``None`` when ``optional``.
      optional: ``None`` is accepted and returned as it is (the caller says what it
        means: this process alone, or the default group).

    Returns:
      The ``ProcessGroup``, or ``None``.

    Raises:
      ValueError: ``group`` is ``None`` (unless ``optional``), a mesh of more than one
        dimension, not a group at all, or torch.distributed is not initialised.

    >>> as_process_group("process_group", None, optional=True) is None
    True
    """
    if group is None and optional:
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}: got {group!r}, expected a process group, but torch.distributed is not initialised")
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{name}: got a {group.ndim}-D DeviceMesh, expected a 1-D mesh (e.g. mesh['dp'])")
        return group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        expected = "a torch.distributed ProcessGroup or 1-D DeviceMesh" + (" or None" if optional else "")
        raise ValueError(f"{name}: got {type(group).__name__}, expected {expected}")
    return group
