"""Property-testing toolkit: hypothesis strategies and loop-based reference implementations.

Users import these for their own property tests, e.g.
``from rlcore.testing import strategies as rst`` and ``from rlcore.testing import reference``.
"""

from rlcore.testing import (
    algo_strategies,
    allocations,
    asserts,
    dataflow_strategies,
    hf_fixtures,
    loss_strategies,
    pipeline_strategies,
    preference_strategies,
    reference,
    strategies,
    token_strategies,
)
from rlcore.testing.asserts import assert_close, assert_no_host_sync, tolerances
from rlcore.testing.strategies import (
    float_tensors,
    group_ids,
    grouped_scores,
    logits_and_labels,
    masks,
    token_batches,
)

__all__ = [
    "algo_strategies",
    "allocations",
    "assert_close",
    "assert_no_host_sync",
    "asserts",
    "dataflow_strategies",
    "float_tensors",
    "group_ids",
    "grouped_scores",
    "hf_fixtures",
    "logits_and_labels",
    "loss_strategies",
    "masks",
    "pipeline_strategies",
    "preference_strategies",
    "reference",
    "strategies",
    "token_batches",
    "token_strategies",
    "tolerances",
]
