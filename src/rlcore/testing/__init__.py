"""Property-testing toolkit: hypothesis strategies and loop-based reference implementations.

Users import these for their own property tests, e.g.
``from rlcore.testing import strategies as rst`` and ``from rlcore.testing import reference``.
"""

from rlcore.testing import asserts, reference, strategies
from rlcore.testing import allocations, token_strategies
from rlcore.testing import loss_strategies
from rlcore.testing import dataflow_strategies
from rlcore.testing import preference_strategies
from rlcore.testing import pipeline_strategies
from rlcore.testing.asserts import assert_close, assert_no_host_sync, tolerances
from rlcore.testing.strategies import (
    float_tensors,
    group_ids,
    grouped_scores,
    logits_and_labels,
    masks,
    token_batches,
)
from rlcore.testing import algo_strategies

__all__ = [
    "algo_strategies",
    "assert_close",
    "assert_no_host_sync",
    "asserts",
    "dataflow_strategies",
    "loss_strategies",
    "float_tensors",
    "group_ids",
    "grouped_scores",
    "logits_and_labels",
    "masks",
    "reference",
    "strategies",
    "token_batches",
    "tolerances",
    "allocations",
    "token_strategies",
    "preference_strategies",
    "pipeline_strategies",
]
