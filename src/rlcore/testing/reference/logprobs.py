"""Loop references for token log-probs, entropy and the hidden x output-embedding path.

One token and one vocabulary entry at a time, in float64 Python arithmetic with
``math.fsum``: the obviously correct version of the formulas the chunked and
blocked kernels compute.
"""

from __future__ import annotations

import math

import torch

__all__ = ["entropy_ref", "linear_logprobs_ref", "logprobs_ref", "sum_pi_squared_ref"]


def _row_stats(row: list[float], temperature: float) -> tuple[list[float], float, float]:
    """``(x / T, logsumexp, entropy)`` of one row; ``-inf`` entries have probability 0."""
    x = [v / temperature for v in row]
    m = max(x)
    lse = m + math.log(math.fsum(math.exp(v - m) for v in x))
    ent = -math.fsum(math.exp(v - lse) * (v - lse) for v in x if v != -math.inf)
    return x, lse, ent


def logprobs_ref(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` of ``logits [..., V]`` at ``labels [...]``, in float64."""
    lead = logits.shape[:-1]
    rows = logits.double().reshape(-1, logits.shape[-1]).tolist()
    ys = labels.reshape(-1).tolist()
    logp, ent = [], []
    for row, y in zip(rows, ys):
        x, lse, h = _row_stats(row, temperature)
        logp.append(x[y] - lse)
        ent.append(h)
    return torch.tensor(logp, dtype=torch.float64).reshape(lead), torch.tensor(ent, dtype=torch.float64).reshape(lead)


def entropy_ref(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of each row of ``logits [..., V]``, in float64."""
    rows = logits.double().reshape(-1, logits.shape[-1]).tolist()
    ent = [_row_stats(row, temperature)[2] for row in rows]
    return torch.tensor(ent, dtype=torch.float64).reshape(logits.shape[:-1])


def sum_pi_squared_ref(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """``sum_v softmax(logits / T)[v]^2`` of each row of ``logits [..., V]``, one entry at a time, in float64."""
    out = []
    for row in logits.double().reshape(-1, logits.shape[-1]).tolist():
        x, lse, _ = _row_stats(row, temperature)
        out.append(math.fsum(math.exp(2 * (v - lse)) for v in x))
    return torch.tensor(out, dtype=torch.float64).reshape(logits.shape[:-1])


def linear_logprobs_ref(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` with the logits ``hidden @ weight.T`` built one dot product at a time."""
    hs = hidden.double().reshape(-1, hidden.shape[-1]).tolist()
    ws = weight.double().tolist()
    logits = [[math.fsum(a * b for a, b in zip(h, w)) for w in ws] for h in hs]
    flat = torch.tensor(logits, dtype=torch.float64).reshape(*hidden.shape[:-1], len(ws))
    return logprobs_ref(flat, labels, temperature=temperature)
