"""Assertions shared by differential tests: dtype-aware closeness and the no-host-sync proof."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlcore.pytree import tree_leaves

__all__ = ["assert_close", "assert_no_host_sync", "tolerances"]

_TOL = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for results computed in ``dtype`` and compared with a float64 reference."""
    return _TOL.get(dtype, (0.0, 0.0))


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None, scale: float = 1.0, msg: str = ""
) -> None:
    """Compare ``actual`` with a (float64) reference at the tolerance of ``dtype``.

    ``scale`` multiplies the absolute tolerance, for values whose magnitude is known
    to be large. NaNs must match exactly.
    """
    rtol, atol = tolerances(dtype or actual.dtype)
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=rtol, atol=atol * scale, equal_nan=True, msg=msg or None
    )


def assert_no_host_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` under ``torch.compile(fullgraph=True)`` and check it matches eager.

    A host sync (``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero()``, data-dependent
    Python control flow) is a graph break, which ``fullgraph=True`` turns into an
    error. The eager backend keeps the proof fast: it traces with dynamo but does not
    generate kernels. Returns the compiled result.
    """
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    got = compiled(*args, **kwargs)
    want = fn(*args, **kwargs)
    for g, w in zip(tree_leaves(got), tree_leaves(want)):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, equal_nan=True)
    return got
