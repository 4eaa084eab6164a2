"""Host heap tuning: keep freed host memory in the process for reuse instead of giving it back each step.

glibc's ``malloc`` serves large blocks (above a threshold that adapts up to 32 MiB) with
fresh ``mmap`` pages and trims the heap's free top back to the system. A training step
on the CPU allocates and frees the same activation-sized tensors every step, so each
step pays page faults and zeroing for memory it just returned: at the main job's size
about 700 minor faults a step. Raising the mmap threshold to its ceiling and the trim
threshold keeps those blocks in the heap (the resident size stays at the step's peak),
as PyTorch's CPU performance guide gets by preloading jemalloc or tcmalloc. Threads
started afterwards share the main heap: a thread's own arena is a separate 64 MiB heap
that glibc unmaps when it empties, so on the pipeline's device thread the two thresholds
alone made the faults worse, not better (measured: 580 -> 1656 a step; with one arena, 0).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

__all__ = ["retain_host_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MMAP_CEILING = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)


@functools.cache
def retain_host_memory(trim_threshold: int = 1 << 30) -> bool:
    """Tune glibc ``malloc`` so a step's freed tensors are reused, not returned and faulted in again.

    Blocks up to 32 MiB come from the heap instead of their own ``mmap``, up to
    ``trim_threshold`` bytes of free heap top stay mapped, and threads started after the
    call allocate from the main heap (one arena). Process-wide and lasting
    (a repeated call with the same argument does nothing more).

    Args:
      trim_threshold: free bytes at the heap's top kept before trimming (default 1 GiB).

    Returns:
      True where applied; False where the C library is not glibc (musl, macOS, Windows),
      which is left as it is.
    """
    if not isinstance(trim_threshold, int) or isinstance(trim_threshold, bool) or trim_threshold < 0:
        raise ValueError(f"trim_threshold: got {trim_threshold!r}, expected an int >= 0 (bytes)")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = (
        (_M_ARENA_MAX, 1),
        (_M_MMAP_THRESHOLD, _MMAP_CEILING),
        (_M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1)),
    )
    applied = [mallopt(option, value) for option, value in settings]  # every one, even after a refusal
    return all(applied)
