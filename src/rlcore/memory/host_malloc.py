"""glibc's malloc set to keep freed host memory for reuse, so a step's temporaries do not fault their pages in again.

On the CPU, every layer of a training step allocates and frees tensors of a few hundred
KiB to a few MiB (attention scores, MLP activations, their gradients); torch's CPU
allocator is plain ``malloc``. glibc serves blocks above its mmap threshold (128 KiB at
start, raised only after such a block is freed) with a fresh ``mmap``, and returns the
heap's free top to the system once it exceeds the trim threshold (128 KiB; after an
adaptive rise, twice the mmap threshold). Either way the next step's tensors land on
pages the kernel must fault in again: at the main job's size, hundreds of page faults
per attention call, costing as much as its arithmetic. Fixing both thresholds higher
keeps those pages mapped and reused (``mallopt(3)``; the ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` environment variables do the same before start-up).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["MAX_MIB", "MMAP_THRESHOLD_LIMIT", "START_THRESHOLD", "keep_freed_host_memory", "set_malloc_thresholds"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit systems.
MMAP_THRESHOLD_LIMIT = 32 << 20
# Both thresholds as glibc starts (before its adaptive rise), in bytes.
START_THRESHOLD = 128 << 10
MAX_MIB = 2047


def set_malloc_thresholds(trim: int, mmap: int) -> bool:
    """Fix glibc's trim and mmap thresholds (bytes) for this process: ``mallopt(3)``, which ends their adaptive rise.

    Returns True where both were set (glibc accepted them), False on another C library.
    """
    for name, value in (("trim", trim), ("mmap", mmap)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
            raise ValueError(f"{name}: got {value!r}, expected an int number of bytes in [0, 2**31)")
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(
        libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(trim)) and libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap))
    )


def keep_freed_host_memory(mib: int) -> bool:
    """Let this process's malloc keep up to ``mib`` MiB of freed memory mapped, for the next allocations.

    Sets glibc's trim threshold to ``mib`` MiB and its mmap threshold to the smaller of
    that and :data:`MMAP_THRESHOLD_LIMIT` (blocks above it are still mapped and unmapped
    one by one) with :func:`set_malloc_thresholds`. Process-wide, for the process's life;
    the memory kept is freed memory that later allocations reuse, not a reservation.

    Args:
      mib: MiB of freed memory kept, at most :data:`MAX_MIB` (mallopt takes a C int of
        bytes); 0 leaves malloc as it is.

    Returns:
      True where the thresholds were set (glibc), False otherwise (``mib`` 0, or another
      C library: musl, macOS, Windows).
    """
    if not isinstance(mib, int) or isinstance(mib, bool) or not 0 <= mib <= MAX_MIB:
        raise ValueError(f"mib: got {mib!r}, expected an int in [0, {MAX_MIB}] (MiB of freed memory kept)")
    if mib == 0:
        return False
    return set_malloc_thresholds(mib << 20, min(mib << 20, MMAP_THRESHOLD_LIMIT))
