"""Property-testing toolkit: hypothesis strategies and loop-based reference implementations.

Users import these for their own property tests, e.g.
``from rlcore.testing import strategies as rst`` and ``from rlcore.testing import reference``.

The strategies need hypothesis, from the ``test`` extra: ``pip install "rlcore[test]"``.

Hypothesis deadline: hypothesis fails an example that runs longer than its ``deadline``
(200 ms by default) and reports it as ``DeadlineExceeded`` or ``Flaky``. The first call
of a torch function (kernel selection, lazy initialisation, ``torch.compile``) and a
loaded machine both exceed it without anything being wrong, so turn the deadline off
for tests of tensor code -- per test with ``@settings(deadline=None)``, or for the whole
suite in ``conftest.py``::

    from hypothesis import settings

    settings.register_profile("torch", deadline=None)
    settings.load_profile("torch")
"""

try:
    import hypothesis  # noqa: F401
except ModuleNotFoundError as err:
    raise ModuleNotFoundError(
        f'rlcore.testing needs {err.name or "hypothesis"}, which comes with the test extra: pip install "rlcore[test]"',
        name=err.name,
    ) from err

from rlcore.testing import (
    algo_strategies,
    allocations,
    asserts,
    chaos,
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
    "chaos",
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
