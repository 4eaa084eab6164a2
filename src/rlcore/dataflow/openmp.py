"""A thread's OpenMP team given back, so that the thread running the device's stages has the process's only one.

PyTorch's CPU ops run on OpenMP. The runtime gives every thread that runs a parallel op
a team of its own (the thread and ``torch.get_num_threads() - 1`` helpers), kept for the
thread's life. GNU OpenMP, which PyTorch's Linux wheels ship, counts the threads of every
team in the process: once they outnumber the cores, idle helpers no longer spin between
parallel regions but sleep, and every op then pays for waking them. A trainer that
warmed up on its main thread and then trains on a pipeline worker thread has two teams:
on two cores the worker's model step took about 1.6 times as long until the main
thread's team was given back. :func:`rlcore.dataflow.run_pipeline` gives back the calling
thread's team before its workers start (that thread only waits while they run).

``omp_pause_resource_all`` (OpenMP 5.0) is the call; GNU OpenMP frees the calling
thread's team only. It is looked up in the GNU OpenMP this process has loaded (Linux:
``/proc/self/maps``), never loading one. Other runtimes (LLVM's, Intel's) are left
alone: their pause acts on the whole process, not on one thread's team.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

__all__ = ["release_openmp_threads"]

_RUNTIME = "libgomp"
_OMP_PAUSE_SOFT = 1


@functools.cache
def _pause() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``omp_pause_resource_all`` of the loaded GNU OpenMP, or None (none loaded, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.count(" ") >= 5 and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(_RUNTIME):
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                pause = lib.omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None


def release_openmp_threads() -> bool:
    """Give back the calling thread's OpenMP team (its helper threads end); its next parallel op makes a new one.

    Returns True where GNU OpenMP released it, False where it is not loaded (another
    runtime, or not Linux) or refused (inside a parallel region).
    """
    pause = _pause()
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0
