"""The Transfer Dock on Ray: the controller and each warehouse are actors, spread over nodes.

Same API and semantics as :class:`rlcore.dataflow.TransferDock` (MindSpeed-RL,
arXiv:2507.19017). The client asks the controller actor for metadata only (where rows
live, which rows to take) and moves payloads to and from the warehouse actors itself,
so tensors never pass through the controller. Needs the ``ray`` extra
(``pip install rlcore[ray]``); Ray is imported when a dock is made, not with this module.

The host actors are asyncio actors: a client that waits (a get of rows not ready
yet, a put or get held back by a reset) is a suspended coroutine, not a blocked
thread, so any number of waiting clients leaves the host free to serve the writers
they wait for. Controller calls never block and run on the event loop; warehouse
calls (payload copies) run in worker threads.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlcore.dataflow.dock import DockController, TransferDock, Warehouse, flatten_rows

__all__ = ["DockHost", "RayTransferDock"]

# Calls in progress at once on one host, waiting ones included. A waiting call is a
# coroutine of a few kilobytes, so the bound is set far above any real number of clients.
_HOST_CONCURRENCY = 100_000

# The longest single asyncio sleep (a deadline may be inf).
_MAX_SLEEP = 3600.0

_PARTS = {"controller": DockController, "warehouse": Warehouse}


def _ray() -> Any:
    try:
        import ray
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("RayTransferDock needs Ray: pip install 'rlcore[ray]'") from err
    return ray


class DockHost:
    """The body of a Ray actor that hosts dock parts (controllers, warehouses) by key.

    A dock normally starts its own hosts; several docks may share hosts started once
    (``RayTransferDock.start_hosts``), since an actor process takes seconds to start.
    Methods are coroutines (an asyncio actor): :meth:`call_wait` waits for a change of
    state without holding a thread.
    """

    def __init__(self) -> None:
        self._parts: dict[str, Any] = {}
        self._version = 0
        self._changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        # Made on first use, inside the actor's event loop.
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def create(self, key: str, kind: str, *args: Any, **kwargs: Any) -> None:
        self._parts[key] = _PARTS[kind](*args, **kwargs)

    def _part(self, key: str) -> Any:
        part = self._parts.get(key)
        if part is None:
            raise RuntimeError(f"dock: part {key!r} is not on this host: the dock was closed (RayTransferDock.close)")
        return part

    async def call(self, key: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` of part ``key`` (a warehouse's in a worker thread), then wake waiting calls."""
        part = self._part(key)
        try:
            if isinstance(part, Warehouse):
                return await asyncio.to_thread(getattr(part, method), *args, **kwargs)
            return getattr(part, method)(*args, **kwargs)
        finally:
            await self._notify()

    async def _notify(self) -> None:
        cond = self._condition()
        async with cond:
            self._version += 1
            cond.notify_all()

    async def call_wait(self, key: str, method: str, timeout: float | None, *args: Any, **kwargs: Any) -> Any:
        """Retry ``try_*`` method ``method`` of part ``key`` after each change until it returns a value.

        Returns None when ``timeout`` seconds (None: no limit) pass first. The
        asyncio counterpart of :meth:`rlcore.dataflow.DockController.wait`.
        """
        part = self._part(key)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        cond = self._condition()
        while True:
            seen = self._version
            self._part(key)  # closed while waiting: raise rather than wait for ever
            out = getattr(part, method)(*args, **kwargs)
            if out is not None:
                await self._notify()
                return out
            async with cond:
                while self._version == seen:
                    left = None if deadline is None else deadline - loop.time()
                    if left is not None and left <= 0:
                        return None
                    try:
                        await asyncio.wait_for(cond.wait(), None if left is None else min(left, _MAX_SLEEP))
                    except TimeoutError:
                        continue  # the loop re-reads the deadline

    async def drop(self, key: str) -> None:
        self._parts.pop(key, None)
        await self._notify()  # calls waiting on the part find it gone


class RayTransferDock(TransferDock):
    """A :class:`~rlcore.dataflow.TransferDock` whose controller and warehouses live in Ray actors.

    Args: as :class:`~rlcore.dataflow.TransferDock`, plus ``hosts``: actors from
    :meth:`start_hosts` to place the controller (first host) and the warehouses (round
    robin over the others) in; by default the dock starts ``1 + num_warehouses`` hosts
    of its own, spread over the nodes (Ray's ``"SPREAD"`` strategy). Ray must be
    initialised (``ray.init``) first. The client object is picklable, so Ray tasks and
    actors of other stages can take it as an argument and put / get directly. Any
    number of clients may wait at once (gets of rows not ready yet): they wait as
    coroutines in the host, never holding the threads that puts need.

    >>> import ray
    >>> _ = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    >>> dock = RayTransferDock(4, 2, consumers=["reward"], num_warehouses=2)
    >>> dock.put({"responses": [torch.arange(3)] * 8}, range(8))
    >>> dock.get("reward", ["responses"], 4)[1].numel()
    4
    >>> ray.shutdown()
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
        hosts: Sequence[Any] | None = None,
    ) -> None:
        # Validate here first, so bad arguments raise in this process and not in an actor.
        columns, consumers = list(columns), list(consumers)
        local = DockController(
            num_prompts, n_samples, columns=columns, consumers=consumers, num_warehouses=num_warehouses, seed=seed
        )
        if hosts is not None and (
            isinstance(hosts, str)
            or not isinstance(hosts, Sequence)
            or not hosts
            or not all(callable(getattr(getattr(h, "create", None), "remote", None)) for h in hosts)
        ):
            raise ValueError(f"hosts: got {hosts!r}, expected a non-empty list of actors from start_hosts")
        self._owns_hosts = hosts is None
        self.hosts = list(self.start_hosts(1 + num_warehouses) if hosts is None else hosts)
        key = uuid.uuid4().hex
        self.controller = (self.hosts[0], f"{key}/controller")
        others = self.hosts[1:] or self.hosts
        bounds = local.bounds.tolist()
        self.warehouses = [(others[w % len(others)], f"{key}/warehouse{w}") for w in range(num_warehouses)]
        created = [
            self.controller[0].create.remote(
                self.controller[1],
                "controller",
                num_prompts,
                n_samples,
                columns=columns,
                consumers=consumers,
                num_warehouses=num_warehouses,
                seed=seed,
            )
        ]
        for (host, name), a, b in zip(self.warehouses, bounds[:-1], bounds[1:]):
            created.append(host.create.remote(name, "warehouse", a, b))
        self._wait(created)
        self.pad_value = pad_value
        self._layout()

    @staticmethod
    def start_hosts(count: int, *, spread: bool = True) -> list[Any]:
        """Start ``count`` host actors, spread over the nodes unless ``spread=False``."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count: got {count!r}, expected a positive int")
        ray = _ray()
        host = ray.remote(DockHost).options(
            num_cpus=0, max_concurrency=_HOST_CONCURRENCY, scheduling_strategy="SPREAD" if spread else "DEFAULT"
        )
        return [host.remote() for _ in range(count)]

    def _put_call(
        self, w: int, rows: dict[str, torch.Tensor | list[torch.Tensor]], indexes: torch.Tensor | range
    ) -> tuple[Any, str, tuple[Any, ...]]:
        # Across processes, send one flat tensor per column rather than one per row.
        return self.warehouses[w], "put_flat", ({c: flatten_rows(v) for c, v in rows.items()}, indexes)

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError("dock: this RayTransferDock was closed (RayTransferDock.close); make a new one")

    def _call(self, target: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        host, key = target
        return self._wait(host.call.remote(key, method, *args, **kwargs))

    def _call_all(self, calls: list[tuple[Any, str, tuple[Any, ...]]]) -> list[Any]:
        self._check_open()
        return self._wait([host.call.remote(key, method, *args) for (host, key), method, args in calls])

    def _wait_call(self, target: Any, method: str, timeout: float | None, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        host, key = target
        return self._wait(host.call_wait.remote(key, method, timeout, *args, **kwargs))

    def _release(self) -> None:
        # Nothing to wait for: the host ends the lease whenever the message arrives.
        host, key = self.controller
        host.call.remote(key, "release")

    @staticmethod
    def _wait(refs: Any) -> Any:
        ray = _ray()
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as err:
            # Re-raise the actor's own error (a ValueError for bad input) with its message.
            if isinstance(err.cause, Exception):
                raise err.cause from None
            raise

    def close(self) -> None:
        """Drop this dock's parts from their hosts, and kill the hosts it started itself; a second call does nothing.

        Any later call of this client, or of a copy of it, raises ``RuntimeError``; gets
        waiting when the dock closes raise it too.
        """
        if getattr(self, "_closed", False):
            return
        self._closed = True
        ray = _ray()
        self._wait([host.drop.remote(key) for host, key in [self.controller, *self.warehouses]])
        if self._owns_hosts:
            for host in self.hosts:
                ray.kill(host)
