"""Checkpoints written atomically, so an interrupted save (Ctrl-C, a crash) leaves the last good one loadable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT_NAME", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(output_dir: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``output_dir/checkpoint.pt``: a temporary file, fsync, then an atomic rename.

    ``os.replace`` is atomic on POSIX and Windows, so a reader sees either the previous
    checkpoint or the new one, never a half-written file.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = save_checkpoint(d, {"step": 3})
    >>> load_checkpoint(d)["step"]
    3
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / CHECKPOINT_NAME
    tmp = out / f".{CHECKPOINT_NAME}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def load_checkpoint(output_dir: str | os.PathLike) -> dict[str, Any]:
    """Load ``output_dir/checkpoint.pt`` (on the CPU); ``ValueError`` naming the path if there is none."""
    path = Path(output_dir) / CHECKPOINT_NAME
    if not path.is_file():
        raise ValueError(f"resume: no checkpoint at {str(path)!r}; run without --resume first")
    return torch.load(path, map_location="cpu", weights_only=False)
