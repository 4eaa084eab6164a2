"""Worker processes that end with the process that started them, even when it is killed with ``kill -9``."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(name: str, *, deathsig: bool = True) -> None:
    """Call first thing in a worker process: it exits when its parent dies, whatever it is doing.

    A worker blocked on a queue whose write end it holds itself never sees its parent go.
    With ``deathsig`` on Linux the kernel sends it ``SIGKILL`` when the thread that started
    it exits (pass True only when that thread lives as long as the parent: the main thread
    or a pool's dispatcher), even while the worker holds the GIL in C code. Everywhere, a
    daemon thread named ``name`` waits on the parent's sentinel, a pipe that reads EOF once
    the parent is gone (this also covers the parent dying before ``prctl``).

    Args:
      name: the watcher thread's name (seen in stack dumps).
      deathsig: also ask Linux for the parent-death signal.
    """
    if deathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name=name).start()
