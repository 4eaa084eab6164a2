"""The Transfer Dock: a shared sample store split into a controller (metadata) and warehouses (data).

MindSpeed-RL (Feng et al., 2025, arXiv:2507.19017) replaces the central trainer that
gathers every batch and scatters it again with a *Transfer Dock*: each stage of the
RL loop (rollout, reward, reference / old log-probs, values, advantages, update)
``put``\\ s the columns it produced and ``get``\\ s the rows it needs as soon as they are
ready. The table has ``num_prompts * n_samples`` rows; the ``n_samples`` rows of one
prompt are contiguous and form a group.

* The :class:`DockController` keeps only metadata, as NumPy arrays: one readiness bitmap,
  put stamp and length vector per column, one consumption bitmap per consumer, and
  per-row ``age`` / ``completed`` flags for partial rollouts, plus per-group counts of
  ready and taken rows kept in step with the bitmaps. A ``get`` selects rows with
  array ops over the table (no Python loop over rows) under that consumer's lock;
  consumers never wait on each other, and puts take a lock of their own. NumPy rather
  than torch: each of these ops touches a few hundred flags, where torch's dispatch and
  its release of the GIL around every op cost more than the op, on the path between two
  stage calls of the device.
* Each :class:`Warehouse` holds the unpadded per-row tensors of one contiguous,
  disjoint index range. The controller tells a client where rows live
  (:meth:`DockController.layout`) and the client moves payloads to and from the
  warehouses directly, so no single process carries all the data.

:class:`TransferDock` is the embedded, in-process client; ``rlcore.dataflow.ray_dock``
places the same controller and warehouses in Ray actors behind the same API.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from rlcore._checks import check_choice, check_ndim, check_positive
from rlcore.dataflow.packing import pack

__all__ = [
    "BALANCE_MODES",
    "DockController",
    "TransferDock",
    "Warehouse",
    "flatten_rows",
    "unflatten_rows",
]

BALANCE_MODES = ("random", "tokens", "fifo")

# fifo keys are ``age * _AGE_STEP - stamp``: put stamps stay far below 2**40.
_AGE_STEP = 2**40


def _as_indexes(name: str, indexes: Any) -> torch.Tensor:
    """``indexes`` (tensor, sequence or range of ints) as a 1-D int64 CPU tensor."""
    if isinstance(indexes, torch.Tensor):
        if indexes.dtype.is_floating_point or indexes.dtype.is_complex or indexes.dtype == torch.bool:
            raise ValueError(f"{name}: got dtype {indexes.dtype}, expected an integer dtype")
        check_ndim(name, indexes, 1)
        return indexes.to(device="cpu", dtype=torch.int64)
    if (
        isinstance(indexes, range)
        and min(indexes.start, indexes.stop) >= -(2**63)
        and max(indexes.start, indexes.stop) < 2**63
    ):
        return torch.arange(indexes.start, indexes.stop, indexes.step, dtype=torch.int64)
    if isinstance(indexes, (range, Sequence)) and all(isinstance(i, int) and not isinstance(i, bool) for i in indexes):
        if any(not -(2**63) <= i < 2**63 for i in indexes):
            raise ValueError(
                f"{name}: got an int beyond the int64 range, expected a 1-D integer tensor or a sequence of ints"
            )
        return torch.tensor(list(indexes), dtype=torch.int64).reshape(-1)
    raise ValueError(f"{name}: got {type(indexes).__name__}, expected a 1-D integer tensor or a sequence of ints")


def _as_run(name: str, indexes: Any) -> torch.Tensor | range:
    """``indexes`` as :func:`_as_indexes` gives them, but a step-1 ``range`` (a run) kept as it is: no tensor built."""
    if isinstance(indexes, range) and indexes.step == 1 and indexes.start >= -(2**63) and indexes.stop < 2**63:
        return indexes if indexes.stop >= indexes.start else range(indexes.start, indexes.start)
    return _run(_as_indexes(name, indexes))


def _run(rows: torch.Tensor) -> torch.Tensor | range:
    """``rows`` as a ``range`` when they are one increasing run (``a, a + 1, ..., b - 1``), else as they are.

    The controller and the warehouses index a run with slices (views) instead of
    gathers: a whole-iteration get of the blocking pipeline costs a few ops, not a few
    per column.
    """
    a = rows.numpy()
    m = a.size
    if m == 0:
        return rows
    lo, hi = int(a[0]), int(a[-1])
    if hi - lo + 1 != m or (m > 1 and not bool((a[1:] > a[:-1]).all())):
        return rows
    return range(lo, hi + 1)


def _at(rows: torch.Tensor | range) -> np.ndarray | slice:
    """What indexes a per-row metadata array at ``rows``: a slice for a run, else the indexes (a NumPy view)."""
    return slice(rows.start, rows.stop) if isinstance(rows, range) else rows.numpy()


def _array(rows: torch.Tensor | range) -> np.ndarray:
    """``rows`` as a 1-D int64 NumPy array."""
    return np.arange(rows.start, rows.stop, dtype=np.int64) if isinstance(rows, range) else rows.numpy()


def _tensor(rows: torch.Tensor | range) -> torch.Tensor:
    """``rows`` as a 1-D int64 tensor."""
    return torch.from_numpy(_array(rows)) if isinstance(rows, range) else rows


def _copy(a: np.ndarray) -> torch.Tensor:
    """A metadata array as a tensor of its own (the controller's arrays change in place)."""
    return torch.from_numpy(a.copy())


def _check_timeout(name: str, timeout: Any) -> None:
    """``timeout`` is None or a number of seconds >= 0 (``inf`` allowed: no limit)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout or timeout < 0:
        raise ValueError(f"{name}: got {timeout!r}, expected None or a number of seconds >= 0")


# The longest single sleep: threading and asyncio reject longer ones (a deadline may be inf).
_MAX_SLEEP = 3600.0


def _rows(column: str, value: Any) -> torch.Tensor | list[torch.Tensor]:
    """A column's rows: a tensor stays whole (its rows along dim 0), a list is taken as the rows."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(f"columns[{column!r}]: got a 0-d tensor, expected one row per index along dim 0")
        return value.detach() if value.requires_grad else value
    if isinstance(value, (list, tuple)):
        rows = list(value)
        for i, row in enumerate(rows):
            if not isinstance(row, torch.Tensor):
                raise ValueError(f"columns[{column!r}][{i}]: got {type(row).__name__}, expected a torch.Tensor")
        return [row.detach() if row.requires_grad else row for row in rows]
    raise ValueError(f"columns[{column!r}]: got {type(value).__name__}, expected a tensor or a list of tensors")


def _row_spec(column: str, rows: list[torch.Tensor]) -> tuple[torch.dtype, int, tuple[int, ...]]:
    """``(dtype, ndim, trailing shape)`` shared by ``rows``; the first dimension may vary."""
    first = rows[0]
    spec = (first.dtype, first.dim(), tuple(first.shape[1:]))
    seen: set[int] = set()
    for i, row in enumerate(rows):
        if id(row) in seen:  # the same tensor given for several rows (a group's answer): checked once
            continue
        seen.add(id(row))
        got = (row.dtype, row.dim(), tuple(row.shape[1:]))
        if got != spec:
            raise ValueError(
                f"columns[{column!r}][{i}]: got dtype {row.dtype} and shape {tuple(row.shape)}, expected dtype "
                f"{spec[0]} with {spec[1]} dims and trailing shape {spec[2]} (that of row 0)"
            )
    return spec


def _tensor_spec(value: torch.Tensor) -> tuple[torch.dtype, int, tuple[int, ...]]:
    """:func:`_row_spec` of the rows of one tensor (each row is ``value[i]``)."""
    return value.dtype, value.dim() - 1, tuple(value.shape[2:])


def _tensor_lengths(value: torch.Tensor) -> int:
    """:func:`_row_lengths` of the rows of one tensor, all equal: ``value.shape[1]`` (0 for per-row scalars)."""
    return value.shape[1] if value.dim() > 1 else 0


def _row_lengths(rows: list[torch.Tensor]) -> list[int]:
    """Tokens per row: the first dimension of each row, 0 for 0-d (per-sample scalar) rows."""
    return [row.shape[0] if row.dim() else 0 for row in rows]


class DockController:
    """The Transfer Dock's metadata: readiness, consumption, ages; no payloads.

    Args:
      num_prompts: number of groups in the table.
      n_samples: rows per group (responses per prompt).
      columns: column names declared up front; more are added by the first put.
      consumers: consumer names (each stage that gets rows).
      num_warehouses: the table is cut into this many contiguous index ranges.
      seed: seeds the generator behind ``balance="random"``.

    Every method takes and returns plain values and CPU tensors. Waiting is kept apart
    from the state: each ``try_*`` method returns None for "wait for a change", which
    :meth:`wait` retries on a condition variable (threads in one process) and the Ray
    host retries with asyncio, so any number of waiting clients holds no thread.

    >>> ctl = DockController(2, 2, columns=["responses"], consumers=["reward"])
    >>> rows = torch.tensor([2, 3])
    >>> ctl.begin_put({"responses": (torch.int64, 1, ())}, rows)
    >>> ctl.commit_put({"responses": torch.tensor([3, 5])}, rows)
    >>> ctl.sample("reward", ["responses"], 2, balance="fifo").tolist()
    [2, 3]
    >>> ctl.release()  # the payloads of the rows taken were read
    >>> ctl.all_consumed("reward")
    False
    """

    def __init__(
        self,
        num_prompts: int,
        n_samples: int = 1,
        *,
        columns: Iterable[str] = (),
        consumers: Iterable[str] = (),
        num_warehouses: int = 1,
        seed: int = 0,
    ) -> None:
        for name, value in (("num_prompts", num_prompts), ("n_samples", n_samples), ("num_warehouses", num_warehouses)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: got {value!r}, expected a positive int")
            check_positive(name, value)
        capacity = num_prompts * n_samples
        if num_warehouses > capacity:
            raise ValueError(f"num_warehouses: got {num_warehouses}, expected at most the capacity {capacity}")
        self.num_prompts = num_prompts
        self.n_samples = n_samples
        self.capacity = capacity
        # Warehouse w holds rows [bounds[w], bounds[w + 1]).
        self.bounds = torch.linspace(0, capacity, num_warehouses + 1).round().to(torch.int64)
        self._generator = torch.Generator().manual_seed(seed)
        self._stamps = itertools.count(1)
        self._put_lock = threading.RLock()  # column registration and per-column bitmap writes
        self._registry_lock = threading.Lock()  # adding consumers
        self._changed = threading.Condition(threading.Lock())  # waiters sleep on it; _bump wakes them
        self._version = 0
        self._gate = threading.Lock()  # leases and the pending reset
        self._leases = 0
        self._resetting: str | None = None
        self._ready: dict[str, np.ndarray] = {}
        self._stamp: dict[str, np.ndarray] = {}
        self._lengths: dict[str, np.ndarray] = {}
        self._pending: dict[str, np.ndarray] = {}  # cells reserved by a put in flight
        self._specs: dict[str, tuple[torch.dtype, int, tuple[int, ...]]] = {}
        self._consumed: dict[str, np.ndarray] = {}
        # Per-group counts of ready / taken rows, kept in step with the bitmaps, so a
        # whole-group get reads num_prompts entries rather than reducing capacity ones.
        self._group_ready: dict[str, np.ndarray] = {}
        self._group_taken: dict[str, np.ndarray] = {}
        self._conds: dict[str, threading.Condition] = {}
        self.age = np.zeros(capacity, dtype=np.int64)
        self._group_age = np.zeros(num_prompts, dtype=np.int64)  # ages change only at reset
        self.completed = np.ones(capacity, dtype=np.bool_)
        for name, names in (("columns", columns), ("consumers", consumers)):
            if isinstance(names, str):
                raise ValueError(f"{name}: got the string {names!r}, expected a list of names")
        for column in columns:
            self._add_column(column)
        for consumer in consumers:
            self.add_consumer(consumer)

    # ------------------------------------------------------------------ registry

    def layout(self) -> dict[str, Any]:
        """What a client needs to route rows: capacity, group size and warehouse bounds."""
        return {"capacity": self.capacity, "n_samples": self.n_samples, "bounds": self.bounds.clone()}

    def columns(self) -> list[str]:
        """The declared column names."""
        with self._put_lock:
            return sorted(self._ready)

    def consumers(self) -> list[str]:
        """The registered consumer names."""
        with self._registry_lock:
            return sorted(self._conds)

    def add_consumer(self, name: str) -> None:
        """Register a consumer; it starts having taken nothing."""
        if not isinstance(name, str):
            raise ValueError(f"name: got {type(name).__name__}, expected a str")
        with self._registry_lock:
            if name in self._conds:
                return
            self._consumed[name] = np.zeros(self.capacity, dtype=np.bool_)
            self._group_taken[name] = np.zeros(self.num_prompts, dtype=np.int32)
            self._conds[name] = threading.Condition(threading.Lock())

    def _add_column(self, name: str) -> None:
        if not isinstance(name, str):
            raise ValueError(f"columns: got a {type(name).__name__} name, expected str")
        if name not in self._ready:
            self._stamp[name] = np.zeros(self.capacity, dtype=np.int64)
            self._lengths[name] = np.zeros(self.capacity, dtype=np.int64)
            self._ready[name] = np.zeros(self.capacity, dtype=np.bool_)
            self._pending[name] = np.zeros(self.capacity, dtype=np.bool_)
            self._group_ready[name] = np.zeros(self.num_prompts, dtype=np.int32)

    # ------------------------------------------------------------------ checks

    def _check_in_range(self, name: str, indexes: torch.Tensor | range) -> None:
        if isinstance(indexes, range):  # a run: increasing, so no repeats
            if len(indexes) and (indexes.start < 0 or indexes.stop > self.capacity):
                below = range(indexes.start, min(indexes.stop, 0))
                above = range(max(indexes.start, self.capacity), indexes.stop)
                bad = [*below[:5], *above[:5]][:5]  # from the run's bounds: a huge run is not walked
                raise ValueError(f"{name}: got row(s) {bad}, expected indexes in [0, {self.capacity})")
            return
        a = indexes.numpy()
        if not a.size:
            return
        if int(a.min()) < 0 or int(a.max()) >= self.capacity:
            bad = a[(a < 0) | (a >= self.capacity)][:5].tolist()
            raise ValueError(f"{name}: got row(s) {bad}, expected indexes in [0, {self.capacity})")
        increasing = a.size == 1 or bool((a[1:] > a[:-1]).all())
        if not increasing and np.unique(a).size != a.size:
            raise ValueError(f"{name}: got repeated rows, expected each row at most once")

    def _check_consumer(self, consumer: str) -> threading.Condition:
        cond = self._conds.get(consumer) if isinstance(consumer, str) else None
        if cond is None:
            raise ValueError(f"consumer: got {consumer!r}, expected a registered consumer, one of {self.consumers()}")
        return cond

    def _check_columns(self, columns: Sequence[str]) -> None:
        if isinstance(columns, str) or not columns:
            raise ValueError(f"columns: got {columns!r}, expected a non-empty list of column names")
        unknown = [c for c in columns if not isinstance(c, str) or c not in self._ready]
        if unknown:
            raise ValueError(f"columns: got undeclared column(s) {unknown}, expected some of {self.columns()}")
        if len(set(columns)) != len(columns):
            raise ValueError(f"columns: got {list(columns)}, expected each column at most once")

    # ------------------------------------------------------------------ waiting and leases
    #
    # A get holds a lease from the moment it takes rows until its client has read their
    # payloads (:meth:`release`); a put holds one from :meth:`try_begin_put` until
    # :meth:`commit_put` / :meth:`abort_put`. A reset first closes the gate (new gets and
    # puts wait), waits for the leases to drain, and only then clears metadata and, in
    # the client, the warehouses. Every ``try_*`` method returns None for "not now, wait
    # for a change": the embedded dock waits on a condition (:meth:`wait`), the Ray host
    # on an asyncio condition, so waiting never holds a thread that a writer needs.

    def _bump(self) -> None:
        """Wake every waiter: the state changed."""
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def wait(self, method: str, timeout: float | None, *args: Any, **kwargs: Any) -> Any:
        """Call ``try_<...>`` method ``method`` until it returns something other than None, or ``timeout`` s pass.

        Returns what it returned, or None on timeout. Blocks the calling thread: the
        embedded dock's waiting; the Ray host waits with asyncio instead.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = getattr(self, method)
        while True:
            with self._changed:
                seen = self._version
            out = attempt(*args, **kwargs)
            if out is not None:
                return out
            with self._changed:
                while self._version == seen:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return None
                    self._changed.wait(None if left is None else min(left, _MAX_SLEEP))

    def _lease(self) -> bool:
        """Take a lease unless a reset is pending (the gate lock held by the caller's caller is not needed)."""
        with self._gate:
            if self._resetting is not None:
                return False
            self._leases += 1
            return True

    def release(self) -> None:
        """End the lease of a get whose client has read its rows' payloads."""
        with self._gate:
            self._leases = max(0, self._leases - 1)
        self._bump()

    # ------------------------------------------------------------------ put side

    def try_begin_put(
        self, specs: Mapping[str, tuple[torch.dtype, int, tuple[int, ...]]], indexes: torch.Tensor | range
    ) -> bool | None:
        """Validate a put and reserve its cells before any data moves; None while a reset is pending.

        Raises ``ValueError`` (changing nothing) for an index out of range or repeated,
        a dtype / trailing shape that differs from earlier puts of the column, or a cell
        already ready or being put: a cell is written once per iteration, and
        :meth:`reset` frees it. On success the put holds a lease and its cells are
        reserved until :meth:`commit_put` or :meth:`abort_put`.
        """
        self._check_in_range("indexes", indexes)
        for column in specs:
            if not isinstance(column, str):
                raise ValueError(f"columns: got a {type(column).__name__} name, expected str")
        with self._put_lock:
            for column, spec in specs.items():
                known = self._specs.get(column)
                if known is not None and known != spec:
                    raise ValueError(
                        f"columns[{column!r}]: got dtype {spec[0]}, {spec[1]} dims, trailing shape {spec[2]}; "
                        f"expected dtype {known[0]}, {known[1]} dims, trailing shape {known[2]} (earlier puts)"
                    )
            at = _at(indexes)
            for column in specs:
                if column not in self._ready:
                    continue
                busy = self._ready[column][at] | self._pending[column][at]
                if busy.any():
                    bad = _array(indexes)[busy][:5].tolist()
                    raise ValueError(
                        f"indexes: got row(s) {bad} whose column {column!r} is already ready or being put, "
                        f"expected rows not holding {column!r} yet (a cell is put once per iteration; reset() "
                        "frees it)"
                    )
            if not self._lease():
                return None
            for column, spec in specs.items():
                self._add_column(column)
                self._specs.setdefault(column, spec)
                self._pending[column][at] = True
        return True

    def begin_put(
        self, specs: Mapping[str, tuple[torch.dtype, int, tuple[int, ...]]], indexes: torch.Tensor | range
    ) -> None:
        """:meth:`try_begin_put`, waiting while a reset is in progress."""
        self.wait("try_begin_put", None, specs, indexes)

    def commit_put(self, lengths: Mapping[str, torch.Tensor | int], indexes: torch.Tensor | range) -> None:
        """Mark the cells of a begun put ready (its payloads reached the warehouses), end its lease, wake consumers.

        ``lengths``: per column, each row's length (a sequence or tensor), or one length for every row.
        """
        stamp = next(self._stamps)
        at = _at(indexes)
        n = self.n_samples
        # The begun put reserved its cells, none ready: each row makes its group one row readier.
        whole = (
            slice(indexes.start // n, indexes.stop // n)
            if isinstance(indexes, range) and indexes.start % n == 0 and indexes.stop % n == 0
            else None
        )
        with self._put_lock:
            groups = None if whole is not None else _array(indexes) // n
            for column, lens in lengths.items():
                self._lengths[column][at] = lens.numpy() if isinstance(lens, torch.Tensor) else lens
                self._stamp[column][at] = stamp
                if groups is None:
                    self._group_ready[column][whole] += n
                else:
                    fresh = ~self._ready[column][at]
                    np.add.at(self._group_ready[column], groups, fresh.astype(np.int32))
                self._ready[column][at] = True
                self._pending[column][at] = False
        self.release()

    def abort_put(self, columns: Sequence[str], indexes: torch.Tensor | range) -> None:
        """Give up a begun put whose payloads did not all arrive: free its cells and end its lease."""
        at = _at(indexes)
        with self._put_lock:
            for column in columns:
                self._pending[column][at] = False
        self.release()

    def set_completed(self, indexes: torch.Tensor, completed: torch.Tensor) -> None:
        """Flag rows whose generation finished (True) or must resume next iteration (False)."""
        self._check_in_range("indexes", indexes)
        if not isinstance(completed, torch.Tensor) or completed.dtype != torch.bool or completed.shape != indexes.shape:
            got = (
                f"dtype {completed.dtype} shape {tuple(completed.shape)}"
                if isinstance(completed, torch.Tensor)
                else type(completed).__name__
            )
            raise ValueError(
                f"completed: got {got}, expected a torch.bool tensor of shape {tuple(indexes.shape)} (that of indexes)"
            )
        with self._put_lock:
            self.completed[indexes.numpy()] = completed.cpu().numpy()

    # ------------------------------------------------------------------ get side

    def _unit_view(self, x: np.ndarray, by_group: bool) -> np.ndarray:
        return x.reshape(self.num_prompts, self.n_samples) if by_group else x.reshape(-1, 1)

    def _select(
        self, consumer: str, columns: Sequence[str], need: int, by_group: bool, balance: str
    ) -> torch.Tensor | None:
        """``need`` eligible units in priority order as row indexes, or None when fewer are eligible."""
        if by_group:
            counts = [self._group_ready[c] for c in columns]
            full = (counts[0] if len(columns) == 1 else np.stack(counts).min(0)) == self.n_samples
            eligible = full & (self._group_taken[consumer] == 0)
        else:
            ready = self._ready[columns[0]] if len(columns) == 1 else np.stack([self._ready[c] for c in columns]).all(0)
            eligible = ready & ~self._consumed[consumer]
        if int(np.count_nonzero(eligible)) < need:
            return None
        age = self._group_age if by_group else self.age
        if balance == "random":
            # Oldest first, ties broken uniformly at random; topk keeps it one pass over the units.
            noise = torch.rand(eligible.size, generator=self._generator)
            scores = torch.where(torch.from_numpy(eligible), torch.from_numpy(age) + noise, -1.0)
            units = scores.topk(need).indices.numpy()
        else:
            candidates = np.flatnonzero(eligible)
            age = age[candidates]
            if balance == "fifo":
                stamp = np.stack([self._stamp[c] for c in columns]).max(0)
                rank = self._unit_view(stamp, by_group).max(1)[candidates]
            else:
                tokens = np.stack([self._lengths[c] for c in columns]).sum(0)
                tokens = self._unit_view(tokens, by_group).sum(1)[candidates]
                by_len = np.argsort(-tokens, kind="stable")  # longest first, ties in row order
                # Interleave longest and shortest: every prefix pairs long with short units,
                # so consecutive gets carry similar token totals.
                m = by_len.size
                alternate = np.stack([np.arange(m), m - 1 - np.arange(m)], 1).ravel()[:m]
                rank = np.empty(m, dtype=np.int64)
                rank[by_len[alternate]] = np.arange(m)
            # Highest key first, ties in row order (a stable sort of the negated keys).
            units = candidates[np.argsort(rank - age * _AGE_STEP, kind="stable")[:need]]
        if by_group:
            units = (units[:, None] * self.n_samples + np.arange(self.n_samples)).ravel()
        return torch.from_numpy(units.astype(np.int64, copy=False))

    def check_sample(
        self,
        consumer: str,
        columns: Sequence[str],
        count: int | None,
        *,
        by_group: bool = True,
        balance: str = "random",
        indexes: torch.Tensor | range | None = None,
        timeout: float | None = None,
    ) -> float | None:
        """Validate a get; returns how long it may wait: ``timeout``, or 0 / None (forever) when ``timeout`` is None."""
        self._check_consumer(consumer)
        self._check_columns(columns)
        check_choice("balance", balance, BALANCE_MODES)
        if not isinstance(by_group, bool):
            raise ValueError(f"by_group: got {by_group!r}, expected a bool")
        _check_timeout("timeout", timeout)
        if indexes is not None:
            self._check_in_range("indexes", indexes)
            size = len(indexes)
            if count is not None and count != size:
                raise ValueError(f"count: got {count}, expected None or {size} (the number of indexes)")
            if by_group and size:
                if isinstance(indexes, range):
                    partial = bool(indexes.start % self.n_samples or indexes.stop % self.n_samples)
                else:
                    per_group = np.bincount(indexes.numpy() // self.n_samples, minlength=self.num_prompts)
                    partial = bool(((per_group != 0) & (per_group != self.n_samples)).any())
                if partial:
                    raise ValueError(
                        f"indexes: got partial groups, expected whole groups of {self.n_samples} rows (by_group=True)"
                    )
            return timeout
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise ValueError(f"count: got {count!r}, expected a positive int")
        unit = self.n_samples if by_group else 1
        if count % unit:
            raise ValueError(f"count: got {count}, expected a multiple of the group size {unit} (by_group=True)")
        if count > self.capacity:
            raise ValueError(f"count: got {count}, expected at most the capacity {self.capacity}")
        return 0.0 if timeout is None else timeout

    def try_sample(
        self,
        consumer: str,
        columns: Sequence[str],
        count: int | None,
        *,
        by_group: bool = True,
        balance: str = "random",
        indexes: torch.Tensor | range | None = None,
    ) -> torch.Tensor | None:
        """One attempt at a get (validated as :meth:`check_sample`): the rows taken, now under a lease, or None to wait."""
        self.check_sample(consumer, columns, count, by_group=by_group, balance=balance, indexes=indexes)
        cond = self._check_consumer(consumer)
        columns = list(columns)
        with cond:
            if indexes is not None:
                if len(indexes) == 0:
                    return _tensor(indexes)
                at = _at(indexes)
                consumed = self._consumed[consumer][at]
                if consumed.any():
                    taken = _array(indexes)[consumed][:5].tolist()
                    raise ValueError(
                        f"indexes: got row(s) {taken} already taken by {consumer!r}, expected rows it has not taken"
                    )
                if not all(self._ready[c][at].all() for c in columns):
                    return None
                rows = indexes
            else:
                assert count is not None, "check_sample requires a count without indexes"
                unit = self.n_samples if by_group else 1
                picked = self._select(consumer, columns, count // unit, by_group, balance)
                if picked is None:
                    return None
                rows = picked
            if not self._lease():
                return None
            self._take(consumer, rows)
            return _tensor(rows)

    def sample(
        self,
        consumer: str,
        columns: Sequence[str],
        count: int | None,
        *,
        by_group: bool = True,
        balance: str = "random",
        indexes: torch.Tensor | range | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor:
        """Pick rows for ``consumer`` whose ``columns`` are ready, mark them consumed, return their indexes.

        See :meth:`TransferDock.get` for the semantics; an empty tensor means "not now".
        A non-empty result holds a lease: call :meth:`release` once its payloads are read.
        """
        wait = self.check_sample(
            consumer, columns, count, by_group=by_group, balance=balance, indexes=indexes, timeout=timeout
        )
        rows = self.wait(
            "try_sample", wait, consumer, list(columns), count, by_group=by_group, balance=balance, indexes=indexes
        )
        return torch.empty(0, dtype=torch.int64) if rows is None else rows

    def _take(self, consumer: str, rows: torch.Tensor | range) -> None:
        """Mark ``rows`` taken by ``consumer`` (its lock held)."""
        self._consumed[consumer][_at(rows)] = True
        n = self.n_samples
        if isinstance(rows, range) and rows.start % n == 0 and rows.stop % n == 0:  # whole groups
            self._group_taken[consumer][rows.start // n : rows.stop // n] += n
            return
        np.add.at(self._group_taken[consumer], _array(rows) // n, 1)

    def nack(self, consumer: str, indexes: torch.Tensor) -> None:
        """Give back rows ``consumer`` took but could not process: they are delivered to it again.

        Raises ``ValueError`` (changing nothing) unless every row is currently taken by
        ``consumer`` in this iteration. Wakes waiting gets.
        """
        cond = self._check_consumer(consumer)
        self._check_in_range("indexes", indexes)
        rows = indexes.numpy()
        with cond:
            held = self._consumed[consumer][rows]
            if not held.all():
                bad = rows[~held][:5].tolist()
                raise ValueError(f"indexes: got row(s) {bad} not taken by {consumer!r}, expected rows it holds")
            self._consumed[consumer][rows] = False
            np.add.at(self._group_taken[consumer], rows // self.n_samples, -1)
        self._bump()

    def all_consumed(self, consumer: str) -> bool:
        """Whether ``consumer`` has taken every row of the table."""
        self._check_consumer(consumer)
        return bool(self._consumed[consumer].all())

    # ------------------------------------------------------------------ iteration

    def try_begin_reset(self, keep: Sequence[str], token: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Close the gate for reset ``token`` and, once no get or put is in flight, reset the metadata.

        Returns ``(cleared rows, kept incomplete rows)`` for the warehouses, or None
        while another reset runs or calls are in flight. The gate stays closed (new
        gets and puts wait) until :meth:`end_reset` with the same token.
        """
        self._check_keep(keep)
        with self._gate:
            if self._resetting is None:
                self._resetting = token
            if self._resetting != token or self._leases:
                return None
        return self._reset_metadata(list(keep))

    def end_reset(self, token: str) -> None:
        """Reopen the gate closed by reset ``token`` (after the warehouses were cleared, or to give up)."""
        with self._gate:
            if self._resetting == token:
                self._resetting = None
        self._bump()

    def in_flight(self) -> int:
        """Gets and puts in flight (holding a lease)."""
        return self._leases

    def _check_keep(self, keep: Sequence[str]) -> None:
        if isinstance(keep, str) or not isinstance(keep, Sequence):
            raise ValueError(f"keep: got {keep!r}, expected a list of column names")
        unknown = [c for c in keep if not isinstance(c, str) or c not in self._ready]
        if unknown:
            raise ValueError(f"keep: got undeclared column(s) {unknown}, expected some of {self.columns()}")

    def reset(self, keep: Sequence[str] = (), *, timeout: float | None = 60.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Start the next iteration; returns ``(cleared rows, kept incomplete rows)`` for the warehouses.

        Completed rows are cleared. Incomplete rows (partial rollouts) keep the
        columns in ``keep`` ready, age by one and are offered first next time. Every
        consumer starts afresh and every completed flag returns to True: a producer
        flags a row incomplete again if it still has not finished.

        Safe while other threads get and put: it waits for calls in flight (gets that
        hold rows whose payloads are not read yet, puts not yet committed), makes new
        ones wait meanwhile, and raises ``RuntimeError`` -- changing nothing -- if they
        have not finished within ``timeout`` seconds (None: wait as long as needed).
        """
        self._check_keep(keep)
        _check_timeout("timeout", timeout)
        token = uuid.uuid4().hex
        out = self.wait("try_begin_reset", timeout, list(keep), token)
        busy = self.in_flight()
        self.end_reset(token)
        if out is None:
            raise RuntimeError(
                f"reset: {busy} get/put call(s) still in progress after {timeout} s (or another reset); "
                "nothing was reset -- retry, or pass a longer timeout"
            )
        return out

    def _reset_metadata(self, keep: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        conds = [self._conds[c] for c in sorted(self._conds)]
        with self._put_lock:
            for cond in conds:
                cond.acquire()
            try:
                incomplete = ~self.completed
                for column, ready in self._ready.items():
                    kept = incomplete if column in keep else np.zeros_like(incomplete)
                    ready &= kept
                    self._lengths[column] *= kept
                    self._stamp[column] *= kept
                for column, ready in self._ready.items():
                    self._group_ready[column] = ready.reshape(self.num_prompts, self.n_samples).sum(1, dtype=np.int32)
                for consumer, consumed in self._consumed.items():
                    consumed.fill(False)
                    self._group_taken[consumer].fill(0)
                self.age = np.where(incomplete, self.age + 1, 0)
                self._group_age = self.age.reshape(self.num_prompts, self.n_samples).max(1)
                self.completed = np.ones_like(self.completed)
                cleared = torch.from_numpy(np.flatnonzero(~incomplete))
                kept_rows = torch.from_numpy(np.flatnonzero(incomplete))
            finally:
                for cond in reversed(conds):
                    cond.release()
        return cleared, kept_rows

    def free_rows(self) -> torch.Tensor:
        """Rows holding no ready column: where new prompts go after a reset."""
        with self._put_lock:
            if not self._ready:
                return torch.arange(self.capacity)
            used = np.stack(list(self._ready.values())).any(0)
        return torch.from_numpy(np.flatnonzero(~used))

    def state(self) -> dict[str, Any]:
        """A copy of all metadata: per-column ready / stamp / lengths, per-consumer consumed, ages, flags."""
        with self._put_lock, self._registry_lock:
            return {
                "ready": {c: _copy(a) for c, a in self._ready.items()},
                "stamp": {c: _copy(a) for c, a in self._stamp.items()},
                "lengths": {c: _copy(a) for c, a in self._lengths.items()},
                "specs": dict(self._specs),
                "consumed": {c: _copy(a) for c, a in self._consumed.items()},
                "age": _copy(self.age),
                "completed": _copy(self.completed),
            }

    def ages(self) -> torch.Tensor:
        """Per-row age: iterations a partial rollout has survived."""
        return _copy(self.age)

    def completed_flags(self) -> torch.Tensor:
        """Per-row completed flags (True unless a producer flagged the row incomplete)."""
        return _copy(self.completed)


class Warehouse:
    """Payload store for rows ``[start, stop)``: per column, per-row (unpadded) tensors and dense blocks.

    A column put as one tensor is kept whole (a block) and its rows refer to it: a get
    of those rows in the block's order is one copy of a slice, not a split and a
    concatenation of its rows.

    >>> house = Warehouse(4, 8)
    >>> house.put({"responses": [torch.tensor([1, 2]), torch.tensor([3])]}, torch.tensor([5, 4]))
    >>> house.get(["responses"], torch.tensor([4, 5]))
    {'responses': (tensor([3, 1, 2]), [1, 2])}
    >>> house.put({"scores": torch.tensor([0.5, 1.0])}, torch.tensor([4, 5]))
    >>> house.get(["scores"], torch.tensor([4, 5]))
    {'scores': (tensor([0.5000, 1.0000]), None)}
    """

    def __init__(self, start: int, stop: int) -> None:
        self.start = start
        self.stop = stop
        self._data: dict[str, list[torch.Tensor | None]] = {}  # per-row tensors (rows not in a block)
        self._block: dict[str, np.ndarray] = {}  # per row: its block, or -1
        self._row: dict[str, np.ndarray] = {}  # per row: its row in the block
        self._blocks: dict[str, list[torch.Tensor]] = {}
        # Per column: the blocks put at a run of local rows, ``(first, stop, block)``: a get of a run inside one
        # is a slice, found without reading ``_block`` / ``_row``.
        self._spans: dict[str, list[tuple[int, int, int]]] = {}
        self._lock = threading.Lock()

    def _column(self, column: str) -> list[torch.Tensor | None]:
        if column not in self._data:
            size = self.stop - self.start
            self._data[column], self._blocks[column], self._spans[column] = [None] * size, [], []
            self._block[column] = np.full(size, -1, dtype=np.int64)
            self._row[column] = np.zeros(size, dtype=np.int64)
        return self._data[column]

    def put(self, columns: Mapping[str, torch.Tensor | list[torch.Tensor]], indexes: torch.Tensor | range) -> None:
        """Store the rows of each column (a tensor, rows along dim 0, or a list of rows) at ``indexes`` (global rows)."""
        run = indexes if isinstance(indexes, range) else _run(indexes)
        local: np.ndarray | slice
        if isinstance(run, range):
            first, stop = run.start - self.start, run.stop - self.start
            local = slice(first, stop)
        else:
            local = run.numpy() - self.start
            first, stop = (int(local.min()), int(local.max()) + 1) if local.size else (0, 0)
        with self._lock:
            for column, rows in columns.items():
                data = self._column(column)
                # A span the put overwrites rows of no longer holds them all.
                spans = self._spans[column] = [sp for sp in self._spans[column] if sp[1] <= first or sp[0] >= stop]
                if isinstance(rows, torch.Tensor):
                    blocks = self._blocks[column]
                    self._block[column][local] = len(blocks)
                    self._row[column][local] = np.arange(len(rows))
                    if isinstance(run, range):
                        spans.append((first, stop, len(blocks)))
                    blocks.append(rows)
                else:
                    self._block[column][local] = -1
                    for i, row in zip(range(first, stop) if isinstance(local, slice) else local.tolist(), rows):
                        data[i] = row

    def put_flat(
        self, columns: Mapping[str, tuple[torch.Tensor, list[int] | None]], indexes: torch.Tensor | range
    ) -> None:
        """:meth:`put` for rows sent as one ``(flat, lengths)`` pair per column (see :func:`flatten_rows`)."""
        self.put({c: unflatten_rows(flat, lengths) for c, (flat, lengths) in columns.items()}, indexes)

    def get(
        self, columns: Sequence[str], indexes: torch.Tensor | range
    ) -> dict[str, tuple[torch.Tensor, int | list[int] | None]]:
        """The stored rows of ``columns`` at ``indexes``, in that order, as fresh tensors: per column ``(rows, lengths)``.

        Rows read from one block come as they are, ``[m, width, ...]`` with ``lengths`` the
        width (``[m]`` with None for per-row scalars); other rows come flattened by
        :func:`flatten_rows`. :func:`_flat_rows` gives either as flat rows.
        """
        m = len(indexes)
        first = indexes.start - self.start if isinstance(indexes, range) else None
        local = None if isinstance(indexes, range) else indexes.numpy() - self.start
        out: dict[str, tuple[torch.Tensor, int | list[int] | None]] = {}
        with self._lock:
            for c in columns:
                if first is not None and m:
                    span = next((sp for sp in self._spans[c] if sp[0] <= first and first + m <= sp[1]), None)
                    if span is not None:  # a run inside one block's run: one copy of its slice
                        k = first - span[0]
                        out[c] = _block_rows(self._blocks[c][span[2]], k, m)
                        continue
                if local is None:
                    local = _array(indexes) - self.start
                block, row, blocks = self._block[c][local], self._row[c][local], self._blocks[c]
                if m:
                    b, k = int(block[0]), int(row[0])
                    if b >= 0 and (block == b).all() and (row == np.arange(k, k + m)).all():
                        # A run of consecutive rows of one block: one copy of its slice.
                        out[c] = _block_rows(blocks[b], k, m)
                        continue
                data = self._data[c]
                rows = [
                    data[i] if b < 0 else blocks[b][k] for i, b, k in zip(local.tolist(), block.tolist(), row.tolist())
                ]
                out[c] = flatten_rows(rows)  # type: ignore[arg-type]
        return out

    def clear(self, cleared: torch.Tensor, kept: torch.Tensor, keep: Sequence[str]) -> None:
        """Drop every column of ``cleared`` rows and all but ``keep`` of ``kept`` rows."""

        def inside(rows: torch.Tensor) -> list[int]:
            a = rows.numpy()
            return (a[(a >= self.start) & (a < self.stop)] - self.start).tolist()

        gone, partial = inside(cleared), inside(kept)
        with self._lock:
            for column, data in self._data.items():
                block, row, blocks = self._block[column], self._row[column], self._blocks[column]
                for i in partial if column in keep else ():  # kept rows stand alone: the blocks go
                    if int(block[i]) >= 0:
                        data[i] = blocks[int(block[i])][int(row[i])]
                for i in gone if column in keep else gone + partial:
                    data[i] = None
                block.fill(-1)
                blocks.clear()
                self._spans[column].clear()


def _block_rows(block: torch.Tensor, k: int, m: int) -> tuple[torch.Tensor, int | None]:
    """Rows ``k .. k + m - 1`` of a block, copied: ``(rows, width)``, or ``(rows, None)`` for per-row scalars."""
    rows = (block if k == 0 and m == block.shape[0] else block[k : k + m]).clone()
    return rows, (block.shape[1] if block.dim() > 1 else None)


def _flat_rows(part: tuple[torch.Tensor, int | list[int] | None]) -> tuple[torch.Tensor, list[int] | None]:
    """A warehouse's ``(rows, lengths)`` for one column as :func:`flatten_rows` gives them (a block's rows flattened)."""
    rows, lengths = part
    if isinstance(lengths, int):
        return flatten_rows(rows)
    return rows, lengths


def flatten_rows(rows: list[torch.Tensor] | torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
    """Rows as one tensor: 0-d rows stacked (lengths None), others concatenated along dim 0 with their lengths.

    A tensor is taken as its rows along dim 0 (a view where it can be). One tensor per
    column crosses a process boundary far faster than one per row.
    """
    if isinstance(rows, torch.Tensor):
        if rows.dim() == 1:
            return rows, None
        return rows.reshape(-1, *rows.shape[2:]), [rows.shape[1]] * rows.shape[0]
    if rows[0].dim() == 0:
        return torch.stack(rows), None
    return torch.cat(rows), [row.shape[0] for row in rows]


def unflatten_rows(flat: torch.Tensor, lengths: list[int] | None) -> list[torch.Tensor]:
    """Inverse of :func:`flatten_rows`."""
    return list(flat.unbind(0) if lengths is None else flat.split(lengths))


def _check_free(columns: Sequence[str], column: str, key: str) -> None:
    if key in columns:
        raise ValueError(f"columns: got both {column!r} and {key!r}, expected {key!r} free for the batch layout")


def _rows_in_order(
    size: int, parts: Sequence[tuple[list[int], tuple[torch.Tensor, list[int] | None]]]
) -> list[torch.Tensor]:
    rows: list[Any] = [None] * size
    for positions, (flat, lengths) in parts:
        assert lengths is not None, "per-row scalars are collated before"
        for pos, row in zip(positions, flat.split(lengths)):
            rows[pos] = row
    return rows


def _collate(
    columns: Sequence[str],
    size: int,
    pieces: Sequence[tuple[list[int], Mapping[str, tuple[torch.Tensor, int | list[int] | None]]]],
    *,
    pad_value: float = 0,
    packed: bool = False,
) -> dict[str, Any]:
    """A batch of ``size`` rows from flattened pieces (batch positions, column -> flat rows).

    Per-row scalars give ``[B]``. Other columns, padded: ``[B, T, ...]`` right-padded
    with ``pad_value`` plus a bool ``<column>_mask`` ``[B, T]``; packed: a
    :class:`~rlcore.dataflow.Packed` for 1-D integer rows (token ids), else the rows
    concatenated ``[N, ...]`` plus ``<column>_cu_seqlens`` int32 ``[B + 1]``.
    """
    batch: dict[str, Any] = {}
    # One piece holding the rows in batch order (one warehouse): its tensors are the batch's, fresh copies.
    in_order = len(pieces) == 1 and pieces[0][0] == list(range(size))
    for column in columns:
        first, lengths = pieces[0][1][column]
        if lengths is None:
            if in_order:
                batch[column] = first
                continue
            out = first.new_empty((size, *first.shape[1:]))
            for positions, part in pieces:
                out[positions] = part[column][0]
            batch[column] = out
            continue
        mask_key = f"{column}_mask"
        if in_order and isinstance(lengths, int) and not packed:  # one block's rows in batch order: as they are
            _check_free(columns, column, mask_key)
            batch[column] = first
            batch[mask_key] = torch.ones(size, lengths, dtype=torch.bool)
            continue
        parts = [(positions, _flat_rows(part[column])) for positions, part in pieces]
        first, lengths = parts[0][1]
        assert lengths is not None, "per-row scalars are collated above"
        if packed:
            rows = _rows_in_order(size, parts)
            if first.dim() == 1 and not (
                first.dtype.is_floating_point or first.dtype.is_complex or first.dtype == torch.bool
            ):
                batch[column] = pack(rows)
                continue
            _check_free(columns, column, f"{column}_cu_seqlens")
            cu = torch.zeros(size + 1, dtype=torch.int32)
            cu[1:] = torch.tensor([row.shape[0] for row in rows]).cumsum(0)
            batch[column] = torch.cat(rows)
            batch[f"{column}_cu_seqlens"] = cu
            continue
        _check_free(columns, column, mask_key)
        if in_order and size and lengths.count(lengths[0]) == size:  # every row full width: a view, no scatter
            batch[column] = first.view(size, lengths[0], *first.shape[1:])
            batch[mask_key] = torch.ones(size, lengths[0], dtype=torch.bool)
            continue
        if in_order:
            all_lengths = torch.tensor(lengths, dtype=torch.int64)
        else:
            all_lengths = torch.zeros(size, dtype=torch.int64)
            for positions, (_, part_lengths) in parts:
                all_lengths[positions] = torch.tensor(part_lengths, dtype=torch.int64)
        width = int(all_lengths.max()) if size else 0
        mask = torch.arange(width) < all_lengths[:, None]
        out = first.new_full((size, width, *first.shape[1:]), pad_value)
        if in_order:
            out[mask] = first
        else:
            for positions, (flat, _) in parts:
                sub = first.new_full((len(positions), width, *first.shape[1:]), pad_value)
                sub[mask[positions]] = flat
                out[positions] = sub
        batch[column] = out
        batch[mask_key] = mask
    return batch


class TransferDock:
    """The embedded Transfer Dock: controller and warehouses in this process, shared by threads.

    MindSpeed-RL's Transfer Dock (arXiv:2507.19017): stages put the columns they
    produce and get ready rows, instead of a trainer gathering and scattering batches.

    Args:
      num_prompts: groups in the table (prompts per iteration).
      n_samples: rows per group (responses per prompt); the rows of prompt ``p`` are
        ``p * n_samples ... p * n_samples + n_samples - 1``.
      columns: column names declared up front (others are added by their first put).
      consumers: the consumer names that will call :meth:`get`.
      num_warehouses: disjoint row ranges the payloads are split over.
      pad_value: fill value of padded batches.
      seed: seeds ``balance="random"``.

    The dock keeps references to the tensors it is given: do not modify them in place
    after a put.

    >>> dock = TransferDock(2, 2, columns=["answers"], consumers=["reward"])
    >>> dock.put({"answers": [torch.tensor([1, 2]), torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([3])]}, [0, 1, 2, 3])
    >>> batch, idx = dock.get("reward", ["answers"], 4, balance="fifo")
    >>> idx.tolist(), batch["answers"].tolist(), batch["answers_mask"].tolist()
    ([0, 1, 2, 3], [[1, 2], [1, 2], [3, 0], [3, 0]], [[True, True], [True, True], [True, False], [True, False]])
    """

    def __init__(
        self,
        num_prompts: int,
        n_samples: int = 1,
        *,
        columns: Iterable[str] = (),
        consumers: Iterable[str] = (),
        num_warehouses: int = 1,
        pad_value: float = 0,
        seed: int = 0,
    ) -> None:
        controller = DockController(
            num_prompts, n_samples, columns=columns, consumers=consumers, num_warehouses=num_warehouses, seed=seed
        )
        bounds = controller.bounds.tolist()
        # Handles that _call reaches: the parts themselves here, (actor, key) pairs on Ray.
        self.controller: Any = controller
        self.warehouses: list[Any] = [Warehouse(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        self.pad_value = pad_value
        self._layout()

    # Backends override these two: how a call reaches the controller or the warehouses.
    def _call(self, target: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(target, method)(*args, **kwargs)

    def _call_all(self, calls: list[tuple[Any, str, tuple[Any, ...]]]) -> list[Any]:
        return [getattr(target, method)(*args) for target, method, args in calls]

    def _wait_call(self, target: Any, method: str, timeout: float | None, *args: Any, **kwargs: Any) -> Any:
        # Retry try_* method ``method`` until it returns a value (None after ``timeout``).
        return self._call(target, "wait", method, timeout, *args, **kwargs)

    def _release(self) -> None:
        # A get has read its rows' payloads: end its lease.
        self._call(self.controller, "release")

    def _put_call(
        self, w: int, rows: dict[str, torch.Tensor | list[torch.Tensor]], indexes: torch.Tensor | range
    ) -> tuple[Any, str, tuple[Any, ...]]:
        # In process, the warehouse keeps the caller's row tensors as they are.
        return self.warehouses[w], "put", (rows, indexes)

    def _layout(self) -> None:
        # The controller says once which warehouse holds which rows; clients route by it.
        layout = self._call(self.controller, "layout")
        self.capacity: int = layout["capacity"]
        self.n_samples: int = layout["n_samples"]
        self._bounds: torch.Tensor = layout["bounds"]

    def _by_warehouse(self, rows: torch.Tensor) -> list[tuple[int, list[int]]]:
        """``(warehouse, positions in rows)`` for every warehouse holding some of ``rows``."""
        if len(self.warehouses) == 1:
            return [(0, list(range(rows.numel())))]
        where = torch.bucketize(rows, self._bounds[1:], right=True)
        order = torch.argsort(where, stable=True)
        counts = torch.bincount(where, minlength=len(self.warehouses)).tolist()
        pieces = order.split(counts)
        return [(w, piece.tolist()) for w, piece in enumerate(pieces) if counts[w]]

    def add_consumer(self, name: str) -> None:
        """Register another consumer."""
        self._call(self.controller, "add_consumer", name)

    def put(self, columns: Mapping[str, torch.Tensor | list[torch.Tensor]], indexes: Any) -> None:
        """Store per-row, unpadded values of ``columns`` at rows ``indexes`` and mark those cells ready.

        Args:
          columns: name -> a tensor ``[n, ...]`` (one row per index along dim 0) or a
            list of ``n`` tensors of varying first dimension (e.g. token ids).
          indexes: ``n`` distinct row numbers in ``[0, capacity)``.

        Each cell (row, column) is put once per iteration: putting a column to a row that
        already holds it (or that another put is writing) raises; :meth:`reset` frees
        the cells. A put waits while a :meth:`reset` is in progress.

        Raises ``ValueError`` (and changes nothing) for an index out of range, a column
        whose row count differs from ``len(indexes)``, rows whose dtype / trailing
        shape differ from earlier puts of that column, or a cell already put.
        """
        run = _as_run("indexes", indexes)
        if not isinstance(columns, Mapping) or not columns:
            raise ValueError(f"columns: got {type(columns).__name__}, expected a non-empty dict of column -> rows")
        rows = {c: _rows(c, v) for c, v in columns.items()}
        for column, values in rows.items():
            if len(values) != len(run):
                raise ValueError(f"columns[{column!r}]: got {len(values)} rows, expected {len(run)} (one per index)")
        if len(run) == 0:
            return
        # A column given as one tensor has one spec and one length for all its rows: no per-row pass.
        specs = {c: _tensor_spec(v) if isinstance(v, torch.Tensor) else _row_spec(c, v) for c, v in rows.items()}
        self._wait_call(self.controller, "try_begin_put", None, specs, run)
        try:
            routes = [(0, [])] if len(self.warehouses) == 1 else self._by_warehouse(_tensor(run))
            if len(routes) == 1:  # one warehouse holds every row: the rows go in the caller's order
                calls = [self._put_call(routes[0][0], rows, run)]
            else:
                idx = _tensor(run)
                calls = [
                    self._put_call(
                        w,
                        {c: v[sel] if isinstance(v, torch.Tensor) else [v[i] for i in sel] for c, v in rows.items()},
                        idx[sel],
                    )
                    for w, sel in routes
                ]
            self._call_all(calls)
        except BaseException:
            self._call(self.controller, "abort_put", list(rows), run)
            raise
        lengths = {c: _tensor_lengths(v) if isinstance(v, torch.Tensor) else _row_lengths(v) for c, v in rows.items()}
        self._call(self.controller, "commit_put", lengths, run)

    def get(
        self,
        consumer: str,
        columns: Sequence[str],
        count: int | None = None,
        *,
        by_group: bool = True,
        balance: str = "random",
        indexes: Any = None,
        timeout: float | None = None,
        packed: bool = False,
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """Take ``count`` rows this consumer has not taken whose ``columns`` are all ready.

        Args:
          consumer: a registered consumer name; each row goes to it at most once.
          columns: the column names to return.
          count: rows to take; a multiple of ``n_samples`` when ``by_group``.
          by_group: take whole groups only (all rows of a group ready and untaken).
          balance: which eligible rows go first, after the oldest (partial-rollout) groups:
            ``"random"`` uniformly, ``"fifo"`` in the order they became ready (ties by
            row), ``"tokens"`` alternating longest and shortest so successive gets carry
            similar token totals.
          indexes: take exactly these rows, waiting until they are ready (``count``
            may then be None).
          timeout: seconds to wait for enough ready rows. None without ``indexes``
            returns at once; None with ``indexes`` waits as long as needed.
          packed: return variable-length columns packed instead of padded.

        Returns:
          ``(batch, indexes)``; ``indexes`` ``[B]`` int64 are the rows taken, in batch
          order. ``batch[column]`` is ``[B]`` for per-row scalars. Variable-length
          columns are, padded, ``[B, T, ...]`` right-padded with ``pad_value`` plus a bool
          ``batch[column + "_mask"]`` ``[B, T]``; packed, a :class:`~rlcore.dataflow.Packed`
          (:func:`rlcore.dataflow.pack`) for 1-D integer rows (token ids), otherwise the
          rows concatenated ``[N, ...]`` plus ``batch[column + "_cu_seqlens"]`` int32
          ``[B + 1]``. When not enough rows are ready in time, ``({}, empty indexes)``
          and nothing is marked taken.

        A column declared up front (``columns=``) but not put yet is simply not ready: a
        get of it waits like any other (an undeclared name raises, to catch typos). A
        get that has taken rows finishes reading them even if :meth:`reset` is called
        meanwhile (the reset waits for it). A consumer that takes rows and then cannot
        process them gives them back with :meth:`nack`.
        """
        run = None if indexes is None else _as_run("indexes", indexes)
        if isinstance(columns, str) or not isinstance(columns, Sequence):
            raise ValueError(f"columns: got {columns!r}, expected a list of column names")
        columns = list(columns)
        _check_timeout("timeout", timeout)
        # No timeout: a get of explicit indexes waits as long as needed, one of a count returns at once.
        wait = timeout if timeout is not None else None if run is not None else 0.0
        options = dict(by_group=by_group, balance=balance, indexes=run)
        rows = self._wait_call(self.controller, "try_sample", wait, consumer, columns, count, **options)
        if rows is None or rows.numel() == 0:
            return {}, torch.empty(0, dtype=torch.int64)
        try:
            return self._fetch(columns, run if isinstance(run, range) else rows, packed), rows
        finally:
            self._release()

    def _fetch(self, columns: Sequence[str], rows: torch.Tensor | range, packed: bool) -> dict[str, Any]:
        if len(self.warehouses) == 1:  # the rows as they are: a run stays a run
            parts = self._call_all([(self.warehouses[0], "get", (list(columns), rows))])
            return _collate(
                columns, len(rows), [(list(range(len(rows))), parts[0])], pad_value=self.pad_value, packed=packed
            )
        rows = _tensor(rows)
        routes = self._by_warehouse(rows)
        parts = self._call_all([(self.warehouses[w], "get", (list(columns), rows[sel])) for w, sel in routes])
        pieces = [(sel, part) for (_, sel), part in zip(routes, parts)]
        return _collate(columns, rows.numel(), pieces, pad_value=self.pad_value, packed=packed)

    def set_completed(self, indexes: Any, completed: torch.Tensor) -> None:
        """Flag rows as finished (True) or as partial rollouts to resume next iteration (False)."""
        self._call(self.controller, "set_completed", _as_indexes("indexes", indexes), completed)

    def all_consumed(self, consumer: str) -> bool:
        """Whether ``consumer`` has taken every row."""
        return self._call(self.controller, "all_consumed", consumer)

    def nack(self, consumer: str, indexes: Any) -> None:
        """Give back rows ``consumer`` took but could not process, so that they are delivered to it again.

        Args:
          consumer: the consumer that took the rows.
          indexes: rows it took in this iteration (a subset of what its gets returned).

        Raises ``ValueError`` (changing nothing) for rows the consumer does not hold
        (never taken, given back already, or taken before the last :meth:`reset`).
        Waiting gets of the consumer wake up and may take the rows at once.
        """
        self._call(self.controller, "nack", consumer, _as_indexes("indexes", indexes))

    def reset(self, *, keep: Sequence[str] = (), timeout: float | None = 60.0) -> None:
        """Start the next iteration: clear completed rows; incomplete rows keep ``keep`` and age by one.

        Safe while other threads or processes get and put: gets that have taken rows
        finish reading them and puts in flight finish first, new gets and puts wait until
        the reset is done. Raises ``RuntimeError`` and changes nothing if the calls in
        flight have not finished within ``timeout`` seconds (None: no limit).
        """
        if isinstance(keep, str) or not isinstance(keep, Sequence):
            raise ValueError(f"keep: got {keep!r}, expected a list of column names")
        _check_timeout("timeout", timeout)
        token = uuid.uuid4().hex
        keep = list(keep)
        out = self._wait_call(self.controller, "try_begin_reset", timeout, keep, token)
        if out is None:
            busy = self._call(self.controller, "in_flight")
            self._call(self.controller, "end_reset", token)
            raise RuntimeError(
                f"reset: {busy} get/put call(s) still in progress after {timeout} s (or another reset); "
                "nothing was reset -- retry, or pass a longer timeout"
            )
        try:
            cleared, kept = out
            self._call_all([(house, "clear", (cleared, kept, keep)) for house in self.warehouses])
        finally:
            self._call(self.controller, "end_reset", token)

    def free_rows(self) -> torch.Tensor:
        """Rows holding no ready column (where a new iteration's prompts go)."""
        return self._call(self.controller, "free_rows")

    def state(self) -> dict[str, Any]:
        """A copy of the controller's metadata (bitmaps, ages, flags), for monitoring and tests."""
        return self._call(self.controller, "state")

    @property
    def age(self) -> torch.Tensor:
        """Per-row age ``[capacity]``: iterations a partial rollout has been carried over."""
        return self._call(self.controller, "ages")

    @property
    def completed(self) -> torch.Tensor:
        """Per-row completed flags ``[capacity]``."""
        return self._call(self.controller, "completed_flags")
