"""The async pipeline scheduler: stages pull ready rows from per-iteration Transfer Docks.

MindSpeed-RL (Feng et al., 2025, arXiv:2507.19017) lets every stage of an RL iteration
work on micro-batches as soon as their input columns are in the Transfer Dock, instead
of each stage waiting for the whole batch, and lets the rollout of the next iterations
overlap the update of the current one up to a staleness bound.

The rules (shared by :func:`run_pipeline`, which runs stages on threads, and
:func:`rlcore.dataflow.simulate`, which runs them on a virtual clock):

* Iteration ``j`` gets its own :class:`~rlcore.dataflow.TransferDock`; the prompt
  loader fills its ``sources`` columns when ``j`` is admitted, which happens once the
  policy version ``v`` (update iterations finished) satisfies ``j - v <= staleness``.
  Every row a rollout stage writes records ``policy_version = v`` at the time it was
  generated, so its lag ``j - v`` never exceeds the bound (``staleness=0``: on-policy).
* ``blocking=False``: a stage takes up to ``micro_batch`` rows whose inputs are ready
  (``get`` with ``balance="fifo"``), as soon as there are that many (or all the rows
  left). ``blocking=True``: a stage starts an iteration only when every stage it reads
  from has finished it, and takes rows in index order -- the synchronous loop, micro-
  batch for micro-batch (:func:`rlcore.testing.reference.synchronous_loop_ref`).
* Each resource runs one call per slot at a time. A free slot takes the oldest
  iteration's work first, in topological order, except that work in the resource's
  current memory phase goes before work that would switch phase (co-located stages),
  and a phase switch waits until no call of the other phase is running there.
* Update stages run their iterations in order; the version goes up when every update
  stage has finished an iteration (with no update stage, when every stage has).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from rlcore._checks import check_positive
from rlcore.dataflow.dock import TransferDock
from rlcore.dataflow.openmp import release_openmp_threads
from rlcore.dataflow.stages import Stage, StageGraph

__all__ = [
    "HandBack",
    "PipelineResult",
    "ScheduledCall",
    "SchedulerCore",
    "StageTimeout",
    "TaskRecord",
    "add_note",
    "run_pipeline",
]

_COLLECT = "__collect__"
Loader = Callable[[int], Mapping[str, Any]]
Switch = Callable[[str, "str | None", str], Any]


class StageTimeout(TimeoutError):
    """A stage call ran longer than the stage's ``timeout``; ``stage`` names it."""

    def __init__(self, stage: str, iteration: int, seconds: float) -> None:
        super().__init__(f"stage {stage!r} timed out after {seconds:g} s at iteration {iteration}")
        self.stage = stage
        self.iteration = iteration


class HandBack(RuntimeError):
    """A stage call gives its rows back undone: its work was lost (the worker serving it died and was replaced).

    :func:`run_pipeline` hands the rows back to the iteration's dock
    (:meth:`TransferDock.nack <rlcore.dataflow.TransferDock.nack>`) and a later call of the
    stage takes exactly those rows again; nothing is written for them, so each row is
    processed once. Whoever raises it bounds how often (e.g. ``max_restarts``).
    """

    def __init__(self, stage: str, cause: str) -> None:
        super().__init__(f"stage {stage!r}: {cause}; its rows are handed back to be redone")
        self.stage = stage
        self.cause = cause


class TaskRecord(NamedTuple):
    """One stage call: its rows of an iteration, the policy version then, and when it ran."""

    stage: str
    resource: str
    iteration: int
    rows: torch.Tensor
    version: int
    start: float
    end: float


class PipelineResult(NamedTuple):
    """What a pipeline run did.

    Fields:
      tasks: a :class:`TaskRecord` per stage call, in completion order.
      batches: per iteration, the ``collect`` columns of all rows in row order (the
        dock's padded batch, ``policy_version`` included when a rollout stage exists).
      switches: ``(resource, from phase, to phase)`` per memory-phase switch.
      makespan: seconds from start to the last iteration's end.
    """

    tasks: list[TaskRecord]
    batches: list[dict[str, torch.Tensor]]
    switches: list[tuple[str, str, str]]
    makespan: float


@dataclasses.dataclass(eq=False)
class ScheduledCall:
    """One stage call the scheduler has started: its rows of an iteration, their batch, the version, any phase switch."""

    stage: Stage
    iteration: int
    rows: torch.Tensor
    batch: dict[str, torch.Tensor]
    version: int
    switch: tuple[str | None, str] | None
    start: float = 0.0


def add_note(err: BaseException, where: str) -> BaseException:
    """Add a PEP 678 note saying where ``err`` happened and return ``err`` (``BaseException.add_note`` is 3.11+).

    >>> add_note(ValueError("bad"), "in stage 'reward'").__notes__
    ["in stage 'reward'"]
    """
    if hasattr(err, "add_note"):
        err.add_note(where)
    else:
        err.__notes__ = [*getattr(err, "__notes__", ()), where]  # type: ignore[attr-defined]  # PEP 678 on 3.10
    return err


class _Ahead:
    """One iteration's ``open(iteration)`` on the loader thread; :meth:`result` waits for it and returns or re-raises."""

    def __init__(self, iteration: int, open: Callable[[int], TransferDock]) -> None:
        self.iteration = iteration
        self.done = threading.Event()
        self._open = open
        self._out: TransferDock | None = None
        self._err: BaseException | None = None

    def __call__(self) -> None:
        try:
            self._out = self._open(self.iteration)
        except BaseException as err:  # re-raised where the iteration is admitted
            self._err = err
        finally:
            self.done.set()

    def result(self) -> TransferDock:
        self.done.wait()
        if self._err is not None:
            raise self._err
        assert self._out is not None
        return self._out


class _LoaderThread:
    """The one daemon thread that runs the scheduler's side jobs (prefetches, retired iterations' collects), in order.

    A thread started per iteration cost the stage that admits it the thread's start-up, on the device's critical path.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self.errors: list[BaseException] = []  # a job's error, raised by the scheduler's result()
        self.thread = threading.Thread(target=self._loop, name="rlcore-pipeline-loader", daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], Any]) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException as err:
                self.errors.append(err)

    def close(self, timeout: float | None) -> None:
        """Let the jobs queued end (a prefetch's result is dropped) and the thread exit; wait up to ``timeout`` s."""
        self._jobs.put(None)
        self.thread.join(timeout)


class SchedulerCore:
    """The scheduling state and rules, independent of how calls are executed or timed.

    Shared by :func:`run_pipeline` (threads) and :func:`rlcore.dataflow.simulate` (a virtual clock).
    With ``prefetch``, the next iteration's loader call and dock are made on a thread
    while the current ones run, so admitting it costs the pipeline nothing; the loader
    is still called once per iteration, in order, one call at a time.
    """

    def __init__(
        self,
        graph: StageGraph,
        loader: Loader,
        *,
        num_prompts: int,
        n_samples: int,
        num_iterations: int,
        staleness: int,
        blocking: bool,
        slots: Mapping[str, int] | None,
        collect: Sequence[str],
        prefetch: bool = False,
    ) -> None:
        if not isinstance(graph, StageGraph):
            raise ValueError(f"graph: got {type(graph).__name__}, expected a StageGraph")
        if not callable(loader):
            raise ValueError(f"loader: got {type(loader).__name__}, expected a callable iteration -> source columns")
        for name, value, strict in (
            ("num_prompts", num_prompts, True),
            ("n_samples", n_samples, True),
            ("num_iterations", num_iterations, True),
            ("staleness", staleness, False),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: got {value!r}, expected an int")
            check_positive(name, value, strict=strict)
        rollouts = [s.name for s in graph.order if s.role == "rollout"]
        if len(rollouts) > 1:
            raise ValueError(f"graph: got rollout stages {rollouts}, expected at most one (it writes policy_version)")
        for s in graph.order:
            if s.by_group and s.micro_batch is not None and s.micro_batch % n_samples:
                raise ValueError(
                    f"stage {s.name!r}: micro_batch {s.micro_batch} with by_group, expected a multiple of n_samples={n_samples}"
                )
        unknown = sorted(set(slots or {}) - set(graph.resources))
        if unknown:
            raise ValueError(
                f"slots: got resource(s) {unknown} no stage runs on, expected some of {list(graph.resources)}"
            )
        slots = dict.fromkeys(graph.resources, 1) | dict(slots or {})
        for res, n in slots.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"slots[{res!r}]: got {n!r}, expected a positive int")
        known = set(graph.writer) | set(graph.sources) | {"policy_version"}
        unknown = [c for c in collect if c not in known]
        if unknown:
            raise ValueError(f"collect: got unknown column(s) {unknown}, expected some of {sorted(known)}")
        self.graph = graph
        self.loader = loader
        self.num_prompts, self.n_samples, self.capacity = num_prompts, n_samples, num_prompts * n_samples
        self.num_iterations, self.staleness, self.blocking = num_iterations, staleness, blocking
        self.slots = slots
        self.collect = list(dict.fromkeys([*collect, *(["policy_version"] if rollouts else [])]))
        self.columns = [*graph.sources, *graph.writer, *(["policy_version"] if rollouts else [])]
        self.by_resource = {r: [s for s in graph.order if s.resource == r] for r in graph.resources}
        self.updates = [s.name for s in graph.order if s.role == "update"] or list(graph.names)
        self.version = 0
        self.admitted = 0
        self.docks: dict[int, TransferDock] = {}
        self.taken: dict[tuple[str, int], int] = {}
        self.returned: dict[tuple[str, int], list[torch.Tensor]] = {}  # rows handed back, in the order they came back
        self.handed_back = 0
        self.left: dict[tuple[str, int], int] = {}
        self.finished: dict[int, set[str]] = {}
        self.running: dict[str, list[ScheduledCall]] = {r: [] for r in graph.resources}
        self.phase: dict[str, str | None] = dict.fromkeys(graph.resources)
        self.records: list[TaskRecord] = []
        self.batches: list[dict[str, torch.Tensor]] = [{} for _ in range(num_iterations)]
        self.switches: list[tuple[str, str, str]] = []
        self.retired = 0
        self.prefetch = prefetch
        self._ahead: _Ahead | None = None
        self._loader: _LoaderThread | None = None
        self._due: list[Callable[[], Any]] = []  # side jobs for the loader thread at the next started()
        self._errors: list[BaseException] = []
        self.admit()

    @property
    def done(self) -> bool:
        return self.retired == self.num_iterations

    def busy(self) -> int:
        return sum(len(t) for t in self.running.values())

    def admit(self) -> None:
        """Open every iteration the staleness bound allows and put its prompts."""
        while self.admitted < self.num_iterations and self.admitted - self.version <= self.staleness:
            j = self.admitted
            ahead, self._ahead = self._ahead, None
            self.docks[j] = ahead.result() if ahead is not None and ahead.iteration == j else self._open(j)
            self.finished[j] = set()
            for name in self.graph.names:
                self.taken[name, j] = 0
                self.left[name, j] = self.capacity
            self.admitted += 1

    def started(self, name: str) -> None:
        """Stage ``name``'s call is about to run: hand the side jobs that became due to the loader thread.

        The prefetch admission made due and the collects of retired iterations are Python
        (they fill or read a dock) and compete for the GIL with whichever thread runs Python
        beside them. Started with a stage call rather than when they became due, they run
        beside the call's kernels instead of the scheduler's own bookkeeping (the rows the
        next call takes), which would otherwise wait for the GIL on the device's path. In the
        blocking pipeline they wait for an update call (any call when the graph has no update
        stage): its backward runs in C++ with the GIL released for most of its time, where a
        rollout's decode loop and the forwards issue many small ops that each take the GIL
        back. The next iteration is admitted only after the update, so the prefetch is still
        ahead of it.
        """
        if self.blocking and name not in self.updates:
            return
        jobs, self._due = self._due, []
        if self.prefetch and self._ahead is None and self.admitted < self.num_iterations:  # the next one to admit
            self._ahead = _Ahead(self.admitted, self._open)
            jobs.append(self._ahead)
        if jobs and self._loader is None:
            self._loader = _LoaderThread()
        for job in jobs:
            assert self._loader is not None
            self._loader.submit(job)

    def _open(self, j: int) -> TransferDock:
        """Iteration ``j``'s dock holding the loader's source columns."""
        columns = self.loader(j)
        if not isinstance(columns, Mapping) or set(columns) != set(self.graph.sources):
            got = sorted(columns) if isinstance(columns, Mapping) else type(columns).__name__
            raise ValueError(
                f"loader({j}): got {got}, expected a dict with the source columns {list(self.graph.sources)}"
            )
        dock = TransferDock(
            self.num_prompts, self.n_samples, columns=self.columns, consumers=[*self.graph.names, _COLLECT]
        )
        self.graph.check_put(None, columns)
        try:
            dock.put(dict(columns), range(self.capacity))
        except ValueError as err:
            raise add_note(err, f"in the rows the prompt loader gave for iteration {j}") from None
        return dock

    def close(self, timeout: float | None = None) -> None:
        """Run the collects still due, then wait up to ``timeout`` s for the loader thread (a prefetch's result is dropped)."""
        self._ahead = None
        due, self._due = self._due, []
        loader, self._loader = self._loader, None
        if loader is None:
            for job in due:
                job()
            return
        for job in due:
            loader.submit(job)
        loader.close(timeout)
        self._errors.extend(loader.errors)

    def pick(self, resource: str) -> ScheduledCall | None:
        """The next call for a free slot of ``resource``, its rows already taken from the dock; None if none."""
        running = {t.stage.phase for t in self.running[resource] if t.stage.phase is not None}
        current = self.phase[resource]
        candidates = []
        for j in sorted(self.docks):
            for rank, s in enumerate(self.by_resource[resource]):
                if self.taken[s.name, j] == self.capacity:
                    continue
                if s.role == "update" and any(s.name not in self.finished[i] for i in self.docks if i < j):
                    continue
                if running and s.phase is not None and s.phase not in running:
                    continue
                switches = s.phase is not None and current is not None and s.phase != current
                candidates.append(((switches, j, rank), s, j))
        for _, s, j in sorted(candidates, key=lambda c: c[0]):
            task = self._take(s, j)
            if task is not None:
                if s.phase is not None and s.phase != current:
                    task.switch = (current, s.phase)
                    if current is not None:
                        self.switches.append((resource, current, s.phase))
                    self.phase[resource] = s.phase
                self.running[resource].append(task)
                return task
        return None

    def _take(self, s: Stage, j: int) -> ScheduledCall | None:
        dock = self.docks[j]
        taken = self.taken[s.name, j]
        left = self.capacity - taken
        count = left if s.micro_batch is None else min(s.micro_batch, left)
        back = self.returned.get((s.name, j))
        if back:  # rows a lost call handed back: taken again as they were, before any new ones
            batch, rows = dock.get(s.name, list(s.inputs), indexes=back.pop(0), by_group=False)
        elif self.blocking:
            if any(u not in self.finished[j] for u in self.graph.upstream[s.name]):
                return None
            batch, rows = dock.get(s.name, list(s.inputs), indexes=range(taken, taken + count), by_group=False)
        else:
            # Rows ready for s are at most what its slowest upstream stage has finished: skip the dock when short.
            done = min((self.capacity - self.left[u, j] for u in self.graph.upstream[s.name]), default=self.capacity)
            if done - taken < count:
                return None
            batch, rows = dock.get(s.name, list(s.inputs), count, by_group=s.by_group, balance="fifo")
            if rows.numel() == 0:
                return None
        self.taken[s.name, j] = taken + rows.numel()
        if s.role == "rollout":
            batch["policy_version"] = torch.full((rows.numel(),), self.version, dtype=torch.int64)
        return ScheduledCall(s, j, rows, batch, self.version, None)

    def hand_back(self, task: ScheduledCall) -> None:
        """Give a lost call's rows back to its iteration's dock (``nack``) and free its slot; they are taken again next."""
        s, j = task.stage, task.iteration
        self.docks[j].nack(s.name, task.rows)
        self.taken[s.name, j] -= task.rows.numel()
        self.returned.setdefault((s.name, j), []).append(task.rows)
        self.running[s.resource].remove(task)
        self.handed_back += 1

    def complete(self, task: ScheduledCall, out: Any) -> bool:
        """Put a call's outputs into its iteration's dock; True when the stage has now done every row."""
        s = task.stage
        if not isinstance(out, Mapping) or set(out) != set(s.outputs):
            got = sorted(out) if isinstance(out, Mapping) else type(out).__name__
            raise ValueError(f"stage {s.name!r}: returned {got}, expected a dict with its outputs {list(s.outputs)}")
        columns = dict(out)
        if s.role == "rollout":
            columns["policy_version"] = torch.full((task.rows.numel(),), task.version, dtype=torch.int64)
        self.graph.check_put(s.name, columns)
        try:
            self.docks[task.iteration].put(columns, task.rows)
        except ValueError as err:
            raise add_note(err, f"in the output of stage {s.name!r} at iteration {task.iteration}") from None
        self.left[s.name, task.iteration] -= task.rows.numel()
        return self.left[s.name, task.iteration] == 0

    def release(self, task: ScheduledCall, end: float, last: bool) -> None:
        """Free the call's slot; when ``last``, the stage has finished the iteration: advance versions and retire."""
        self.running[task.stage.resource].remove(task)
        self.records.append(
            TaskRecord(task.stage.name, task.stage.resource, task.iteration, task.rows, task.version, task.start, end)
        )
        if not last:
            return
        j = task.iteration
        self.finished[j].add(task.stage.name)
        while self.version < self.admitted and all(u in self.finished[self.version] for u in self.updates):
            self.version += 1
        if len(self.finished[j]) == len(self.graph.order) and min(self.docks) == j:
            for i in sorted(self.docks):
                if len(self.finished[i]) < len(self.graph.order):
                    break
                self._retire(i)
        self.admit()

    def _retire(self, j: int) -> None:
        dock = self.docks.pop(j)
        if self.collect:

            def collect() -> None:
                self.batches[j], _ = dock.get(
                    _COLLECT, self.collect, indexes=torch.arange(self.capacity), by_group=False
                )

            if self.prefetch:  # read on the loader thread, beside the next stage call (close() waits for it)
                self._due.append(collect)
            else:
                collect()
        self.retired += 1

    def stalled(self) -> str:
        """Why nothing can run although the pipeline is not done (for the error message)."""
        waiting = [f"{n}@{j}" for (n, j), left in self.left.items() if left and j in self.docks]
        return f"no stage can take rows and none is running; stages with rows left: {waiting}"

    def result(self, makespan: float) -> PipelineResult:
        if self._errors:  # a retired iteration's collect failed on the loader thread
            raise self._errors[0]
        return PipelineResult(self.records, self.batches, self.switches, makespan)


def run_pipeline(
    graph: StageGraph,
    loader: Loader,
    *,
    num_prompts: int,
    n_samples: int = 1,
    num_iterations: int = 1,
    staleness: int = 0,
    blocking: bool = False,
    slots: Mapping[str, int] | None = None,
    collect: Sequence[str] = (),
    switch: Switch | None = None,
    join_timeout: float = 10.0,
    threads: Mapping[str, int] | None = None,
) -> PipelineResult:
    """Run ``graph`` for ``num_iterations`` iterations, stages on threads pulling ready rows from the dock.

    MindSpeed-RL's async pipeline (arXiv:2507.19017); the scheduling rules are in this
    module's docstring. With ``blocking=True`` and ``staleness=0`` every stage sees the
    same micro-batches, in the same order, with the same policy version as in the
    synchronous loop, so deterministic stages give identical results.

    Each resource gets ``slots[resource]`` worker threads (default 1). A stage that
    raises stops the pipeline: the other workers finish their current call and exit,
    and the error is re-raised here with a note naming the stage and iteration, except
    :class:`HandBack`: the call's rows go back to the dock and are taken again. A call
    longer than its stage's ``timeout`` stops it with :class:`StageTimeout` (a thread
    cannot be interrupted: the late call's daemon worker is left to finish and its
    result is dropped).

    Args:
      graph: the :class:`~rlcore.dataflow.StageGraph`.
      loader: ``loader(iteration) -> {source column: rows}``, ``num_prompts * n_samples``
        rows each (row ``p * n_samples + i`` is sample ``i`` of prompt ``p``).
      num_prompts: prompts per iteration.
      n_samples: rows (responses) per prompt.
      num_iterations: iterations to run.
      staleness: bound ``k`` on ``iteration - policy_version`` of generated rows.
      blocking: stages wait for the whole batch (the synchronous loop).
      slots: concurrent calls per resource.
      collect: columns to return per iteration in :attr:`PipelineResult.batches`.
      switch: ``switch(resource, from_phase, to_phase)``, called on the worker before
        the first call in a new memory phase (``from_phase`` None the first time);
        see :class:`rlcore.memory.ColocatedSwitch`.
      join_timeout: seconds to wait for each worker thread at the end.
      threads: intra-op threads (``torch.set_num_threads``) of each worker of a resource;
        the other workers keep the calling thread's count. On a CPU device, a host
        resource whose stages run a few small ops (a reward's decoding, the advantages of
        a few hundred rows) at 1: each thread that runs a parallel op gets an OpenMP team
        of its own, and once the teams' threads outnumber the cores GNU OpenMP puts the
        device's idle helpers to sleep between ops (:mod:`rlcore.dataflow.openmp`).

    Returns:
      A :class:`PipelineResult`.

    >>> from rlcore.dataflow.stages import stage
    >>> roll = stage(lambda b: {"responses": b["prompts"] + b["policy_version"]}, inputs=["prompts"],
    ...              outputs=["responses"], name="rollout", role="rollout", micro_batch=2)
    >>> upd = stage(lambda b: {"loss": b["responses"] * 0.5}, inputs=["responses"], outputs=["loss"],
    ...             name="update", role="update", micro_batch=2)
    >>> res = run_pipeline(StageGraph([roll, upd]), lambda j: {"prompts": torch.arange(4)},
    ...                    num_prompts=4, num_iterations=3, staleness=1, collect=["loss"])
    >>> [b["policy_version"].tolist() for b in res.batches]
    [[0, 0, 0, 0], [0, 0, 0, 0], [2, 2, 2, 2]]
    """
    counts = _ThreadCounts(threads, graph.resources if isinstance(graph, StageGraph) else ())
    core = SchedulerCore(
        graph,
        loader,
        num_prompts=num_prompts,
        n_samples=n_samples,
        num_iterations=num_iterations,
        staleness=staleness,
        blocking=blocking,
        slots=slots,
        collect=collect,
        prefetch=True,
    )
    cond = threading.Condition()
    state: dict[str, Any] = {"error": None, "stop": False, "idle": 0, "epoch": 0}
    workers = sum(core.slots[r] for r in graph.resources)
    t0 = time.perf_counter()

    # The driving thread waits on this, not on ``cond``: a hand-off between stages wakes the
    # workers only, not a thread that has nothing to take.
    finished = threading.Event()

    def fail(err: BaseException) -> None:
        if state["error"] is None:
            state["error"] = err
        state["stop"] = True
        cond.notify_all()
        finished.set()

    def settle(task: ScheduledCall, out: Any, last: bool | None) -> bool:
        """With ``cond`` held: put the call's outputs (unless ``last`` is known: put already), free its slot, wake the others."""
        if state["stop"]:
            return False
        try:
            if last is None:
                last = core.complete(task, out)
            core.release(task, time.perf_counter() - t0, last)
        except BaseException as err:  # bad outputs, or the loader of a newly admitted iteration
            fail(
                err
                if last is not None
                else add_note(err, f"in stage {task.stage.name!r} at iteration {task.iteration}")
            )
            return False
        if core.done:
            finished.set()
        state["epoch"] += 1
        state["idle"] = 0
        cond.notify_all()
        return True

    def worker(resource: str) -> None:
        counts.enter(resource)
        # A finished call (its outputs, or None once put) settled when the lock is next held, together with the next
        # pick: no other worker takes the lock in between, nor does this one wait for it twice per hand-off.
        done: tuple[ScheduledCall, Any, bool | None] | None = None
        while True:
            with cond:
                if done is not None and not settle(*done):
                    return
                done = None
                seen = -1
                while True:
                    if state["stop"] or core.done:
                        return
                    try:
                        task = core.pick(resource)
                    except BaseException as err:  # a loader or dock error while taking rows
                        fail(err)
                        return
                    if task is not None:
                        task.start = time.perf_counter() - t0
                        core.started(task.stage.name)
                        break
                    if seen != state["epoch"]:
                        seen = state["epoch"]
                        state["idle"] += 1
                        if state["idle"] == workers and core.busy() == 0:
                            fail(RuntimeError(f"pipeline stalled: {core.stalled()}"))
                            return
                    cond.wait()
            s = task.stage
            try:
                if task.switch is not None and switch is not None:
                    switch(resource, *task.switch)
                out = s.fn(task.batch)
                if s.on_iteration_end is None:
                    done = (task, out, None)
                    continue
                with cond:  # the iteration's end runs between the put and the slot's release, without the lock
                    if state["stop"]:
                        return
                    last = core.complete(task, out)
                if last:
                    s.on_iteration_end(task.iteration)
                done = (task, None, last)
            except HandBack:  # the call's work was lost and its worker replaced: its rows are redone
                with cond:
                    if state["stop"]:
                        return
                    try:
                        core.hand_back(task)
                    except BaseException as err:
                        fail(err)
                        return
                    state["epoch"] += 1
                    state["idle"] = 0
                    cond.notify_all()
            except BaseException as err:
                with cond:
                    fail(add_note(err, f"in stage {s.name!r} at iteration {task.iteration}"))
                return

    pool = [
        (r, threading.Thread(target=worker, args=(r,), name=f"rlcore-pipeline-{r}-{i}", daemon=True))
        for r in graph.resources
        for i in range(core.slots[r])
    ]
    try:
        # The calling thread only waits from here on: its OpenMP team (a warm-up's, say) would make the device
        # worker's team a second one, and slow every parallel op of the device's stages (rlcore.dataflow.openmp).
        release_openmp_threads()
        counts.start(pool)
        while True:
            finished.wait(0.05)  # the stage time limits are checked every 50 ms
            with cond:
                if core.done or state["error"] is not None:
                    break
                now = time.perf_counter() - t0
                for tasks in core.running.values():
                    for task in tasks:
                        limit = task.stage.timeout
                        if limit is not None and now - task.start > limit:
                            fail(StageTimeout(task.stage.name, task.iteration, limit))
    finally:
        # Also on Ctrl-C / SIGTERM in this thread: workers finish their current call and
        # exit, so the process never ends with a worker thread inside a stage.
        with cond:
            state["stop"] = True
            cond.notify_all()
        counts.release()
        makespan = time.perf_counter() - t0
        for _, t in pool:
            if t.ident is not None:  # started
                t.join(join_timeout)
        core.close(join_timeout)
    if state["error"] is not None:
        raise state["error"]
    return core.result(makespan)


class _ThreadCounts:
    """Per-resource intra-op thread counts of the pipeline's workers (``run_pipeline``'s ``threads``).

    ``torch.set_num_threads`` sets the calling thread's OpenMP and MKL counts, and also the
    count that every thread which has not run a parallel op yet starts with (a thread takes
    it at its first parallel op, or its first ``torch.get_num_threads``). So the workers of a
    limited resource start first, take the process's count and then set theirs; the starting
    thread then puts its own count back, and only then does any worker take a call or
    another worker start.

    Why it matters on a CPU device: GNU OpenMP counts the threads of every team in the
    process, and once they outnumber the cores its idle threads stop spinning between
    parallel regions and sleep, so that every op of the device's stages then pays for
    waking its team. A host worker with a team of its own (two threads) made the device's
    stages about 1.7 times slower on two cores; with one thread it has no team.
    """

    def __init__(self, threads: Mapping[str, int] | None, resources: Sequence[str]) -> None:
        self.counts: dict[str, int] = {}
        for resource, n in (threads or {}).items():
            if resource not in resources:
                raise ValueError(
                    f"threads: got resource {resource!r} no stage runs on, expected some of {list(resources)}"
                )
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"threads[{resource!r}]: got {n!r}, expected a positive int")
            self.counts[resource] = n
        self._set: threading.Barrier | None = None
        self._go = threading.Event()

    def enter(self, resource: str) -> None:
        """On a worker, before its first call: set its count (a limited resource), and wait until all may start."""
        n = self.counts.get(resource)
        if n is None:
            return
        # Read first: a thread's first parallel op would otherwise set the process's count over this one.
        torch.get_num_threads()
        torch.set_num_threads(n)
        assert self._set is not None, "start() made the barrier before starting a limited worker"
        try:
            self._set.wait()
        except threading.BrokenBarrierError:  # the start was interrupted (release): the worker sees the stop
            return
        self._go.wait()

    def release(self) -> None:
        """Let every limited worker go on (they then see the pipeline stopped, if it did before they started)."""
        if self._set is not None:
            self._set.abort()
        self._go.set()

    def start(self, workers: Sequence[tuple[str, threading.Thread]]) -> None:
        """Start ``(resource, thread)`` workers: the limited ones, then (the count put back) the others."""
        first = [t for r, t in workers if r in self.counts]
        if first:
            count = torch.get_num_threads()
            self._set = threading.Barrier(len(first) + 1)
            for t in first:
                t.start()
            self._set.wait()
            torch.set_num_threads(count)
            self._go.set()
        for r, t in workers:
            if r not in self.counts:
                t.start()
