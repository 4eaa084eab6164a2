"""A checkpoint version kept from a background save, checked against a synchronous save of the same step."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from rlcore.train import CHECKPOINT_NAME, load_checkpoint


def _leaves(tree, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}.{k}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def assert_kept_equals_sync(kept_version: Path, ours: Path, sync_run: Path) -> None:
    """Install ``kept_version`` as the one version of run directory ``ours``; its policy and reference equal,
    bit for bit, those of the latest version of ``sync_run`` (a run that saved synchronously)."""
    shutil.copytree(kept_version, ours / CHECKPOINT_NAME / kept_version.name)
    (ours / CHECKPOINT_NAME / "latest").write_text(f"{kept_version.name}\n")
    a, b = load_checkpoint(ours), load_checkpoint(sync_run)
    for name in ("policy", "reference"):
        flat_a, flat_b = dict(_leaves(a[name])), dict(_leaves(b[name]))
        assert flat_a.keys() == flat_b.keys() and flat_a
        for k, v in flat_a.items():
            assert torch.equal(v, flat_b[k]), (name, k)
