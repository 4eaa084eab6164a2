"""User code off the event loop and on it: sync calls in daemon threads, and which call holds the loop.

A sync tool or environment method that never returns must not keep the interpreter
alive (a ``ThreadPoolExecutor`` worker is joined at exit), and a coroutine that blocks
(``time.sleep`` inside ``async def``) must be nameable by the thread that waits on the
loop: :func:`in_daemon_thread` runs the first kind, :func:`labelled` marks the steps of
the second, :func:`running_label` reads the mark from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Generator
from typing import Any

__all__ = ["in_daemon_thread", "labelled", "running_label"]

# thread id -> label of the labelled coroutine executing a step on that thread now.
_RUNNING: dict[int, str] = {}


def in_daemon_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> asyncio.Future:
    """Run ``fn(*args, **kwargs)`` in a fresh daemon thread; an awaitable future of the running loop holds the outcome.

    The thread does not keep the interpreter alive, so a call that never returns is
    abandoned at exit. Any exception the call raises (``SystemExit`` included) is the
    future's exception. Must be called from a running event loop.

    >>> async def main():
    ...     return await asyncio.wait_for(in_daemon_thread(sum, [1, 2]), 5)
    >>> asyncio.run(main())
    3
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled meanwhile (a timeout): nobody reads it
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def work() -> None:
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as err:  # the caller decides what a SystemExit of user code means
            result, error = None, err
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    name = getattr(fn, "__qualname__", type(fn).__name__)
    threading.Thread(target=work, name=f"rlcore-call-{name}", daemon=True).start()
    return future


class _Labelled:
    def __init__(self, awaitable: Awaitable[Any], label: str):
        self.awaitable, self.label = awaitable, label

    def __await__(self) -> Generator[Any, Any, Any]:
        inner = self.awaitable.__await__()
        ident = threading.get_ident()
        value: Any = None
        error: BaseException | None = None
        while True:
            previous = _RUNNING.get(ident)
            _RUNNING[ident] = self.label
            try:
                signal = inner.throw(error) if error is not None else inner.send(value)
            except StopIteration as stop:
                return stop.value
            finally:
                if previous is None:
                    _RUNNING.pop(ident, None)
                else:
                    _RUNNING[ident] = previous
            try:
                value, error = (yield signal), None
            except GeneratorExit:  # closed unfinished (garbage collection may have closed the inner one first)
                with contextlib.suppress(RuntimeError):
                    getattr(inner, "close", lambda: None)()
                raise
            except BaseException as err:  # cancellation and the like go on to the inner awaitable
                value, error = None, err


def labelled(awaitable: Awaitable[Any], label: str) -> Awaitable[Any]:
    """``awaitable``, with ``label`` marked as what runs on this thread while each of its steps executes.

    A coroutine that blocks its event loop stays marked until it yields, so
    :func:`running_label` of the loop's thread names it.

    >>> async def main():
    ...     async def probe():
    ...         return running_label(threading.get_ident())
    ...     return await labelled(probe(), "tool 'probe'")
    >>> asyncio.run(main())
    "tool 'probe'"
    """
    return _Labelled(awaitable, label)


def running_label(thread_id: int | None) -> str | None:
    """The label of the :func:`labelled` call executing on thread ``thread_id`` at this moment (None: none)."""
    return None if thread_id is None else _RUNNING.get(thread_id)
