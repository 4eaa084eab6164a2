"""The synchronous RL loop and the flow-shop recurrence, as plain loops: references for the pipeline scheduler."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["flow_shop_makespan_ref", "synchronous_loop_ref"]


def _rows(value: Any) -> list[torch.Tensor]:
    return list(value.unbind(0)) if isinstance(value, torch.Tensor) else list(value)


def _padded(column: str, rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The dock's batch layout, by loops: 0-d rows stacked; others right-padded with 0 plus a bool mask."""
    if rows[0].dim() == 0:
        return {column: torch.stack(rows)}
    width = max(r.shape[0] for r in rows)
    out = torch.zeros((len(rows), width, *rows[0].shape[1:]), dtype=rows[0].dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        for t in range(r.shape[0]):
            out[i, t] = r[t]
            mask[i, t] = True
    return {column: out, f"{column}_mask": mask}


def _ready(value: torch.Tensor | None) -> torch.Tensor:
    assert value is not None, "a stage read a cell no earlier stage wrote"
    return value


def synchronous_loop_ref(
    graph: Any,
    loader: Callable[[int], Mapping[str, Any]],
    *,
    num_prompts: int,
    n_samples: int = 1,
    num_iterations: int = 1,
) -> list[dict[str, list[torch.Tensor]]]:
    """Every iteration: load the prompts, run each stage in topological order over its micro-batches, in row order.

    Rollout stages get ``policy_version`` = the iteration (on-policy). After its last
    micro-batch a stage's ``on_iteration_end`` runs. Returns, per iteration, every
    column (``policy_version`` included) as a list of per-row tensors.
    """
    capacity = num_prompts * n_samples
    out = []
    for j in range(num_iterations):
        table: dict[str, list[torch.Tensor | None]] = {c: list(_rows(v)) for c, v in loader(j).items()}
        for s in graph.order:
            step = capacity if s.micro_batch is None else s.micro_batch
            for a in range(0, capacity, step):
                rows = range(a, min(a + step, capacity))
                batch: dict[str, torch.Tensor] = {}
                for c in s.inputs:
                    batch.update(_padded(c, [_ready(table[c][i]) for i in rows]))
                if s.role == "rollout":
                    batch["policy_version"] = torch.full((len(rows),), j, dtype=torch.int64)
                    table.setdefault("policy_version", [None] * capacity)
                    for i in rows:
                        table["policy_version"][i] = torch.tensor(j)
                result = s.fn(batch)
                for c in s.outputs:
                    values = _rows(result[c])
                    table.setdefault(c, [None] * capacity)
                    for k, i in enumerate(rows):
                        table[c][i] = values[k]
            if s.on_iteration_end is not None:
                s.on_iteration_end(j)
        out.append({c: [_ready(v) for v in vs] for c, vs in table.items()})
    return out


def flow_shop_makespan_ref(durations: list[float], num_jobs: int) -> float:
    """Makespan of ``num_jobs`` identical jobs through a chain of one-machine stages, in order.

    The permutation flow-shop recurrence ``C[i][s] = max(C[i-1][s], C[i][s-1]) + d[s]``
    (job ``i`` leaves stage ``s`` once it left stage ``s-1`` and the previous job left
    stage ``s``): the schedule of a chain pipeline whose micro-batches all flow in order.
    """
    finish = [0.0] * len(durations)
    for _ in range(num_jobs):
        prev = 0.0
        for s, d in enumerate(durations):
            finish[s] = max(finish[s], prev) + d
            prev = finish[s]
    return finish[-1]
