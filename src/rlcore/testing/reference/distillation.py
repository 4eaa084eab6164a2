"""Loop references for :mod:`rlcore.algos.distillation`, one token at a time in float64."""

from __future__ import annotations

import math

import torch

__all__ = ["generalized_jsd_loss_ref", "reverse_kl_distill_loss_ref"]


def reverse_kl_distill_loss_ref(
    logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(loss_t, grad_t, metrics)``: value ``w d``, gradient ``w d`` with ``d = logp - teacher_logp``."""
    lps, tls, ms = logp.double().tolist(), teacher_logp.double().tolist(), mask.double().tolist()
    olps = old_logp.double().tolist() if old_logp is not None else None
    loss = [[0.0] * len(r) for r in ms]
    ds = []
    for i, row in enumerate(ms):
        for t, m in enumerate(row):
            if m == 0:
                continue
            d = lps[i][t] - tls[i][t]
            w = 1.0 if olps is None else math.exp(min(max(lps[i][t] - olps[i][t], -20.0), 20.0))
            loss[i][t] = w * d
            ds.append(d)
    out = torch.tensor(loss, dtype=torch.float64).reshape(mask.shape)
    return out, out.clone(), {"reverse_kl": math.fsum(ds) / len(ds) if ds else 0.0}


def _softmax_log(xs: list[float]) -> list[float]:
    top = max(xs)
    z = top + math.log(math.fsum(math.exp(x - top) for x in xs))
    return [x - z for x in xs]


def _kl(p: list[float], q: list[float]) -> float:
    return math.fsum(math.exp(a) * (a - b) for a, b in zip(p, q) if a > -math.inf)


def generalized_jsd_loss_ref(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> torch.Tensor:
    """Per-token generalised JSD; the mixture built from probabilities, the KLs as sums."""
    ss, ts, ms = student_logits.double().tolist(), teacher_logits.double().tolist(), mask.double().tolist()
    out = [[0.0] * len(r) for r in ms]
    for i, row in enumerate(ms):
        for t, m in enumerate(row):
            if m == 0:
                continue
            sv = [x / temperature for x in ss[i][t]]
            tv = [x / temperature for x in ts[i][t]]
            if top_k is not None:
                keep = sorted(range(len(tv)), key=lambda v: (-tv[v], v))[:top_k]
                sv, tv = [sv[v] for v in keep], [tv[v] for v in keep]
            s, q = _softmax_log(sv), _softmax_log(tv)
            if beta == 0.0:
                out[i][t] = _kl(q, s)
            elif beta == 1.0:
                out[i][t] = _kl(s, q)
            else:
                mix = [math.log(beta * math.exp(b) + (1.0 - beta) * math.exp(a)) for a, b in zip(s, q)]
                out[i][t] = beta * _kl(q, mix) + (1.0 - beta) * _kl(s, mix)
    return torch.tensor(out, dtype=torch.float64).reshape(mask.shape)
