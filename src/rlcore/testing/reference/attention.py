"""Loop reference for packed causal attention: one query, one key at a time, in float64."""

from __future__ import annotations

import math

import torch

__all__ = ["packed_attention_ref"]


def packed_attention_ref(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """``out_i = sum_{j <= i, same sequence} softmax(scale q_i . k_j) v_j``; query head ``h`` reads kv head ``h // (Hq / Hkv)``."""
    q, k, v = query.double().tolist(), key.double().tolist(), value.double().tolist()
    n, hq, d = query.shape
    group = hq // key.shape[1]
    bounds = cu_seqlens.tolist()
    out = [[[0.0] * d for _ in range(hq)] for _ in range(n)]
    for start, end in zip(bounds[:-1], bounds[1:]):
        for i in range(start, end):
            for h in range(hq):
                kv = h // group
                scores = [scale * math.fsum(a * b for a, b in zip(q[i][h], k[j][kv])) for j in range(start, i + 1)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = math.fsum(weights)
                for c in range(d):
                    out[i][h][c] = math.fsum(w * v[j][kv][c] for w, j in zip(weights, range(start, i + 1))) / total
    return torch.tensor(out, dtype=torch.float64).reshape(n, hq, d)
