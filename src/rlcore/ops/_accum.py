"""Accumulation dtype shared by the reductions: float32, or float64 for float64 inputs."""

from __future__ import annotations

import torch

__all__ = ["acc_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every narrower float (and any integer) accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
