"""Stages of an RL iteration and the graph they form over the Transfer Dock's columns.

MindSpeed-RL (Feng et al., 2025, arXiv:2507.19017) runs the models of one RL iteration
-- actor rollout, reward, reference and old-policy log-probs, critic values,
advantages, actor and critic updates -- as stages that read the columns they need
from the Transfer Dock and write the columns they produce, each as soon as its inputs
are ready. A :class:`Stage` is a plain function ``batch -> {column: rows}`` plus its
declaration: input and output columns, micro-batch size, resource (the device group
or CPU pool it runs on) and role. A :class:`StageGraph` checks the declarations once,
at construction:

* every input column is produced by some stage or by the prompt loader (``sources``);
* every column has one writer;
* the stages form no cycle within an iteration (the only edge between iterations is
  the policy version, which the scheduler handles);
* with a ``schema`` (:class:`rlcore.dataflow.Schema`), every column a stage or the
  loader names is declared there; the pipeline then checks each put against its dtype
  (:meth:`StageGraph.check_put`).

The graph's :attr:`StageGraph.order` is a topological order: the synchronous loop runs
the stages in it, and the pipeline scheduler breaks ties with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from rlcore._checks import check_choice, check_positive
from rlcore.dataflow.columns import Schema

__all__ = ["PHASES", "ROLES", "Stage", "StageGraph", "batch_to", "on_device", "stage"]

ROLES = ("rollout", "compute", "update")
# The memory-plan phase a role runs in when stages share devices (co-located).
PHASES = {"rollout": "rollout", "compute": None, "update": "train"}

StageFn = Callable[[dict[str, torch.Tensor]], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True, eq=False)
class Stage:
    """One stage: ``fn(batch) -> {output column: rows}`` over rows of the dock.

    Fields:
      name: unique within a graph; also the stage's dock consumer name.
      fn: takes the padded batch the dock returns for ``inputs`` (``batch[c]`` and,
        for token columns, ``batch[c + "_mask"]``; rollout stages also get
        ``batch["policy_version"]``, the weights version to generate with) and returns
        one entry per output column: a tensor ``[b, ...]`` or a list of ``b`` tensors.
      inputs, outputs: dock column names.
      micro_batch: rows per call; None takes the whole iteration's batch in one call.
      by_group: take whole groups (all ``n_samples`` rows of a prompt) only.
      resource: the device group or CPU pool the stage runs on; stages on one
        resource run one at a time per slot of that resource.
      role: ``"rollout"`` (generates with the policy; its rows record the policy
        version), ``"update"`` (trains; when every update stage has finished an
        iteration the policy version goes up by one) or ``"compute"``.
      phase: the memory-plan phase the stage needs when it shares devices with
        others (``"rollout"``, ``"train"``, or None for no preference); defaults from
        the role (:data:`PHASES`).
      on_iteration_end: called with the iteration number once the stage has
        processed every row of it (an optimizer step, publishing weights).
      timeout: seconds one call may take before the pipeline stops and reports it.
    """

    name: str
    fn: StageFn
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    micro_batch: int | None = None
    by_group: bool = False
    resource: str = "device"
    role: str = "compute"
    phase: str | None = None
    on_iteration_end: Callable[[int], Any] | None = None
    timeout: float | None = None


def on_device(s: Stage, device: torch.device | str) -> Stage:
    """``s`` with its batch's tensors moved to ``device`` before each call (the dock keeps rows where they were put).

    The prompt loader and the host stages (rewards, pairs) put their columns in host
    memory; a stage that computes on an accelerator takes its inputs there first. The
    copies are queued ``non_blocking`` (pinned rows copy asynchronously; the stage's
    kernels queue behind them on the same stream). Tensors already on ``device`` and the
    batch's other entries are passed as they are; the outputs are not moved.

    >>> s = on_device(stage(lambda b: {"y": b["x"] + 1}, inputs=["x"], outputs=["y"], name="add"), "cpu")
    >>> s.fn({"x": torch.zeros(2)})["y"]
    tensor([1., 1.])
    """
    device = torch.device(device)
    fn = s.fn

    def placed(b: dict[str, torch.Tensor]) -> Mapping[str, Any]:
        return fn(batch_to(b, device, non_blocking=True))

    return dataclasses.replace(s, fn=placed)


def batch_to(b: Mapping[str, Any], device: torch.device | str, *, non_blocking: bool = False) -> dict[str, Any]:
    """A batch with its tensors on ``device`` (those already there, and the other entries, as they are)."""
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v for k, v in b.items()}


def _names(what: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ValueError(f"{what}: got {value!r}, expected a list of column names")
    names = tuple(value)
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError(f"{what}: got {names!r}, expected distinct column names (str)")
    return names


def stage(
    fn: StageFn,
    *,
    inputs: Sequence[str],
    outputs: Sequence[str],
    name: str | None = None,
    micro_batch: int | None = None,
    by_group: bool = False,
    resource: str = "device",
    role: str = "compute",
    phase: str | None = None,
    on_iteration_end: Callable[[int], Any] | None = None,
    timeout: float | None = None,
) -> Stage:
    """Declare ``fn`` as a pipeline stage reading ``inputs`` and writing ``outputs``.

    MindSpeed-RL (arXiv:2507.19017): each model of the RL loop is a stage over the
    Transfer Dock's columns. See :class:`Stage` for the fields; ``name`` defaults to
    ``fn.__name__``.

    Args:
      fn: ``batch -> {column: rows}``, ``b`` rows in, ``b`` rows out per output column.
      inputs: columns read (at least one).
      outputs: columns written (at least one).
      name: the stage's name.
      micro_batch: rows per call (None: the whole batch).
      by_group: only whole groups of ``n_samples`` rows.
      resource: device group or CPU pool name.
      role: one of :data:`ROLES`.
      phase: memory phase when co-located (default from the role).
      on_iteration_end: hook called with the iteration number when it is done.
      timeout: seconds one call may take.

    Returns:
      A :class:`Stage`.

    >>> s = stage(lambda b: {"scores": b["responses"].sum(1)}, inputs=["responses"], outputs=["scores"], name="reward")
    >>> s.name, s.inputs, s.outputs, s.role, s.phase
    ('reward', ('responses',), ('scores',), 'compute', None)
    """
    if not callable(fn):
        raise ValueError(f"fn: got {type(fn).__name__}, expected a callable batch -> columns")
    if name is None:
        name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name or name == "<lambda>":
        raise ValueError(f"name: got {name!r}, expected a non-empty str (a lambda needs an explicit name)")
    ins, outs = _names(f"{name}: inputs", inputs), _names(f"{name}: outputs", outputs)
    if not ins or not outs:
        raise ValueError(f"{name}: got inputs {ins} and outputs {outs}, expected at least one of each")
    if set(ins) & set(outs):
        raise ValueError(
            f"{name}: columns {sorted(set(ins) & set(outs))} are both input and output, expected disjoint sets"
        )
    if "policy_version" in outs:
        raise ValueError(f"{name}: outputs include 'policy_version', which the scheduler writes for rollout stages")
    if micro_batch is not None:
        if not isinstance(micro_batch, int) or isinstance(micro_batch, bool):
            raise ValueError(f"{name}: micro_batch got {micro_batch!r}, expected a positive int or None")
        check_positive(f"{name}: micro_batch", micro_batch)
    check_choice(f"{name}: role", role, ROLES)
    if timeout is not None:
        check_positive(f"{name}: timeout", timeout)
    if not isinstance(resource, str) or not resource:
        raise ValueError(f"{name}: resource got {resource!r}, expected a non-empty str")
    return Stage(
        name=name,
        fn=fn,
        inputs=ins,
        outputs=outs,
        micro_batch=micro_batch,
        by_group=bool(by_group),
        resource=resource,
        role=role,
        phase=PHASES[role] if phase is None else phase,
        on_iteration_end=on_iteration_end,
        timeout=timeout,
    )


class StageGraph:
    """Stages validated as one RL iteration's dataflow graph, in a topological order.

    Args:
      stages: the :class:`Stage` s (any order).
      sources: the columns the prompt loader puts at the start of an iteration.
      schema: the :class:`rlcore.dataflow.Schema` the columns must be declared in, or
        None (no check).

    Raises ``ValueError`` naming the stage and column for a duplicate stage name, a
    column with two writers (or written by a stage and the loader), an input nobody
    produces, a cycle, or (with ``schema``) a column the schema does not declare.

    >>> roll = stage(lambda b: {"responses": b["prompts"]}, inputs=["prompts"], outputs=["responses"], name="rollout", role="rollout")
    >>> reward = stage(lambda b: {"scores": b["responses"].sum(1)}, inputs=["responses"], outputs=["scores"], name="reward")
    >>> [s.name for s in StageGraph([reward, roll]).order]
    ['rollout', 'reward']
    """

    def __init__(
        self, stages: Sequence[Stage], *, sources: Sequence[str] = ("prompts",), schema: Schema | None = None
    ) -> None:
        stages = list(stages)
        if not stages or not all(isinstance(s, Stage) for s in stages):
            raise ValueError(f"stages: got {stages!r}, expected a non-empty list of Stage (from rlcore.dataflow.stage)")
        if schema is not None and not isinstance(schema, Schema):
            raise ValueError(f"schema: got {type(schema).__name__}, expected a rlcore.dataflow.Schema or None")
        self.sources = _names("sources", sources)
        self.schema = schema
        if schema is not None:
            schema.check_names("the prompt loader", self.sources, what="source column")
            for s in stages:
                schema.check_names(f"stage {s.name!r}", s.inputs, what="input column")
                schema.check_names(f"stage {s.name!r}", s.outputs, what="output column")
        seen: dict[str, Stage] = {}
        for s in stages:
            if s.name in seen:
                raise ValueError(f"stages: got two stages named {s.name!r}, expected unique names")
            seen[s.name] = s
        writer: dict[str, str | None] = dict.fromkeys(self.sources)  # None: the prompt loader
        for s in stages:
            for c in s.outputs:
                if c in writer:
                    by = "the prompt loader" if writer[c] is None else f"stage {writer[c]!r}"
                    raise ValueError(
                        f"stage {s.name!r}: column {c!r} is already written by {by}, expected one writer per column"
                    )
                writer[c] = s.name
        for s in stages:
            for c in s.inputs:
                if c not in writer:
                    raise ValueError(
                        f"stage {s.name!r}: input column {c!r} is produced by no stage and not by the prompt loader "
                        f"(sources {list(self.sources)})"
                    )
        self.writer = {c: w for c, w in writer.items() if w is not None}
        self.stages = {s.name: s for s in stages}
        self.upstream = {s.name: sorted({self.writer[c] for c in s.inputs if c in self.writer}) for s in stages}
        self.order = self._toposort(stages)

    def _toposort(self, stages: list[Stage]) -> tuple[Stage, ...]:
        """Kahn's algorithm, ties in declaration order; leftover stages lie on or below a cycle."""
        indeg = {s.name: len(self.upstream[s.name]) for s in stages}
        down: dict[str, list[str]] = {s.name: [] for s in stages}
        for name, ups in self.upstream.items():
            for u in ups:
                down[u].append(name)
        rank = {s.name: i for i, s in enumerate(stages)}
        ready = sorted((n for n, d in indeg.items() if d == 0), key=rank.__getitem__)
        order = []
        while ready:
            name = ready.pop(0)
            order.append(self.stages[name])
            for d in down[name]:
                indeg[d] -= 1
                if indeg[d] == 0:
                    ready.append(d)
                    ready.sort(key=rank.__getitem__)
        if len(order) < len(stages):
            stuck = [s.name for s in stages if indeg[s.name]]
            # Drop what only hangs below a cycle, so the message names the cycle itself.
            while True:
                on_cycle = [n for n in stuck if any(d in stuck for d in down[n])]
                if on_cycle == stuck:
                    break
                stuck = on_cycle
            edges = ", ".join(f"{u} -> {n}" for n in stuck for u in self.upstream[n] if u in stuck)
            raise ValueError(f"stages: got a cycle within an iteration among stages {stuck} ({edges}), expected a DAG")
        return tuple(order)

    def check_put(self, writer: str | None, columns: Mapping[str, Any]) -> None:
        """Refuse ``columns`` (a put of stage ``writer``, None for the prompt loader) that break the schema.

        Raises ``ValueError`` naming the stage, the column, the dtype it got and the one
        declared (:meth:`rlcore.dataflow.Schema.check_put`); a graph without a schema
        checks nothing.
        """
        if self.schema is not None:
            self.schema.check_put("the prompt loader" if writer is None else f"stage {writer!r}", columns)

    @property
    def names(self) -> tuple[str, ...]:
        """Stage names in topological order."""
        return tuple(s.name for s in self.order)

    @property
    def resources(self) -> tuple[str, ...]:
        """The resources the stages run on, in order of first use."""
        return tuple(dict.fromkeys(s.resource for s in self.order))

    def downstream_paths(
        self, weight: Mapping[str, float], *, within: Iterable[str] | None = None
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Per stage, the heaviest path of ``weight`` ending just before it (head) and starting just after it (tail).

        ``within`` limits the paths to those stages (default: all).
        """
        keep = set(self.names if within is None else within)
        up = {n: [u for u in self.upstream[n] if u in keep] for n in self.names if n in keep}
        order = [n for n in self.names if n in keep]
        head: dict[str, float] = {}
        for n in order:
            head[n] = max((head[u] + weight[u] for u in up[n]), default=0.0)
        tail: dict[str, float] = {}
        for n in reversed(order):
            tail[n] = max((tail[d] + weight[d] for d in order if n in up[d]), default=0.0)
        return head, tail

    def between(self, first: Iterable[str], last: Iterable[str]) -> list[str]:
        """Stages on some path from a stage of ``first`` to a stage of ``last`` (both ends included), in order."""
        below = set(first)
        for s in self.order:
            if any(u in below for u in self.upstream[s.name]):
                below.add(s.name)
        above = set(last)
        for s in reversed(self.order):
            if any(s.name in self.upstream[a] for a in above):
                above.add(s.name)
        return [n for n in self.names if n in below and n in above]
