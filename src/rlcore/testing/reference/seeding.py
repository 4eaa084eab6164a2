"""Loop references for the seeding rule and the sampling step: Python integers and float64, one row at a time."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from rlcore.testing.reference.rollout import filter_logits_ref

__all__ = ["row_uniform_ref", "sample_token_ref"]

_M32 = 2**32 - 1


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def row_uniform_ref(seed: int, purpose: int, step: int, row: int, position: int, draw: int = 0) -> float:
    """The uniform of one ``(seed, purpose, step, row, position, draw)``: BLAKE2b key, then a MurmurHash3-finaliser chain."""
    text = ",".join(str(int(w)) for w in (seed, purpose, step))
    key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8, person=b"rlcore").digest(), "little")
    h = 0
    for word in (key & _M32, key >> 32, row & _M32, row >> 32, position & _M32, draw & _M32):
        h = _fmix32(((h ^ word) + 0x9E3779B9) & _M32)
    return (h >> 8) / 2**24


def sample_token_ref(
    logits: Sequence[float], u: float, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> int:
    """Inverse-CDF draw from one row: the first kept token whose cumulative probability (float64) passes ``u``.

    ``temperature=0`` is the arg-max (the first one on ties).
    """
    if temperature == 0:
        return max(range(len(logits)), key=lambda j: (logits[j], -j))
    scaled = torch.tensor([[v / temperature for v in logits]], dtype=torch.float64)
    kept = filter_logits_ref(scaled, top_k=top_k, top_p=top_p)[0].tolist()
    top = max(kept)
    weights = [math.exp(v - top) if v != -math.inf else 0.0 for v in kept]
    target = u * sum(weights)
    mass = 0.0
    for j, w in enumerate(weights):
        mass += w
        if w > 0 and mass > target:
            return j
    return max(j for j, w in enumerate(weights) if w > 0)
