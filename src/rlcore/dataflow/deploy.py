"""Deployment modes of a pipeline: co-located stages sharing devices, or rollout disaggregated in its own process.

MindSpeed-RL (Feng et al., 2025, arXiv:2507.19017) runs the same stage graph either way:

* **Co-located** (:func:`colocate`): every device stage runs on one shared device
  group. The scheduler keeps working in the group's current memory phase while it can
  and switches only when nothing of that phase is runnable (see
  :mod:`rlcore.dataflow.scheduler`); the ``switch`` hook that runs the memory plan's
  AllGather-Swap transition lives in :mod:`rlcore.memory` (``ColocatedSwitch``), which
  builds on this package, never the other way round.
* **Disaggregated** (:class:`RolloutWorker`): the rollout runs in another process, fed
  micro-batches by a proxy stage; the trainer publishes new weights after each update
  through the weight-sync path (:class:`~rlcore.dataflow.WeightSync`: the reshard
  plan's flat buckets, sent as shared-memory tensors through a queue), while the
  rollout keeps generating under the staleness bound with exactly the version the
  scheduler stamped on its rows.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as std_mp
import multiprocessing.connection
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from rlcore._lifetime import die_with_parent
from rlcore.dataflow.scheduler import HandBack, add_note
from rlcore.dataflow.stages import Stage, batch_to, stage
from rlcore.dataflow.weight_sync import WeightPacket, WeightSync, unpack_weights

__all__ = ["LatestWeights", "ProxyRollout", "RolloutWorker", "WorkerDied", "colocate", "rollout_proxy_stage"]


def colocate(stages: Iterable[Stage], *, resource: str = "device", keep: Sequence[str] = ("cpu",)) -> list[Stage]:
    """Put every stage whose resource is not in ``keep`` on the one shared ``resource``.

    Co-located deployment (MindSpeed-RL, arXiv:2507.19017): all models share the
    devices, so their calls are serialised and the memory phase switches between
    rollout and training. CPU pools listed in ``keep`` stay separate.

    >>> from rlcore.dataflow.stages import stage
    >>> a = stage(print, inputs=["prompts"], outputs=["responses"], name="rollout", resource="gen")
    >>> b = stage(print, inputs=["responses"], outputs=["scores"], name="reward", resource="cpu")
    >>> [s.resource for s in colocate([a, b])]
    ['device', 'cpu']
    """
    return [s if s.resource in keep else dataclasses.replace(s, resource=resource) for s in stages]


def _worker_main(
    factory: Callable[..., Any],
    args: tuple,
    threads: int,
    jobs: Any,
    weights: Any,
    results: Any,
    deathsig: bool = False,
    interruptible: bool = False,
) -> None:
    """The rollout process: build the generate function, then serve jobs with the requested weights version."""
    die_with_parent("rlcore-rollout-parent-watch", deathsig=deathsig)
    torch.set_num_threads(threads)
    try:
        fn = factory(*args)
        if not callable(fn):
            raise ValueError(f"factory: returned {type(fn).__name__}, expected a generate(batch, params) function")
    except BaseException as err:  # reported to the trainer, which raises it
        _send(results, "error", _picklable(err))
        return
    _send(results, "ready", None)
    current = LatestWeights(weights)
    while True:
        job = jobs.get()
        if job is None:
            return
        batch, want = job
        try:
            while current.version < want:  # weights of `want` were published before the scheduler could stamp it
                current.take(weights.get())
            out = fn(batch, current.params, current) if interruptible else fn(batch, current.params)
        except BaseException as err:
            _send(results, "error", _picklable(err))
        else:
            _send(results, "ok", out)


class LatestWeights:
    """The rollout worker's weights: the version it holds and, called, a look for newer ones without waiting.

    An interruptible worker's generate function gets it as its third argument and
    calls it at token boundaries (:func:`rlcore.train.generate`'s ``refresh``): True
    when a newer version was published since (it is then :attr:`version` / :attr:`params`).
    """

    def __init__(self, weights: Any) -> None:
        self._queue = weights
        self.version: int = -1
        self.params: dict[str, torch.Tensor] | None = None

    def take(self, packet: WeightPacket) -> None:
        self.version, self.params = packet.version, unpack_weights(packet)

    def __call__(self) -> bool:
        newer = False
        while True:
            try:
                packet = self._queue.get_nowait()
            except queue.Empty:
                return newer
            self.take(packet)
            newer = True


def _send(results: Any, status: str, value: Any) -> None:
    """Put ``(status, value)`` on ``results`` pickled here, so a value that cannot be pickled becomes an error.

    A queue pickles in its feeder thread, which prints such an error and drops the item:
    the trainer would wait for the result for ever.
    """
    try:
        payload = std_mp.reduction.ForkingPickler.dumps((status, value))
    except Exception as err:
        problem = RuntimeError(
            f"the rollout worker's {'result' if status == 'ok' else status} could not be sent to the trainer: "
            f"{type(err).__name__}: {err} (expected picklable columns, e.g. tensors)"
        )
        payload = std_mp.reduction.ForkingPickler.dumps(("error", problem))
    results.put(bytes(payload))


def _picklable(err: BaseException) -> BaseException:
    """``err`` when it pickles and is an ``Exception``, else a ``RuntimeError`` naming it.

    A worker's ``SystemExit`` or ``KeyboardInterrupt`` raised again in the trainer would
    end it silently or read as the user's Ctrl-C.
    """
    if not isinstance(err, Exception):
        return RuntimeError(f"{type(err).__name__}: {err} (raised in the rollout worker)")
    try:
        std_mp.reduction.ForkingPickler.dumps(err)
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def rollout_proxy_stage(
    call: Callable[[dict[str, torch.Tensor]], Mapping[str, Any]],
    *,
    inputs: Sequence[str],
    outputs: Sequence[str],
    name: str = "rollout",
    micro_batch: int | None = None,
    resource: str = "rollout",
    timeout: float | None = None,
) -> Stage:
    """A rollout stage (role ``"rollout"``) whose calls go to a worker elsewhere: ``call(batch) -> columns``.

    The stage of :class:`RolloutWorker` and :class:`rlcore.dataflow.RayRolloutWorker`.

    >>> s = rollout_proxy_stage(lambda b: {"responses": b["prompts"]}, inputs=["prompts"], outputs=["responses"])
    >>> s.name, s.role, s.resource
    ('rollout', 'rollout', 'rollout')
    """
    return stage(
        call,
        inputs=inputs,
        outputs=outputs,
        name=name,
        micro_batch=micro_batch,
        resource=resource,
        role="rollout",
        timeout=timeout,
    )


class ProxyRollout:
    """The base of the rollout workers (:class:`RolloutWorker`, :class:`rlcore.dataflow.RayRolloutWorker`).

    Its :meth:`stage` is the proxy stage whose calls go to ``self._call(name, batch)``,
    which a worker implements: send the batch elsewhere, return its columns.
    """

    def _call(self, name: str, batch: dict[str, torch.Tensor]) -> Mapping[str, Any]:
        raise NotImplementedError

    def stage(
        self,
        *,
        inputs: Sequence[str],
        outputs: Sequence[str],
        name: str = "rollout",
        micro_batch: int | None = None,
        resource: str = "rollout",
        timeout: float | None = None,
    ) -> Stage:
        """The proxy rollout stage (role ``"rollout"``) to put in the trainer's graph.

        The batch crosses to another process from host memory: a trainer on an
        accelerator hands its device stages their rows there (:func:`rlcore.dataflow.on_device`),
        and the worker places them for its own engine.
        """
        return rollout_proxy_stage(
            lambda batch: self._call(name, batch_to(batch, "cpu")),
            inputs=inputs,
            outputs=outputs,
            name=name,
            micro_batch=micro_batch,
            resource=resource,
            timeout=timeout,
        )


class WorkerDied(RuntimeError):
    """The rollout worker is gone (``kill -9``, an OOM kill, a segfault, a dead Ray actor): the error the run stops with.

    Its message names the stage and the cause in one line; ``cause`` is the cause alone.
    """

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause

    @classmethod
    def exited(cls, name: str, code: int | None) -> WorkerDied:
        return cls(
            f"stage {name!r}: rollout worker process exited with code {code}",
            f"the worker process exited with code {code}",
        )


class RolloutWorker(ProxyRollout):
    """A rollout in its own process, driven by a proxy :class:`~rlcore.dataflow.Stage` of the trainer's pipeline.

    Disaggregated deployment (MindSpeed-RL, arXiv:2507.19017): ``factory(*args)`` runs
    in the worker process and returns ``generate(batch, params) -> {column: rows}``.
    :meth:`stage` gives the proxy stage: its calls send the batch (with its
    ``policy_version``) to the worker and wait for the rows; the worker first applies
    every published weights version up to the stamped one, so each row is generated by
    exactly the version it records. :meth:`publish` sends the trainer's weights after
    an update without waiting for the worker (shared-memory copies through a queue).

    The worker is a daemon process: :meth:`close` (or leaving the ``with`` block) stops
    it, terminating it if it does not exit within ``join_timeout`` (and killing it if it
    still does not). It also exits by
    itself when the process that started it dies, even by ``kill -9`` (it watches its
    parent; on Linux the kernel also kills it, when it was started from the main thread).

    Args:
      factory: a picklable (module-level) function building ``generate``.
      args: its arguments.
      threads: torch intra-op threads in the worker.
      start_method: ``"spawn"`` (default, safe with threads) or ``"fork"``.
      join_timeout: seconds :meth:`close` waits before terminating the worker.
      max_restarts: how many times a dead worker process is replaced (0: its death stops
        the run). The replacement receives the weights again (the packets from the version
        of the call under way on, kept for that), and the call raises
        :class:`~rlcore.dataflow.HandBack`, so that :func:`~rlcore.dataflow.run_pipeline`
        hands its rows back to the dock (``nack``) and they are redone with exactly the
        version they record; :attr:`restarts` counts the replacements and
        :attr:`restart_causes` says why, and each one is warned about. Past the bound the
        death raises as without restarts.
      ready_timeout: seconds a replacement may take to build its generate function.
      interruptible: partial rollouts (AReaL, arXiv:2505.24298): ``generate(batch, params,
        latest)`` also gets the worker's :class:`LatestWeights`, and may take versions
        published after the one the rows are stamped with while it generates (each token
        then records its own version; the stamp stays a lower bound).
    """

    def __init__(
        self,
        factory: Callable[..., Callable[[dict[str, torch.Tensor], Any], Mapping[str, Any]]],
        *,
        args: tuple = (),
        threads: int = 1,
        start_method: str = "spawn",
        join_timeout: float = 10.0,
        max_restarts: int = 0,
        ready_timeout: float = 120.0,
        interruptible: bool = False,
    ) -> None:
        if not callable(factory):
            raise ValueError(f"factory: got {type(factory).__name__}, expected a module-level callable")
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise ValueError(f"max_restarts: got {max_restarts!r}, expected an int >= 0")
        self._ctx = mp.get_context(start_method)
        self._spec = (factory, args, threads)
        self.interruptible = interruptible
        self.join_timeout = join_timeout
        self.max_restarts, self.ready_timeout = max_restarts, ready_timeout
        self.restarts = 0
        self.restart_causes: list[str] = []
        # The packets a replacement may need: the version of the last job sent, and every later one.
        self._packets: dict[int, WeightPacket] = {}
        self._sent = -1
        self._launch()
        self.published = -1
        self._closed = False

    def _launch(self) -> None:
        ctx, (factory, args, threads) = self._ctx, self._spec
        self._jobs, self._weights, self._results = ctx.Queue(), ctx.Queue(), ctx.Queue()
        # The kernel's parent-death signal follows the starting thread: only the main one outlives the worker.
        deathsig = threading.current_thread() is threading.main_thread()
        self.process = ctx.Process(  # type: ignore[attr-defined]  # get_context() returns a concrete context
            target=_worker_main,
            args=(factory, args, threads, self._jobs, self._weights, self._results, deathsig, self.interruptible),
            daemon=True,
            name="rlcore-rollout-worker",
        )
        self.process.start()
        self._ready = False

    def publish(self, version: int, weights: WeightPacket | Mapping[str, torch.Tensor]) -> None:
        """Send weights ``version`` to the worker; returns at once.

        ``weights`` is a :class:`~rlcore.dataflow.WeightPacket` from
        :meth:`WeightSync.sync <rlcore.dataflow.WeightSync.sync>` (the trainer's path), or
        name -> tensor, which goes through a :class:`~rlcore.dataflow.WeightSync` of its
        own. The packet's flat buckets are copied into shared memory and queued. Versions
        go 0, 1, 2, ... with none skipped, so the worker can stop at exactly the version a
        row is stamped with.
        """
        self._check_open()
        if version != self.published + 1:
            raise ValueError(
                f"version: got {version}, expected {self.published + 1} (the next version after {self.published})"
            )
        if not isinstance(weights, WeightPacket):
            weights = WeightSync(weights).gather()
        buffers = tuple(b.detach().clone().share_memory_() for b in weights.buffers)
        packet = weights._replace(version=version, buffers=buffers)
        self._weights.put(packet)
        if self.max_restarts:
            self._packets[version] = packet
        self.published = version

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("rollout worker: already closed, expected a running worker (make a new RolloutWorker)")

    def _call(self, name: str, batch: dict[str, torch.Tensor]) -> Mapping[str, Any]:
        self._check_open()
        versions = batch["policy_version"]
        want = int(versions.max())
        if want > self.published:
            raise ValueError(
                f"stage {name!r}: rows stamped with policy version {want}, but only up to {self.published} was published"
            )
        if self.max_restarts:  # a replacement starts from this job's version: older packets are not needed again
            self._sent = max(self._sent, want)
            for v in [v for v in self._packets if v < self._sent]:
                del self._packets[v]
        self._jobs.put((batch, want))
        try:
            return self._receive(name, None)
        except WorkerDied as died:
            if self.restarts >= self.max_restarts:
                bound = f" (after {self.restarts} restart{'s' * (self.restarts != 1)}, the most allowed)"
                raise WorkerDied(f"{died}{bound if self.max_restarts else ''}", died.cause) from None
            self._restart(name, str(died.cause))
            raise HandBack(name, str(died.cause)) from None

    def _restart(self, name: str, cause: str) -> None:
        """Replace the dead process: a new one with fresh queues, the weights from the last job's version on.

        The call that was under way raises :class:`~rlcore.dataflow.HandBack` after this: its
        rows go back to the dock and are taken again, redone by the replacement with the
        version they are stamped with then and the same random streams (keyed by row).
        """
        self.restarts += 1
        self.restart_causes.append(cause)
        warnings.warn(
            f"stage {name!r}: {cause}; restarting it ({self.restarts} of at most {self.max_restarts})",
            RuntimeWarning,
            stacklevel=2,
        )
        self._discard()
        self._launch()
        self._receive(name, self.ready_timeout)
        for version in sorted(self._packets):
            self._weights.put(self._packets[version])

    def _discard(self) -> None:
        """Reap the process (dead, or stopped here) and drop its queues (a killed writer may hold their locks)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        for q in (self._jobs, self._weights, self._results):
            q.cancel_join_thread()
            q.close()

    def _receive(self, name: str, timeout: float | None) -> Any:
        """The worker's next result, skipping its ready message; raises its errors, its death or the timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                raw = self._results.get(timeout=0.1)
            except queue.Empty:
                if not self.process.is_alive():
                    raise WorkerDied.exited(name, self.process.exitcode) from None
                if end is not None and time.monotonic() > end:
                    raise TimeoutError(f"stage {name!r}: rollout worker not ready after {timeout:g} s") from None
                continue
            status, value = std_mp.reduction.ForkingPickler.loads(raw)
            if status == "error":
                raise add_note(value, f"raised in the rollout worker process of stage {name!r}")
            if status == "ready":
                self._ready = True
                if timeout is not None:
                    return None
                continue
            return value

    def wait_ready(self, timeout: float = 120.0, *, name: str = "rollout") -> None:
        """Block until the worker has built its generate function (to keep start-up out of a timing)."""
        if not self._ready:
            self._check_open()
            self._receive(name, timeout)

    def close(self) -> None:
        """Stop the worker process (terminate it if it does not exit in time). Closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.process.is_alive():
            self._jobs.put(None)
            self.process.join(self.join_timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(self.join_timeout)
        if self.process.is_alive():  # it ignores SIGTERM (or is stuck in C code): no process is left behind
            self.process.kill()
            self.process.join()
        for q in (self._jobs, self._weights, self._results):
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> RolloutWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
