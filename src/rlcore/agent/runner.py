"""Run environment calls concurrently off the generation thread: an asyncio loop in a background thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

from rlcore.agent.threads import in_daemon_thread, labelled, running_label

__all__ = ["StepRunner"]


class StepRunner:
    """Runs ``fn(*args)`` (sync or async) on a background event loop, at most ``max_concurrency`` at once.

    ``submit`` returns a :class:`concurrent.futures.Future` at once, so the caller (the
    decoding loop) keeps generating while environment steps and tool calls run. Sync
    functions run in daemon threads (:func:`rlcore.agent.in_daemon_thread`: one that
    never returns does not hold the interpreter's exit); a call past ``timeout`` seconds
    fails its future with :class:`TimeoutError`; any exception of the call, ``SystemExit``
    included, fails its own future and never the loop. The loop's default executor (for
    the user's own ``asyncio.to_thread``) is a pool of ``max_concurrency`` workers.
    ``max_concurrency=1`` runs the calls one after another (the baseline of
    ``benchmarks/bench_agent.py``).

    The timeouts hold only while the loop runs: :meth:`wait` also bounds a loop that a
    coroutine blocks (``time.sleep`` inside ``async def``) and a call that ignores its
    cancellation, and names the culprit (:attr:`running`).

    Args:
      max_concurrency: calls in flight at once.
      timeout: seconds per call (None: no limit).

    >>> with StepRunner(max_concurrency=4) as runner:
    ...     runner.submit(lambda x: x + 1, 41).result()
    42
    """

    # Seconds between the loop's heartbeats; a loop silent for longer than ``timeout`` + ``grace`` is
    # blocked, and a call running ``grace`` past its timeout ignores its cancellation (the grace
    # absorbs a loaded machine's scheduling delays).
    beat = 0.05
    grace = 2.0

    def __init__(self, *, max_concurrency: int = 64, timeout: float | None = None):
        if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
            raise ValueError(f"max_concurrency: got {max_concurrency!r}, expected an int >= 1")
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ValueError(f"timeout: got {timeout!r}, expected a number > 0 or None")
        self.max_concurrency, self.timeout = max_concurrency, timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="rlcore-env")
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._pool)
        self._closed = False
        self._last_beat = time.monotonic()
        self._started: dict[concurrent.futures.Future, list[float]] = {}
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlcore-env-loop", daemon=True)
        self._thread.start()
        self._slots = asyncio.run_coroutine_threadsafe(self._make_semaphore(), self._loop).result()

    async def _make_semaphore(self) -> asyncio.Semaphore:
        self._loop.call_soon(self._heartbeat)
        return asyncio.Semaphore(self.max_concurrency)

    def _heartbeat(self) -> None:
        self._last_beat = time.monotonic()
        self._loop.call_later(self.beat, self._heartbeat)

    @property
    def running(self) -> str | None:
        """What executes on the loop now: the :func:`rlcore.agent.labelled` call (a tool or an environment method) or None."""
        return running_label(self._thread.ident)

    async def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], started: list[float]) -> Any:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        async with self._slots:
            started.append(time.monotonic())
            if inspect.iscoroutinefunction(fn):
                work = labelled(fn(*args), name)
            else:
                work = in_daemon_thread(fn, *args)

            async def finish() -> Any:
                try:
                    result = await work
                    return await labelled(result, name) if inspect.isawaitable(result) else result
                except (asyncio.CancelledError, GeneratorExit, Exception):  # GeneratorExit: closed unfinished
                    raise
                except BaseException as err:  # SystemExit of user code fails this call, never the loop
                    raise RuntimeError(f"{name} raised {type(err).__name__}: {err}") from err

            try:
                return await asyncio.wait_for(finish(), self.timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"{name} timed out after {self.timeout} s") from None

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Schedule ``fn(*args)``; the future holds its result or exception."""
        if self._closed or self._loop.is_closed() or not self._thread.is_alive():
            raise RuntimeError("StepRunner: submit after close()")
        started: list[float] = []
        future = asyncio.run_coroutine_threadsafe(self._call(fn, args, started), self._loop)
        self._started[future] = started
        return future

    def wait(self, future: concurrent.futures.Future) -> Any:
        """The result of a ``submit`` future, waiting a bounded time even when the loop is blocked.

        Without a ``timeout`` it waits as long as the call takes. With one it raises
        :class:`TimeoutError` (and cancels the call) when the loop has not run for
        ``timeout`` + ``grace`` seconds (a coroutine blocks it: the message names it) or
        the call runs ``timeout`` + ``grace`` seconds after it started (it ignores its
        cancellation).
        """
        started = self._started.pop(future, [])
        if self.timeout is None:
            return future.result()
        while True:
            try:
                return future.result(timeout=self.beat * 2)
            except concurrent.futures.TimeoutError:
                if future.done():
                    raise
            now = time.monotonic()
            if now - self._last_beat > self.timeout + self.grace:
                what = self.running or "an environment call"
                future.cancel()
                raise TimeoutError(
                    f"{what} blocked the environments' event loop for more than {self.timeout + self.grace} s "
                    "(a blocking call inside async def?)"
                )
            if started and now - started[0] > self.timeout + self.grace:
                future.cancel()
                raise TimeoutError(f"an environment call ran past {self.timeout} s and ignored its cancellation")

    async def _cancel_pending(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Cancel pending calls, stop the loop and release the workers.

        A thread stuck in a sync call is left to finish alone (a daemon); so is a loop
        that a coroutine blocks (the runner is closed all the same, within seconds).
        """
        if self._closed:
            return
        self._closed = True
        self._started.clear()
        blocked = time.monotonic() - self._last_beat > 0.5
        # A coroutine that ignores cancellation does not keep the loop alive.
        if not blocked:
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                asyncio.run_coroutine_threadsafe(self._cancel_pending(), self._loop).result(timeout=2)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=0.5 if blocked else 2)
        if not self._thread.is_alive():
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> StepRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
