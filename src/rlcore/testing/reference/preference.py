"""Scalar references for the preference losses, straight from the published formulas.

Plus per-sequence references for the DPO recipe: every sequence run through the model
alone, padding stripped, and scored one position at a time.

One pair (or sample) at a time in Python float64 with the naive textbook expressions
(``log(sigmoid(x))``, ``u = exp(l)``, odds ``P / (1 - P)``), so they are accurate for
moderate inputs only; differential tests draw inputs in that range and the
vectorised code is tested separately at the extremes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "cpo_loss_ref",
    "dpo_loss_ref",
    "dpo_step_ref",
    "kto_loss_ref",
    "orpo_loss_ref",
    "pair_logps_ref",
    "sequence_logps_ref",
    "simpo_loss_ref",
]


def _sigmoid(x: float) -> float:
    # Both branches exponentiate a non-positive number: no overflow for any finite x.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _cdpo(x: float, eps: float) -> float:
    return -(1.0 - eps) * _log_sigmoid(x) - eps * _log_sigmoid(-x)


def _floats(*tensors: torch.Tensor) -> list[list[float]]:
    return [t.double().tolist() for t in tensors]


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def sequence_logps_ref(logp: torch.Tensor, mask: torch.Tensor, *, reduce: str = "sum") -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.sequence_logps`, written for clarity."""
    out = []
    for row, m in zip(logp.double().tolist(), mask.double().tolist()):
        picked = [v for v, w in zip(row, m) if w != 0]
        total = math.fsum(picked)
        out.append(total if reduce == "sum" else (total / len(picked) if picked else 0.0))
    return _t(out)


def _score(logratio: float, divergence: str, alpha: float) -> float:
    """f'(u) - f'(1) for u = pi / pi_ref, f-DPO (arXiv:2309.16240), Table 1."""
    u = math.exp(logratio)
    if divergence == "reverse_kl":  # f'(u) = log u + 1
        return math.log(u)
    if divergence == "forward_kl":  # f'(u) = -1/u
        return -1.0 / u + 1.0
    if divergence == "js":  # f'(u) = log(2u / (1 + u))
        return math.log(2.0 * u / (1.0 + u))
    return (1.0 - u ** (-alpha)) / alpha  # alpha-divergence


def dpo_loss_ref(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    divergence: str = "reverse_kl",
    alpha: float = 0.5,
    discopop_tau: float = 0.05,
    bco_delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss [B], chosen_rewards [B], rejected_rewards [B])`` in float64."""
    pw, pl, rw, rl = _floats(pi_chosen, pi_rejected, ref_chosen, ref_rejected)
    n = len(pw)
    eps = label_smoothing
    sc = [_score(pw[i] - rw[i], divergence, alpha) for i in range(n)]
    sr = [_score(pl[i] - rl[i], divergence, alpha) for i in range(n)]
    if loss_type == "aot":
        pol = sorted(pw[i] - pl[i] for i in range(n))
        ref = sorted(rw[i] - rl[i] for i in range(n))
        losses = [_cdpo(beta * (pol[i] - ref[i]), eps) for i in range(n)]
    elif loss_type == "aot_pair":
        cs, rs = sorted(sc), sorted(sr)
        losses = [_cdpo(beta * (cs[i] - rs[i]), eps) for i in range(n)]
    else:
        if loss_type == "bco_pair" and bco_delta is None:
            bco_delta = math.fsum(beta * s for s in sc + sr) / (2 * n)
        losses = [_pair_ref(loss_type, sc[i], sr[i], beta, eps, discopop_tau, bco_delta) for i in range(n)]
    return _t(losses), _t([beta * s for s in sc]), _t([beta * s for s in sr])


def _pair_ref(loss_type: str, sc: float, sr: float, beta: float, eps: float, tau: float, delta: float | None) -> float:
    h = sc - sr
    x = beta * h
    if loss_type == "sigmoid":  # DPO eq. 7; cDPO for eps > 0
        return _cdpo(x, eps)
    if loss_type == "robust":  # rDPO, arXiv:2403.00409 eq. 8
        return ((1 - eps) * -_log_sigmoid(x) - eps * -_log_sigmoid(-x)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return max(0.0, 1.0 - x)
    if loss_type == "ipo":  # IPO eq. 17
        return (h - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "exo_pair":  # EXO eq. 16, K = 2: KL(q_theta || p_target)
        q = [_sigmoid(x), _sigmoid(-x)]
        p = [1.0 - eps, eps]
        return sum(qi * math.log(qi / pi) for qi, pi in zip(q, p) if qi > 0)
    if loss_type == "nca_pair":
        cr, rr = beta * sc, beta * sr
        return -_log_sigmoid(cr) - 0.5 * (_log_sigmoid(-cr) + _log_sigmoid(-rr))
    if loss_type == "bco_pair":
        assert delta is not None
        return -_log_sigmoid(beta * sc - delta) - _log_sigmoid(-(beta * sr - delta))
    if loss_type == "sppo_hard":  # SPPO eq. 4.7 with P(y_w > y_l) = 1
        return (sc - 0.5 / beta) ** 2 + (sr + 0.5 / beta) ** 2
    if loss_type == "apo_zero":  # APO eq. 7
        return 1.0 - _sigmoid(beta * sc) + _sigmoid(beta * sr)
    if loss_type == "apo_down":  # APO eq. 8
        return _sigmoid(beta * sc) + 1.0 - _sigmoid(x)
    if loss_type == "discopop":  # DiscoPOP eq. 5 (log-ratio modulated loss)
        m = _sigmoid(x / tau)
        return (1.0 - m) * -_log_sigmoid(x) + m * math.exp(-x)
    raise ValueError(f"loss_type: got {loss_type!r}")


def simpo_loss_ref(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.simpo_loss`, written for clarity."""
    pw, pl = _floats(pi_chosen, pi_rejected)
    return _t([_cdpo(beta * w - beta * r - gamma, label_smoothing) for w, r in zip(pw, pl)])


def cpo_loss_ref(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    beta: float = 0.1,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Loop reference of :func:`rlcore.algos.cpo_loss`, written for clarity."""
    pw, pl, nll = _floats(pi_chosen, pi_rejected, chosen_nll)
    return _t([_cdpo(beta * (w - r), label_smoothing) + alpha * n for w, r, n in zip(pw, pl, nll)])


def orpo_loss_ref(
    pi_chosen: torch.Tensor, pi_rejected: torch.Tensor, chosen_nll: torch.Tensor, *, lam: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [B], log_odds_ratio [B])``: odds = P / (1 - P) with P = exp(mean log-prob)."""
    pw, pl, nll = _floats(pi_chosen, pi_rejected, chosen_nll)
    losses, ratios = [], []
    for w, r, n in zip(pw, pl, nll):
        odds_w = math.exp(w) / (1.0 - math.exp(w))
        odds_l = math.exp(r) / (1.0 - math.exp(r))
        ratio = math.log(odds_w / odds_l)
        ratios.append(ratio)
        losses.append(n - lam * _log_sigmoid(ratio))
    return _t(losses), _t(ratios)


def kto_loss_ref(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    desirable: torch.Tensor,
    kl_logp: torch.Tensor,
    kl_ref_logp: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, float]:
    """``(loss [B], z)``: KTO eq. 8, loss = lambda_y - v(x, y)."""
    lp, rp, klp, klr = _floats(logp, ref_logp, kl_logp, kl_ref_logp)
    z = max(0.0, math.fsum(a - b for a, b in zip(klp, klr)) / len(klp))
    losses = []
    for a, b, good in zip(lp, rp, desirable.bool().tolist()):
        r = a - b
        if good:
            losses.append(desirable_weight - desirable_weight * _sigmoid(beta * (r - z)))
        else:
            losses.append(undesirable_weight - undesirable_weight * _sigmoid(beta * (z - r)))
    return _t(losses), z


def pair_logps_ref(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch: dict,
    *,
    reduce: str = "sum",
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen [B], rejected [B])`` float64 sequence log-probs, one unpadded sequence per forward.

    Stays differentiable in the model's parameters (torch ops on its logits), so
    gradients of the one-pass recipe can be compared with it.
    """
    out = []
    for side in ("chosen", "rejected"):
        ids, attention, mask = batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"], batch[f"{side}_mask"]
        values = []
        for b in range(ids.shape[0]):
            n = int(attention[b].sum())  # right padding: the real tokens come first
            seq = ids[b, :n].unsqueeze(0)
            logits = model(seq, torch.ones_like(seq)).double()[0] / temperature
            terms = [torch.log_softmax(logits[t - 1], dim=-1)[seq[0, t]] for t in range(1, n) if mask[b, t] != 0]
            total = torch.stack(terms).sum() if terms else logits.new_zeros(())
            values.append(total / len(terms) if reduce == "mean" and terms else total)
        out.append(torch.stack(values))
    return out[0], out[1]


def dpo_step_ref(
    policy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch: dict,
    reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    *,
    reduce: str = "sum",
    temperature: float = 1.0,
    num_pairs: int | None = None,
    **loss_options: Any,
) -> float:
    """The recipe's loss: per-sequence log-probs, the scalar DPO-family loss, summed over ``num_pairs``."""
    with torch.no_grad():
        pc, pr = pair_logps_ref(policy, batch, reduce=reduce, temperature=temperature)
        if reference is None:
            rc, rr = batch["ref_chosen_logps"].double(), batch["ref_rejected_logps"].double()
        else:
            rc, rr = pair_logps_ref(reference, batch, reduce=reduce, temperature=temperature)
    losses = dpo_loss_ref(pc, pr, rc, rr, **loss_options)[0].tolist()
    return math.fsum(losses) / (num_pairs or len(losses))
