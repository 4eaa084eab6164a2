"""Rewards evaluated off the training thread, in worker processes that a stuck or dead reward cannot hang."""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import math
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import torch

from rlcore._lifetime import die_with_parent
from rlcore.rewards._answers import reference_answers
from rlcore.rewards.compose import Weighted
from rlcore.rewards.protocol import RewardError, evaluate, reward_name
from rlcore.rewards.registry import reward_metrics

__all__ = ["RewardPool"]

# Seconds a stopped worker gets to exit on SIGTERM before it is killed.
_GRACE = 1.0


def _sendable(err: BaseException, where: str) -> BaseException:
    """``err`` if it survives pickling, else a :class:`RewardError` carrying its text."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RewardError(f"{where} raised {type(err).__name__}: {err}")


def _worker(conn: multiprocessing.connection.Connection, payload: bytes, name: str, components: bool) -> None:
    # Ctrl-C reaches the whole process group; the pool stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The kernel signal is tied to the pool dispatcher thread that starts this worker, which lives as long as the pool.
    die_with_parent("rlcore-reward-parent-watch")
    try:
        reward = pickle.loads(payload)
    except Exception as err:
        conn.send(("error", f"cannot be unpickled in a worker process ({type(err).__name__}: {err})"))
        return
    conn.send(("ready", None))
    while True:
        try:
            prompts, responses, batch, columns = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the pool closed the pipe, or its process is gone
            return
        try:
            # Lists cross the process boundary more cheaply than tensors (no shared-memory handles). The
            # reward's counters (timeouts, ...) travel back with the scores: they would be lost in here.
            scored, counts, parts = _score(reward, prompts, responses, batch, columns, components=components)
            msg: tuple[str, Any] = ("ok", (scored.tolist(), counts, None if parts is None else parts.tolist()))
        except Exception as err:
            msg = ("raised", _sendable(err, f"reward {name!r} on batch {batch!r}"))
        conn.send(msg)


def _jsonable(value: Any) -> Any:
    """``value`` if it can be written as JSON (a one-element tensor as its number), else its text."""
    try:
        value = reference_answers([value])[0]
        json.dumps(value)
        return value
    except (TypeError, ValueError, OverflowError):
        return str(value)


class _Parts:
    """A :class:`Weighted` called once through :func:`evaluate` (its name in errors), keeping its components' scores."""

    def __init__(self, reward: Weighted, batch: Any):
        self.reward, self.batch, self.name = reward, batch, reward_name(reward)
        self.parts: dict[str, torch.Tensor] = {}

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **columns: Any) -> torch.Tensor:
        total, self.parts = self.reward.scores_and_parts(prompts, responses, batch=self.batch, **columns)
        return total


def _breakdown_keys(reward: Any) -> list[str]:
    if not isinstance(reward, Weighted):
        return []
    return [f"{key}/{counter}" for key in reward.names() for counter in ("score_sum", "scored")]


def _score(
    reward: Any, prompts: Sequence[str], responses: Sequence[str], batch: Any, columns: dict, *, components: bool
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor | None]:
    """One call's scores and counters: the reward's own (:func:`reward_metrics`) and, for a
    :class:`Weighted`, each component's raw scores summed (``name/score_sum``, ``name/scored``)
    -- of this call only, whoever else calls the same reward object (a validation, a thread).
    With ``components``, also each component's unweighted scores ``[B, K]`` (a reward that is
    not a :class:`Weighted` is one component), else None."""
    if not isinstance(reward, Weighted):
        scores = evaluate(reward, prompts, responses, batch=batch, **columns)
        return scores, reward_metrics(reward), scores[:, None].clone() if components else None
    call = _Parts(reward, batch)
    scores = evaluate(call, prompts, responses, batch=batch, **columns)
    counts = reward_metrics(reward)
    for key, part in call.parts.items():
        counts[f"{key}/score_sum"] = float(part.double().sum())
        counts[f"{key}/scored"] = float(len(responses))
    parts = torch.stack([p.float() for p in call.parts.values()], -1) if components else None
    return scores, counts, parts


def _result(scores: Any, parts: Any) -> Any:
    """What a future holds: the scores ``[B]``, or ``(scores, parts [B, K])`` when the pool gives the components."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    return scores if parts is None else (scores, torch.as_tensor(parts, dtype=torch.float32).reshape(len(scores), -1))


def _settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless it is already done (a timeout and a late result can race)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class _Counters:
    """The reward's counters (:func:`rlcore.rewards.reward_metrics`) summed per batch, until popped."""

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self.lock = threading.Lock()
        self.by_batch: dict[Any, dict[str, float]] = {}

    def add(self, batch: Any, counts: dict[str, float]) -> None:
        with self.lock:
            acc = self.by_batch.setdefault(batch, {})
            for k, v in counts.items():
                acc[k] = acc.get(k, 0.0) + float(v)

    def pop(self, batch: Any) -> dict[str, float]:
        with self.lock:
            acc = self.by_batch.pop(batch, {})
        return {**dict.fromkeys(self.keys, 0.0), **acc}


class _Job:
    __slots__ = ("batch", "deadline", "future", "payload", "where")

    def __init__(self, payload: bytes, future: Future, where: str, batch: Any = None):
        self.payload, self.future, self.where, self.batch = payload, future, where, batch
        self.deadline = math.inf


class _Worker:
    __slots__ = ("conn", "eof", "job", "process", "ready")

    def __init__(self, process: Any, conn: multiprocessing.connection.Connection):
        self.process, self.conn = process, conn
        self.job: _Job | None = None
        self.ready = self.eof = False


class _Dispatcher:
    """Owns the worker processes: hands out jobs, enforces the timeout, replaces dead workers, stops them all on close.

    One thread runs the loop; it starts every worker, so on Linux the workers' death
    signal is tied to it (see ``rlcore._lifetime.die_with_parent``).
    """

    def __init__(
        self,
        payload: bytes,
        name: str,
        num_workers: int,
        timeout: float | None,
        counters: _Counters,
        max_restarts: int = 0,
        components: bool = False,
    ):
        self._payload, self._name, self._num_workers, self._timeout = payload, name, num_workers, timeout
        self._components = components
        self._counters = counters
        self.max_restarts = max_restarts
        self.restart_causes: list[str] = []  # appended by the dispatcher thread only
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._woken = False
        self._closing = False
        self._stopped = False  # the loop has ended and closed the wake pipe
        self._broken: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="rlcore-reward-pool")
        self._thread.start()

    # --- called from user threads -------------------------------------------------
    def submit(self, job: _Job) -> None:
        with self._lock:
            if self._closing:
                raise RuntimeError("RewardPool: submit after close")
            if self._broken is not None:
                _settle(job.future, error=RewardError(self._broken))
                return
            self._queue.append(job)
            self._wake()

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake()
        atexit.unregister(self.close)
        if threading.current_thread() is not self._thread:
            # Never waits for a running call: the loop stops the workers within about _GRACE seconds.
            self._thread.join(timeout=_GRACE + 5)

    def _wake(self) -> None:  # with self._lock held
        if not self._woken and not self._stopped:
            self._woken = True
            self._wake_w.send_bytes(b"")

    # --- the dispatcher thread ----------------------------------------------------
    def _start(self) -> _Worker:
        parent_end, child_end = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker, args=(child_end, self._payload, self._name, self._components), name="rlcore-reward-worker"
        )
        process.start()
        child_end.close()
        return _Worker(process, parent_end)

    def _fail_queued(self, message: str) -> None:
        with self._lock:
            jobs, self._queue = list(self._queue), collections.deque()
        for job in jobs:
            _settle(job.future, error=RewardError(f"{job.where}: {message}"))

    def _run(self) -> None:
        workers: list[_Worker] = []
        try:
            self._loop(workers)
            self._fail_queued("the reward pool was closed before it was scored")
        except BaseException as err:  # a bug here must not leave futures waiting forever
            with self._lock:
                self._broken = f"reward {self._name!r}: the reward pool stopped ({type(err).__name__}: {err})"
            self._fail_queued(self._broken)
        finally:
            self._stop(workers)

    def _stop(self, workers: list[_Worker]) -> None:
        for w in workers:
            if w.process.is_alive():
                w.process.terminate()
        deadline = time.monotonic() + _GRACE
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1.0)
            if w.job is not None:
                _settle(w.job.future, error=RewardError(f"{w.job.where}: the reward pool was closed while scoring it"))
            w.conn.close()
        workers.clear()
        with self._lock:  # a user thread's submit or close never writes to a closed pipe
            self._stopped = True
            self._wake_r.close()
            self._wake_w.close()

    def _loop(self, workers: list[_Worker]) -> None:
        while True:
            started: list[_Worker] = []
            with self._lock:
                if self._closing:
                    return
                if self._broken is None:
                    while len(workers) < self._num_workers:
                        workers.append(self._start())
                for w in workers:
                    while w.ready and w.job is None and self._queue:
                        job = self._queue.popleft()
                        # A job handed back by a replaced worker is running already; else it may be cancelled.
                        if job.future.running() or job.future.set_running_or_notify_cancel():
                            w.job = job
                            started.append(w)
            for w in started:
                assert w.job is not None
                w.job.deadline = time.monotonic() + (self._timeout if self._timeout is not None else math.inf)
                with contextlib.suppress(OSError):  # the worker died; its sentinel reports it below
                    w.conn.send_bytes(w.job.payload)
            deadline = min((w.job.deadline for w in workers if w.job is not None), default=math.inf)
            wait = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
            waitables: list[Any] = [self._wake_r]
            for w in workers:
                waitables += [w.process.sentinel] if w.eof else [w.conn, w.process.sentinel]
            ready = set(multiprocessing.connection.wait(waitables, wait))
            if self._wake_r in ready:
                with self._lock:
                    self._wake_r.recv_bytes()
                    self._woken = False
            for w in list(workers):
                if w.conn in ready:
                    self._receive(w)
                if w.process.sentinel in ready and (w.eof or not w.conn.poll()):
                    self._died(w)
                    workers.remove(w)
                elif w.job is not None and time.monotonic() >= w.job.deadline:
                    self._timed_out(w)
                    workers.remove(w)

    def _receive(self, w: _Worker) -> None:
        try:
            kind, value = w.conn.recv()
        except (EOFError, OSError):
            w.eof = True  # the process ended; its sentinel reports it
            return
        except Exception as err:  # the reward's exception cannot be rebuilt here
            kind, value = "raised", RewardError(f"{w.job.where if w.job else self._name}: {err}")
        if kind == "ready":
            w.ready = True
        elif kind == "error":
            with self._lock:
                self._broken = f"reward {self._name!r} {value}"
            self._fail_queued(f"reward {self._name!r} {value}")
        elif w.job is not None:
            job, w.job = w.job, None
            if kind == "ok":
                scores, counts, parts = value
                self._counters.add(job.batch, counts)
                _settle(job.future, result=_result(scores, parts))
            else:
                _settle(job.future, error=value)

    def _restart(self, cause: str, job: _Job | None) -> bool:
        """Count a replacement of a dead or stopped worker, if the bound allows; its job goes back first in the queue.

        False past ``max_restarts`` (0: never): the caller fails the job as without restarts.
        """
        if len(self.restart_causes) >= self.max_restarts:
            return False
        self.restart_causes.append(cause)
        warnings.warn(
            f"reward {self._name!r}: {cause}; restarting it ({len(self.restart_causes)} of at most "
            f"{self.max_restarts}){'; its rows are scored again' if job is not None else ''}",
            RuntimeWarning,
            stacklevel=2,
        )
        if job is not None:
            with self._lock:
                self._queue.appendleft(job)
        return True

    def _bound(self) -> str:
        n = len(self.restart_causes)
        return f" (after {n} restart{'s' * (n != 1)}, the most allowed)" if self.max_restarts else ""

    def _died(self, w: _Worker) -> None:
        w.process.join(_GRACE)  # the sentinel can fire just before the exit status is ready
        code = w.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        if w.ready and self._restart(f"its worker process died ({how})", w.job):
            w.job = None
        elif w.job is not None:
            _settle(
                w.job.future,
                error=RewardError(
                    f"{w.job.where}: the reward's worker process died ({how}) while scoring it{self._bound()}"
                ),
            )
            w.job = None
        elif not w.ready:
            message = f"reward {self._name!r}: its worker process died at start ({how})"
            with self._lock:
                self._broken = message
            self._fail_queued(message)
        w.conn.close()

    def _timed_out(self, w: _Worker) -> None:
        job = w.job
        assert job is not None
        w.job = None
        w.process.kill()
        w.process.join(_GRACE)
        if not self._restart(f"its worker ran past the reward timeout ({self._timeout:g} s) and was stopped", job):
            _settle(
                job.future,
                error=RewardError(
                    f"{job.where} did not finish within {self._timeout:g} s (the reward timeout); "
                    f"its worker process was stopped{self._bound()}"
                ),
            )
        w.conn.close()


class RewardPool:
    """Score batches in worker processes while the trainer keeps computing.

    ``submit`` returns at once with a future of the float32 scores ``[B]`` (with
    ``components``, of ``(scores [B], parts [B, K])``: see below); rule rewards
    that parse text (regexes, a sandboxed verifier) then overlap the reference and
    old-policy forward passes instead of stalling them. Workers are started with
    ``spawn`` (safe with torch's threads); the reward is pickled once, when each worker
    starts, so it must be a module-level function or an instance of a module-level class.

    Failures come back from ``result()`` as :class:`rlcore.rewards.RewardError` naming
    the reward and the batch: the reward raised, returned bad scores, ran past
    ``timeout`` (its worker is killed and replaced), or its worker process died (it is
    replaced). :meth:`close` never waits for a running call: it stops the workers
    (SIGTERM, then SIGKILL after a second). Workers exit by themselves when the process
    that owns the pool dies, even by ``kill -9`` (on Linux through the kernel's
    parent-death signal, so also while a reward is stuck in C code); Ctrl-C is left to
    the owning process.

    Args:
      reward: a :class:`rlcore.rewards.Reward` or ``BaseReward``-style object.
      num_workers: worker processes; ``0`` scores in this process -- in the calling
        thread without a timeout (for debugging), or in a helper thread with one (a
        call past the timeout is abandoned, not stopped: use workers for rewards that
        can hang).
      timeout: seconds one batch may run (from the moment a worker takes it) before
        ``result()`` raises; ``None`` waits for ever.
      samples: rows of each scored batch kept for :meth:`pop_samples` (prompt,
        response, score and answer, spread over the batch); 0 keeps none.
      max_restarts: how many times a worker process that died or ran past ``timeout`` is
        replaced with its batch scored again by the replacement, instead of failing it
        (0: its batch fails). Each replacement is warned about with its cause and counted
        (:attr:`restarts`, :attr:`restart_causes`); past the bound the batch fails as without
        restarts, its error saying so. A worker that dies while idle counts too.
      components: each future holds ``(scores, parts)``, ``parts`` ``[B, K]`` float32 the
        unweighted scores of each component of a :class:`rlcore.rewards.Weighted` (one column
        per entry of a config's ``rewards`` list; any other reward is one column), for an
        estimator that normalises each component on its own (GDPO).

    The reward's counters (``pop_metrics`` of its components, e.g. the verified-maths
    timeouts: :func:`rlcore.rewards.reward_metrics`) are collected after each call, in
    the worker processes too, and summed per ``batch``: :meth:`pop_metrics`. For a
    :class:`rlcore.rewards.Weighted`, each component's raw scores of the call are summed
    beside them (``name/score_sum``, ``name/scored``; :func:`rlcore.rewards.reward_log_values`).

    Use as a context manager, or call :meth:`close`.

    >>> from rlcore.rewards import LengthReward
    >>> with RewardPool(LengthReward(max_length=2), num_workers=0, timeout=60) as pool:
    ...     pool.submit(["q", "q"], ["ab", "abc"], batch=0).result()
    tensor([1., 0.])
    """

    def __init__(
        self,
        reward: Any,
        *,
        num_workers: int = 1,
        timeout: float | None = None,
        samples: int = 0,
        max_restarts: int = 0,
        components: bool = False,
    ):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers: got {num_workers!r}, expected an int >= 0")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts: got {max_restarts!r}, expected an int >= 0")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples: got {samples!r}, expected an int >= 0 (rows kept per batch)")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(f"timeout: got {timeout!r}, expected a finite number of seconds > 0, or None")
        if not isinstance(components, bool):
            raise ValueError(f"components: got {components!r}, expected a bool")
        self.reward, self.num_workers, self.timeout, self.components = reward, num_workers, timeout, components
        self._name = reward_name(reward)
        self._submitted = 0
        self._dispatcher: _Dispatcher | None = None
        self._closed = False
        self.samples = samples
        self._samples: dict[Any, list[dict[str, Any]]] = {}
        self._samples_lock = threading.Lock()
        # The counter names, read once here (nothing is counted yet), so that every batch reports them all.
        self._counters = _Counters(sorted([*reward_metrics(reward), *_breakdown_keys(reward)]))
        if num_workers:
            try:
                payload = pickle.dumps(reward)
            except Exception as err:
                raise ValueError(
                    f"reward: {self._name!r} cannot be pickled for a worker process ({err}); "
                    "define it at module level, or use num_workers=0"
                ) from err
            self._dispatcher = _Dispatcher(
                payload, self._name, num_workers, timeout, self._counters, max_restarts, components
            )
            # Close at interpreter exit before multiprocessing joins its children, and when
            # the pool is garbage-collected without close().
            atexit.register(self._dispatcher.close)
            weakref.finalize(self, self._dispatcher.close).atexit = False

    @property
    def restart_causes(self) -> list[str]:
        """Why each worker replacement within ``max_restarts`` happened, in order (empty without worker processes)."""
        return list(self._dispatcher.restart_causes) if self._dispatcher is not None else []

    @property
    def restarts(self) -> int:
        """Worker processes replaced so far within ``max_restarts``."""
        return len(self.restart_causes)

    def _where(self, batch: Any, index: int) -> str:
        label = repr(batch) if batch is not None else f"#{index} (unnamed)"
        return f"reward {self._name!r} on batch {label}"

    def submit(self, prompts: Sequence[str], responses: Sequence[str], *, batch: Any = None, **columns: Any) -> Future:
        """Start scoring one batch; ``.result()`` is the float32 tensor ``[B]`` (``(scores, parts)`` with ``components``).

        ``batch`` (e.g. the step) names the batch in errors.
        """
        if self._closed:
            raise RuntimeError("RewardPool: submit after close")
        index, self._submitted = self._submitted, self._submitted + 1
        where = self._where(batch, index)
        future: Future = Future()
        if self.samples:  # the rows are kept before the caller's future completes
            outer, future = future, self._keep_samples(future, batch, prompts, responses, columns.get("answers"))
            self._submit(future, where, index, batch, prompts, responses, columns)
            return outer
        return self._submit(future, where, index, batch, prompts, responses, columns)

    def _submit(
        self,
        future: Future,
        where: str,
        index: int,
        batch: Any,
        prompts: Sequence[str],
        responses: Sequence[str],
        columns: dict[str, Any],
    ) -> Future:
        if self._dispatcher is not None:
            try:
                payload = pickle.dumps((list(prompts), list(responses), batch, columns))
            except Exception as err:
                raise ValueError(
                    f"columns: {where} cannot be sent to a worker process ({type(err).__name__}: {err}); "
                    "pass picklable values (lists of strings or numbers)"
                ) from err
            self._dispatcher.submit(_Job(payload, future, where, batch))
            return future
        if self.timeout is None:
            try:
                _settle(future, result=self._evaluate(list(prompts), list(responses), batch, columns))
            except Exception as err:
                _settle(future, error=err)
            return future
        return self._submit_in_thread(future, where, list(prompts), list(responses), batch, columns)

    def _keep_samples(
        self, outer: Future, batch: Any, prompts: Sequence[Any], responses: Sequence[str], answers: Any
    ) -> Future:
        """The future the scoring completes: it keeps up to ``samples`` rows spread over the batch, then completes ``outer``."""
        inner: Future = Future()
        # A caller's cancel reaches the job (which checks the inner future before it runs).
        outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)
        n = len(responses)
        rows = sorted({i * n // self.samples for i in range(min(self.samples, n))})
        try:
            picked = [(prompts[i], responses[i], answers[i] if answers is not None else None) for i in rows]
        except (IndexError, KeyError, TypeError):  # a malformed column: the reward's own check names it
            picked = []

        def keep(done: Future) -> None:
            if done.cancelled():
                outer.cancel()
                return
            error = done.exception()
            if error is None and picked:
                scored = done.result()
                self._store(batch, rows, picked, scored[0] if self.components else scored, answers is not None)
            _settle(outer, result=done.result() if error is None else None, error=error)

        inner.add_done_callback(keep)
        return inner

    def _store(
        self, batch: Any, rows: list[int], picked: list[tuple[Any, Any, Any]], scores: Any, answered: bool
    ) -> None:
        kept = []
        for i, (prompt, response, answer) in zip(rows, picked):
            row = {"prompt": _jsonable(prompt), "response": _jsonable(response), "score": float(scores[i])}
            if answered:
                row["answer"] = _jsonable(answer)
            kept.append(row)
        with self._samples_lock:
            self._samples.setdefault(batch, []).extend(kept)

    def pop_samples(self, batch: Any = None) -> list[dict[str, Any]]:
        """The sample rows kept of ``batch``'s finished calls (``{prompt, response, score[, answer]}``); forgets them.

        >>> from rlcore.rewards import LengthReward
        >>> with RewardPool(LengthReward(max_length=2), num_workers=0, samples=1) as pool:
        ...     _ = pool.submit(["q", "q"], ["ab", "abc"], batch=0).result()
        ...     pool.pop_samples(0)
        [{'prompt': 'q', 'response': 'ab', 'score': 1.0}]
        """
        with self._samples_lock:
            return self._samples.pop(batch, [])

    def _submit_in_thread(
        self, future: Future, where: str, prompts: list[str], responses: list[str], batch: Any, columns: dict
    ) -> Future:
        def run() -> None:
            try:
                _settle(future, result=self._evaluate(prompts, responses, batch, columns))
            except BaseException as err:  # whatever ends this thread goes to the waiter, not into the void
                _settle(future, error=err)

        def expire() -> None:
            _settle(
                future,
                error=RewardError(
                    f"{where} did not finish within {self.timeout:g} s (the reward timeout); "
                    "the call was abandoned in its thread"
                ),
            )

        threading.Thread(target=run, daemon=True, name="rlcore-reward-call").start()
        assert self.timeout is not None
        timer = threading.Timer(self.timeout, expire)
        timer.daemon = True
        timer.start()
        future.add_done_callback(lambda _: timer.cancel())
        return future

    def _evaluate(self, prompts: list[str], responses: list[str], batch: Any, columns: dict) -> Any:
        """One call in this process; its counters go to ``batch`` (calls running at once may mix theirs)."""
        scores, counts, parts = _score(self.reward, prompts, responses, batch, columns, components=self.components)
        self._counters.add(batch, counts)
        return scores if parts is None else (scores, parts)

    def pop_metrics(self, batch: Any = None) -> dict[str, float]:
        """The reward's counters summed over the finished calls of ``batch`` (every counter name, 0 when none); resets them.

        Counts come back with the scores (from the worker processes too); a call that ran
        past the pool's timeout or whose worker died reports none.

        >>> from rlcore.rewards import build_reward
        >>> with RewardPool(build_reward(["length"]), num_workers=0) as pool:
        ...     _ = pool.submit(["q", "q"], ["a", "a" * 9], batch=3).result()
        ...     pool.pop_metrics(3)  # the length reward's raw scores summed over the 2 responses
        {'length/score_sum': 2.0, 'length/scored': 2.0}
        """
        return self._counters.pop(batch)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], *, batch: Any = None, **columns: Any) -> Any:
        return self.submit(prompts, responses, batch=batch, **columns).result()

    def close(self) -> None:
        """Stop the workers without waiting for running calls; pending futures fail or are cancelled."""
        self._closed = True
        if self._dispatcher is not None:
            self._dispatcher.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
