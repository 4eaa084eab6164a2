"""The peers' own implementations for the benchmarks, imported only when present.

verl 0.9.1's ``core_algos`` is not a dependency of rlcore: install it (and TRL 1.16)
without dependencies into a folder of its own and put that folder on ``PYTHONPATH``,
as for the peer checks in ``peers/`` (see the README). A benchmark whose peer is
absent prints that it was skipped.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["PeerConfig", "actor_config", "peer"]


def peer(module: str) -> ModuleType | None:
    """``module`` imported, or ``None`` (with a line saying so) when it or one of its imports is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        print(f"  (skipped: {module} is not importable: {err}; see the README's peer checks)", flush=True)
        return None


class PeerConfig(dict):
    """The attribute-and-``get`` access verl's losses make of their actor config."""

    def __getattr__(self, key: str) -> Any:
        return self[key]

    def get(self, key: str, default: Any = None) -> Any:
        return dict.get(self, key, default)


def actor_config(clip: float, *, clip_c: float = 20.0, **policy_loss: Any) -> PeerConfig:
    """verl's actor config as its policy losses read it: the clip range, ``clip_ratio_c`` and ``policy_loss.*``."""
    return PeerConfig(
        clip_ratio=clip,
        clip_ratio_low=None,
        clip_ratio_high=None,
        clip_ratio_c=clip_c,
        global_batch_info={},
        policy_loss=PeerConfig(policy_loss),
    )
