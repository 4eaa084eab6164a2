"""Loop references of :mod:`rlcore.data.curriculum`: prompt by prompt, band by band."""

from __future__ import annotations

import math

import torch

__all__ = ["curriculum_probs_ref", "difficulty_bands_ref", "pass_rate_update_ref"]


def pass_rate_update_ref(
    rates: torch.Tensor, index: torch.Tensor, scores: torch.Tensor, *, decay: float, threshold: float
) -> torch.Tensor:
    """Each drawn prompt's share of passing samples, mixed into its rate with weight ``1 - decay``."""
    samples: dict[int, list[float]] = {}
    for p, s in zip(index.tolist(), scores.double().tolist()):
        samples.setdefault(p, []).append(s)
    out = rates.double().tolist()
    for p, ss in samples.items():
        passed = sum(1 for s in ss if math.isfinite(s) and s >= threshold)
        out[p] = decay * out[p] + (1 - decay) * passed / len(ss)
    return torch.tensor(out, dtype=torch.float64)


def curriculum_probs_ref(bands: list[int], weights: list[float]) -> list[float]:
    """Pick a band by its weight among the bands that hold a prompt, then a prompt of it uniformly."""
    members: dict[int, list[int]] = {}
    for i, b in enumerate(bands):
        members.setdefault(b, []).append(i)
    total = sum(weights[b] for b in members)
    probs = [0.0] * len(bands)
    for b, ids in members.items():
        for i in ids:
            probs[i] = weights[b] / total / len(ids) if total > 0 else 1.0 / len(bands)
    return probs


def difficulty_bands_ref(rates: list[float], edges: list[float]) -> list[int]:
    """A prompt's band: how many edges its rate has reached."""
    return [sum(1 for e in edges if r >= e) for r in rates]
