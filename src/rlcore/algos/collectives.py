"""How process groups enter the maths: one keyword, ``process_group=``, and one sum.

Like JAX's ``axis_name``, a data-parallel group is named at the call site of the few
functions whose result depends on data other ranks hold (:func:`global_counts`,
``Algorithm.global_counts`` / ``DPO.global_counts``, :func:`batch_normalize`,
``grpo_advantages(scale="batch")``, the running reward normaliser), always as the
keyword-only argument ``process_group`` (a ``torch.distributed`` process group or a
1-D ``DeviceMesh``; ``None`` means this process only). Nothing in the maths holds a
group, reads a global default group, or takes one positionally.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from rlcore._process_group import as_process_group

__all__ = ["group_sum", "resolve_process_group"]


def resolve_process_group(process_group: Any) -> tuple[Any, int, int]:
    """``(process group, world size, rank)`` of a ``torch.distributed`` group or a 1-D ``DeviceMesh``.

    Args:
      process_group: a process group, a 1-D ``DeviceMesh``, or ``None`` (this process alone).

    Returns:
      ``(group, world_size, rank)``; ``(None, 1, 0)`` for ``None``.

    >>> resolve_process_group(None)
    (None, 1, 0)
    """
    pg = as_process_group("process_group", process_group, optional=True)
    if pg is None:
        return None, 1, 0
    return pg, dist.get_world_size(pg), dist.get_rank(pg)


def group_sum(x: torch.Tensor, *, process_group: Any = None) -> torch.Tensor:
    """``x`` summed over the ranks of ``process_group`` (one all-reduce), or ``x`` itself without one.

    Out of place: ``x`` is not modified. The functional collective is traced by
    ``torch.compile``.

    Args:
      x: any tensor (the same shape on every rank).
      process_group: a process group, a 1-D ``DeviceMesh``, or ``None``.

    Returns:
      A tensor of ``x``'s shape and dtype.

    >>> group_sum(torch.tensor([1, 2]))
    tensor([1, 2])
    """
    pg, _, _ = resolve_process_group(process_group)
    if pg is None:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", pg))
