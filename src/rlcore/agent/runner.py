"""Run environment calls concurrently off the generation thread: an asyncio loop in a background thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["StepRunner"]


class StepRunner:
    """Runs ``fn(*args)`` (sync or async) on a background event loop, at most ``max_concurrency`` at once.

    ``submit`` returns a :class:`concurrent.futures.Future` at once, so the caller (the
    decoding loop) keeps generating while environment steps and tool calls run. Sync
    functions run in a thread pool of ``max_concurrency`` workers (also the loop's
    default executor, which :func:`rlcore.agent.call_tool` uses for sync tools); a
    call past ``timeout`` seconds fails its future with :class:`TimeoutError`.
    ``max_concurrency=1`` runs the calls one after another (the baseline of
    ``benchmarks/bench_agent.py``).

    Args:
      max_concurrency: calls in flight at once (and worker threads).
      timeout: seconds per call (None: no limit).

    >>> with StepRunner(max_concurrency=4) as runner:
    ...     runner.submit(lambda x: x + 1, 41).result()
    42
    """

    def __init__(self, *, max_concurrency: int = 64, timeout: float | None = None):
        if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
            raise ValueError(f"max_concurrency: got {max_concurrency!r}, expected an int >= 1")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: got {timeout!r}, expected a number > 0 or None")
        self.max_concurrency, self.timeout = max_concurrency, timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="rlcore-env")
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._pool)
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlcore-env-loop", daemon=True)
        self._thread.start()
        self._slots = asyncio.run_coroutine_threadsafe(self._make_semaphore(), self._loop).result()

    async def _make_semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.max_concurrency)

    async def _call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        async with self._slots:
            if inspect.iscoroutinefunction(fn):
                work = fn(*args)
            else:
                work = self._loop.run_in_executor(None, fn, *args)

            async def finish() -> Any:
                result = await work
                return await result if inspect.isawaitable(result) else result

            try:
                return await asyncio.wait_for(finish(), self.timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"{getattr(fn, '__qualname__', fn)!s} timed out after {self.timeout} s") from None

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Schedule ``fn(*args)``; the future holds its result or exception."""
        if self._loop.is_closed() or not self._thread.is_alive():
            raise RuntimeError("StepRunner: submit after close()")
        return asyncio.run_coroutine_threadsafe(self._call(fn, args), self._loop)

    async def _cancel_pending(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Cancel pending calls, stop the loop and release the workers (a thread stuck in a sync call is left to finish alone)."""
        if self._loop.is_closed():
            return
        # A coroutine that ignores cancellation does not keep the loop alive.
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(self._cancel_pending(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> StepRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
