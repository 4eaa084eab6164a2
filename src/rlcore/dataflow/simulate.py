"""Simulation mode: the pipeline scheduler on a virtual clock, stage durations from a cost model.

For planning layouts beyond the machine at hand (hundreds of devices), MindSpeed-RL
(Feng et al., 2025, arXiv:2507.19017) style pipelines are run with the very scheduling
rules of :func:`rlcore.dataflow.run_pipeline` -- the same per-iteration Transfer Docks,
admission under the staleness bound, slot and phase rules -- but each stage call takes
``cost(stage, rows)`` virtual seconds instead of doing work. The report gives the
makespan, per-stage and per-resource utilisation and the bubble fraction (idle share of
all slots), and :func:`critical_path_bound` a lower bound on any schedule's makespan.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from rlcore.dataflow.scheduler import ScheduledCall, SchedulerCore, TaskRecord
from rlcore.dataflow.stages import Stage, StageGraph

__all__ = ["LinearCost", "SimReport", "critical_path_bound", "fit_costs", "simulate"]

Cost = Callable[[Stage, int], float] | Mapping[str, float]


class SimReport(NamedTuple):
    """A simulated run.

    Fields:
      makespan: virtual seconds until the last iteration finished.
      utilisation: per stage, busy time / (makespan * slots of its resource).
      resource_utilisation: per resource, busy time / (makespan * its slots).
      bubble_fraction: ``1 - busy / (makespan * all slots)``, the idle share.
      tasks: the :class:`~rlcore.dataflow.TaskRecord` of every call (virtual times).
      switches: ``(resource, from phase, to phase)`` per memory-phase switch.
    """

    makespan: float
    utilisation: dict[str, float]
    resource_utilisation: dict[str, float]
    bubble_fraction: float
    tasks: list[TaskRecord]
    switches: list[tuple[str, str, str]]


def _cost_fn(cost: Cost, graph: StageGraph) -> Callable[[Stage, int], float]:
    if callable(cost):
        return cost
    if isinstance(cost, Mapping):
        missing = [n for n in graph.names if n not in cost]
        if missing:
            raise ValueError(f"cost: got no per-row cost for stage(s) {missing}, expected one per stage")
        return lambda s, rows: float(cost[s.name]) * rows
    raise ValueError(
        f"cost: got {type(cost).__name__}, expected a callable (stage, rows) -> seconds or a dict of per-row seconds"
    )


def _duration(fn: Callable[[Stage, int], float], s: Stage, rows: int) -> float:
    d = float(fn(s, rows))
    if not d >= 0:
        raise ValueError(f"cost({s.name!r}, {rows}): got {d!r}, expected a duration >= 0")
    return d


def simulate(
    graph: StageGraph,
    cost: Cost,
    *,
    num_prompts: int,
    n_samples: int = 1,
    num_iterations: int = 1,
    staleness: int = 0,
    blocking: bool = False,
    slots: Mapping[str, int] | None = None,
    switch_cost: float = 0.0,
) -> SimReport:
    """Run the scheduler of :func:`~rlcore.dataflow.run_pipeline` with durations from ``cost``.

    MindSpeed-RL's async pipeline (arXiv:2507.19017), as a discrete-event simulation:
    every free slot takes work by the scheduler's rules at the current virtual time;
    the clock jumps to the earliest end of a running call. Stage functions and hooks
    are not called (outputs are placeholders), so the simulation costs the scheduler's
    bookkeeping only.

        makespan = end of the last call;  bubble = 1 - sum(busy) / (makespan * slots)

    Args:
      graph: the :class:`~rlcore.dataflow.StageGraph` (its functions are ignored).
      cost: ``cost(stage, rows) -> seconds`` (may draw at random), or a dict of
        per-row seconds per stage name.
      num_prompts, n_samples, num_iterations, staleness, blocking, slots: as for
        :func:`~rlcore.dataflow.run_pipeline`.
      switch_cost: seconds a memory-phase switch adds to the call that triggers it.

    Returns:
      A :class:`SimReport`.

    >>> from rlcore.dataflow.stages import stage
    >>> roll = stage(print, inputs=["prompts"], outputs=["responses"], name="rollout", role="rollout", micro_batch=1, resource="gen")
    >>> upd = stage(print, inputs=["responses"], outputs=["loss"], name="update", role="update", micro_batch=1, resource="train")
    >>> rep = simulate(StageGraph([roll, upd]), {"rollout": 2.0, "update": 1.0}, num_prompts=4, num_iterations=2, staleness=1)
    >>> rep.makespan, rep.utilisation["rollout"] == 16 / 17, rep.bubble_fraction == 1 - 24 / 34
    (17.0, True, True)
    """
    fn = _cost_fn(cost, graph)
    schema = graph.schema

    def placeholder(column: str, rows: int) -> torch.Tensor:
        # Zeros of the schema's dtype, so that a graph with a schema passes its put checks.
        return torch.zeros(rows) if schema is None else schema.placeholder(column, rows)

    zeros = {c: placeholder(c, num_prompts * n_samples) for c in graph.sources}
    core = SchedulerCore(
        graph,
        lambda j: zeros,
        num_prompts=num_prompts,
        n_samples=n_samples,
        num_iterations=num_iterations,
        staleness=staleness,
        blocking=blocking,
        slots=slots,
        collect=(),
    )
    free = dict(core.slots)
    busy = dict.fromkeys(graph.names, 0.0)
    events: list[tuple[float, int, ScheduledCall]] = []
    seq = itertools.count()
    now = 0.0
    while not core.done:
        for resource in graph.resources:
            while free[resource]:
                task = core.pick(resource)
                if task is None:
                    break
                task.start = now
                d = _duration(fn, task.stage, task.rows.numel())
                if task.switch is not None and task.switch[0] is not None:
                    d += switch_cost
                busy[task.stage.name] += d
                free[resource] -= 1
                heapq.heappush(events, (now + d, next(seq), task))
        if not events:
            raise RuntimeError(f"simulation stalled: {core.stalled()}")
        now, _, task = heapq.heappop(events)
        out = {c: placeholder(c, task.rows.numel()) for c in task.stage.outputs}
        last = core.complete(task, out)
        core.release(task, now, last)
        free[task.stage.resource] += 1
    makespan = now
    per_resource = {r: sum(busy[s.name] for s in core.by_resource[r]) for r in graph.resources}
    span = makespan if makespan > 0 else 1.0
    return SimReport(
        makespan=makespan,
        utilisation={n: busy[n] / (span * core.slots[graph.stages[n].resource]) for n in graph.names},
        resource_utilisation={r: per_resource[r] / (span * core.slots[r]) for r in graph.resources},
        bubble_fraction=1.0 - sum(per_resource.values()) / (span * sum(core.slots[r] for r in graph.resources)),
        tasks=core.records,
        switches=core.switches,
    )


def critical_path_bound(
    graph: StageGraph,
    cost: Cost,
    *,
    num_prompts: int,
    n_samples: int = 1,
    num_iterations: int = 1,
    staleness: int | None = None,
    slots: Mapping[str, int] | None = None,
) -> float:
    """A lower bound on the makespan of any schedule of ``graph``: the critical path through the bottleneck.

    With ``W_s`` the work of stage ``s`` over all ``N`` iterations and ``d_s`` its
    shortest call (one micro-batch), no schedule beats

        max( max_r sum_{s on r} W_s / slots_r,
             max_s head(s) + W_s / slots_{r(s)} + tail(s),
             ceil(N / (k + 1)) * T_1 )

    where ``head(s)`` / ``tail(s)`` are the heaviest ``d``-paths into / out of ``s``
    (before ``s`` can take a row, every stage on a path to it has finished at least
    one call; after its last call, every stage on a path from it has one more to do).
    The last term is the staleness chain, used when ``staleness=k`` is given and the
    graph has rollout and update stages: the rollout of iteration ``j + k + 1`` starts
    after the update of ``j`` ends, and ``T_1`` -- the first two terms for one
    iteration, over the stages between the rollout and the updates -- bounds each link.
    ``cost`` must be deterministic here (a dict, or a callable without randomness).

    >>> from rlcore.dataflow.stages import stage
    >>> roll = stage(print, inputs=["prompts"], outputs=["responses"], name="rollout", role="rollout", micro_batch=1, resource="gen")
    >>> upd = stage(print, inputs=["responses"], outputs=["loss"], name="update", role="update", micro_batch=1, resource="train")
    >>> graph, cost = StageGraph([roll, upd]), {"rollout": 2.0, "update": 1.0}
    >>> critical_path_bound(graph, cost, num_prompts=4, num_iterations=2)
    17.0
    >>> critical_path_bound(graph, cost, num_prompts=4, num_iterations=2, staleness=0)  # 2 * (4 * 2 + 1)
    18.0
    """
    fn = _cost_fn(cost, graph)
    capacity = num_prompts * n_samples
    slots = dict.fromkeys(graph.resources, 1) | dict(slots or {})
    work, first = {}, {}
    for s in graph.order:
        step = capacity if s.micro_batch is None else s.micro_batch
        sizes = [min(step, capacity - a) for a in range(0, capacity, step)]
        work[s.name] = sum(_duration(fn, s, b) for b in sizes)
        first[s.name] = min(_duration(fn, s, b) for b in sizes)

    def bound(names: list[str], iterations: int) -> float:
        head, tail = graph.downstream_paths(first, within=names)
        share = {n: iterations * work[n] / slots[graph.stages[n].resource] for n in names}
        by_resource = max(sum(share[n] for n in names if graph.stages[n].resource == r) for r in graph.resources)
        return max(by_resource, max(head[n] + share[n] + tail[n] for n in names))

    lower = bound(list(graph.names), num_iterations)
    rollout = [s.name for s in graph.order if s.role == "rollout"]
    updates = [s.name for s in graph.order if s.role == "update"]
    if staleness is not None and rollout and updates:
        links = -(-num_iterations // (staleness + 1))
        lower = max(lower, links * bound(graph.between(rollout, updates), 1))
    return lower


class LinearCost(NamedTuple):
    """A cost model ``cost(stage, rows) = fixed[stage] + per_row[stage] * rows`` (seconds)."""

    fixed: dict[str, float]
    per_row: dict[str, float]

    def __call__(self, stage: Stage, rows: int) -> float:
        return self.fixed[stage.name] + self.per_row[stage.name] * rows


def fit_costs(tasks: Sequence[TaskRecord]) -> LinearCost:
    """Fit ``duration = fixed + per_row * rows`` per stage to measured calls, for :func:`simulate`.

    Least squares per stage over its calls (``tasks`` of a
    :class:`~rlcore.dataflow.PipelineResult`), constrained to non-negative
    coefficients: with one call size only, the time is all per-row; a negative
    intercept refits through the origin, a negative slope keeps the mean as fixed cost.

        per_row = cov(rows, t) / var(rows),   fixed = mean(t) - per_row * mean(rows)

    >>> from rlcore.dataflow.scheduler import TaskRecord
    >>> rec = lambda rows, t: TaskRecord("reward", "cpu", 0, torch.arange(rows), 0, 0.0, t)
    >>> fit_costs([rec(2, 3.0), rec(4, 5.0)])
    LinearCost(fixed={'reward': 1.0}, per_row={'reward': 1.0})
    """
    by_stage: dict[str, list[tuple[float, float]]] = {}
    for t in tasks:
        by_stage.setdefault(t.stage, []).append((float(t.rows.numel()), t.end - t.start))
    if not by_stage:
        raise ValueError("tasks: got no calls, expected the TaskRecords of a run")
    fixed, per_row = {}, {}
    for name, calls in by_stage.items():
        x = torch.tensor([c[0] for c in calls], dtype=torch.float64)
        y = torch.tensor([c[1] for c in calls], dtype=torch.float64)
        var = ((x - x.mean()) ** 2).mean()
        b = float(((x - x.mean()) * (y - y.mean())).mean() / var) if var > 0 else float(y.mean() / x.mean())
        a = float(y.mean()) - b * float(x.mean())
        if a < 0:
            a, b = 0.0, float((x * y).sum() / (x * x).sum())
        if b < 0:
            a, b = float(y.mean()), 0.0
        fixed[name], per_row[name] = a, b
    return LinearCost(fixed, per_row)
