"""Teardown-safe gloo process groups for the multi-process tests.

gloo can abort a rank at exit ("terminate called without an active exception") when the
process group's C++ threads are destroyed during interpreter finalization, and a rank that
closes its sockets while a peer is still in a collective breaks that peer. So a rank that
succeeded meets its peers at a barrier, destroys the group and exits without
finalization (:func:`leave`), and the parent bounds the run and kills any child left
(:func:`spawn`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def leave() -> None:
    """End a rank whose work succeeded: barrier, destroy the group, exit at once with status 0."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], args: tuple, nprocs: int, *, timeout: float = 300) -> None:
    """``torch.multiprocessing.spawn`` with a deadline; every child is killed and reaped however the run ends.

    Raises what a failing rank raised (``ProcessRaisedException``), or ``TimeoutError``.
    """
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} ranks of {fn.__name__} still running after {timeout:g} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
