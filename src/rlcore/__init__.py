"""rlcore: functional reinforcement-learning post-training for LLMs on PyTorch.

Algorithms are pure functions over pytree batches (:mod:`rlcore.algos`) built on
tensor primitives (:mod:`rlcore.ops`); systems concerns are separate transforms
(:mod:`rlcore.dataflow`, :mod:`rlcore.memory`), imported on first use like
:mod:`rlcore.models`, :mod:`rlcore.rewards`, :mod:`rlcore.train` and
:mod:`rlcore.testing` (hypothesis strategies and loop references; it needs the
``test`` extra).
"""

from __future__ import annotations

import importlib
from typing import Any

from rlcore import algos, device, ops, pytree, seeding

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "agent",
    "algos",
    "data",
    "dataflow",
    "device",
    "memory",
    "models",
    "ops",
    "pytree",
    "references",
    "rewards",
    "seeding",
    "testing",
    "train",
]

# Imported on first use: they pull in heavier or optional packages (hypothesis for
# testing; datasets, transformers, YAML, plotting and process pools for data, models,
# rewards, train; the dock, scheduler and collectives of dataflow and memory; threads
# and the rollout loop for agent), none of which the maths (algos, ops) needs:
# ``import rlcore.algos`` loads the tensor primitives only.
_LAZY = {"agent", "data", "dataflow", "memory", "models", "references", "rewards", "testing", "train"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"rlcore.{name}")
    raise AttributeError(f"module 'rlcore' has no attribute {name!r}")
