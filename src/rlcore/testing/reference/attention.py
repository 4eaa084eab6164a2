"""Loop references for attention: one query, one key at a time, in float64."""

from __future__ import annotations

import math

import torch

__all__ = ["masked_attention_ref", "packed_attention_ref"]


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


def masked_attention_ref(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``out[b, h, t] = sum_{s allowed} softmax_s(scale q . k_s) v_s``, zeros for a query with no allowed key.

    ``query`` ``[B, H, T, D]``, ``key`` / ``value`` ``[B, KV, S, D]`` (query head ``h``
    reads kv head ``h // (H / KV)``), ``mask`` bool broadcastable to ``[B, H, T, S]``.
    """
    b, h, t, d = query.shape
    kv, s = key.shape[1], key.shape[2]
    group = h // kv
    allowed = mask.expand(b, h, t, s).tolist()
    q, k, v = query.double().tolist(), key.double().tolist(), value.double().tolist()
    out = torch.zeros(b, h, t, d, dtype=torch.float64)
    for i in range(b):
        for head in range(h):
            j = head // group
            for row in range(t):
                keys = [c for c in range(s) if allowed[i][head][row][c]]
                if not keys:
                    continue
                scores = [scale * math.fsum(x * y for x, y in zip(q[i][head][row], k[i][j][c])) for c in keys]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = math.fsum(weights)
                for e in range(d):
                    out[i, head, row, e] = math.fsum(w * v[i][j][c][e] for w, c in zip(weights, keys)) / total
    return out
