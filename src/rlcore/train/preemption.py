"""Preemption-safe stops: a signal asks the run to stop at the next step boundary, with a checkpoint there.

A scheduler that preempts a job (Slurm, Kubernetes, a spot instance's notice) sends
``SIGTERM`` and, after a grace period, ``SIGKILL``. :func:`stop_on_signals` turns the
signals named by ``trainer.stop_signals`` into a request the trainer reads at the end of
each step: the step finishes, the run saves a checkpoint of it, closes its workers and
raises :class:`Preempted`; the command line exits with :data:`EXIT_PREEMPTED`, and
``--resume`` continues with the next step. A second signal, or a step that does not
finish within ``trainer.stop_timeout`` seconds of the first (a stuck reward, a hung
engine), abandons the step (``KeyboardInterrupt``): the last committed checkpoint stays
the one to resume from.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

__all__ = ["EXIT_PREEMPTED", "STOP_SIGNALS", "Preempted", "StopRequest", "stop_on_signals"]

EXIT_PREEMPTED = 75
"""The command line's exit status after a stop on a signal with the checkpoint saved: ``EX_TEMPFAIL`` of
``sysexits.h`` ("try again later"): run the same command with ``--resume``."""

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
"""The signal names ``trainer.stop_signals`` accepts."""


class Preempted(Exception):
    """The run stopped on a signal after step ``step``, whose checkpoint is committed (``--resume`` continues)."""

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(
            f"stopped by {signal_name} after step {step}; the checkpoint of steps 0-{step} is saved, "
            "continue with --resume"
        )
        self.step = step
        self.signal_name = signal_name


class StopRequest:
    """Whether a stop was asked for, and by which signal: set by the handlers of :func:`stop_on_signals`."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name = ""
        self.timers: list[threading.Timer] = []

    def disarm(self) -> None:
        """The stop is under way (the step finished and is saved): no abandoning by the timeout from now on."""
        for timer in self.timers:
            timer.cancel()

    def set(self, signal_name: str) -> None:
        if not self._event.is_set():
            self.signal_name = signal_name
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


@contextlib.contextmanager
def stop_on_signals(names: Sequence[str], *, timeout: float | None = None) -> Iterator[StopRequest]:
    """Within the block, each signal of ``names`` sets the yielded :class:`StopRequest`; a second one, or
    ``timeout`` seconds passing after the first, raises ``KeyboardInterrupt`` in the main thread (abandon
    the step). The previous handlers come back after the block.

    Handlers are installed only from the main thread (Python runs signal handlers there); elsewhere
    the request is never set by a signal.

    >>> import os
    >>> with stop_on_signals(["SIGUSR1"]) as stop:
    ...     os.kill(os.getpid(), signal.SIGUSR1)
    ...     stop.is_set(), stop.signal_name
    (True, 'SIGUSR1')
    >>> signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    True
    """
    request = StopRequest()
    previous: dict[signal.Signals, Any] = {}

    def abandon() -> None:
        print(
            f"rlcore: the step under way did not finish within {timeout:g} s of {request.signal_name} "
            "(trainer.stop_timeout); abandoning it",
            file=sys.stderr,
            flush=True,
        )
        sig = signal.Signals[request.signal_name]  # handled here: a second signal, KeyboardInterrupt
        main = threading.main_thread().ident
        if hasattr(signal, "pthread_kill") and main is not None:
            signal.pthread_kill(main, sig)  # a real signal: it also interrupts a blocking call in the main thread
        else:
            _thread.interrupt_main(sig)

    def handler(signum: int, frame: FrameType | None) -> None:
        if request.is_set():
            raise KeyboardInterrupt
        request.set(signal.Signals(signum).name)
        if timeout is not None:
            timer = threading.Timer(timeout, abandon)
            timer.daemon = True
            request.timers.append(timer)
            timer.start()

    try:
        if threading.current_thread() is threading.main_thread():
            for name in names:
                sig = signal.Signals[name]
                previous[sig] = signal.signal(sig, handler)
        yield request
    finally:
        request.disarm()
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
