"""Distillation losses: the per-token reverse KL to a teacher on the student's samples, and GKD's generalised JSD.

Both return ``(loss_t, metrics)`` like the policy losses: the per-token loss ``[B, T]``
(0 where ``mask`` is 0) in the dtype of the student's input and a dict of detached
float32 scalars, so :func:`rlcore.algos.aggregate` reduces them with any normalisation.
The teacher is data: nothing is differentiated through its log-probs or logits.
"""

from __future__ import annotations

import math

import torch

from rlcore._checks import check_counts, check_floating, check_ndim, check_positive, check_same_shape, check_shape
from rlcore.ops import acc_dtype

__all__ = ["generalized_jsd_loss", "reverse_kl_distill_loss"]

Metrics = dict[str, torch.Tensor]

_MAX_LOG_RATIO = 20.0


def _keep_and_total(mask: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keep, weights, total)``: counted tokens, the mask as weights, and their total (1 for an empty mask)."""
    if mask.dtype != torch.bool:
        check_counts("mask", mask)
    keep = mask if mask.dtype == torch.bool else mask != 0
    weights = torch.where(keep, mask.to(acc), 0.0)
    total = weights.sum()
    return keep, weights, torch.where(total > 0, total, 1.0)


def reverse_kl_distill_loss(
    logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token on-policy distillation loss: the reverse KL to the teacher on the student's own tokens.

    Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (GKD), arXiv:2306.13649, with the reverse KL (``beta = 1``)
    estimated from the sampled tokens only, as in Qwen3's strong-to-weak distillation
    (arXiv:2505.09388) and Thinking Machines' "On-Policy Distillation" (2025): the teacher scores the
    tokens the student sampled, one log-prob each, no full-vocabulary logits.

    Formula, with ``d_t = logp_t - teacher_logp_t`` (the one-sample estimate of the
    token's ``KL(pi || pi_teacher)``) and ``w_t = exp(logp_t - old_logp_t)`` (1 when
    ``old_logp`` is ``None``: the tokens were sampled by the current student)::

        value    loss_t = sg(w_t d_t)
        gradient        = w_t d_t * d logp_t

    The gradient is the score-function estimate of the token-level reverse KL's
    gradient, ``E_pi[(log pi - log pi_T) grad log pi]`` (the ``+1`` of the exact
    derivative has expectation 0); the value is the KL estimate itself, for logging. It
    equals a REINFORCE step with the per-token reward ``-d_t`` and no credit to earlier
    tokens (a discount of 0), the Thinking Machines form. ``w`` is detached, its log
    clamped to ``[-20, 20]``.

    Args:
      logp: ``[B, T]`` the student's log-probs of its sampled tokens (with gradient).
      teacher_logp: ``[B, T]`` the teacher's log-probs of the same tokens.
      mask: ``[B, T]``, 1 where a token counts.
      old_logp: ``[B, T]`` the sampling student's log-probs, for updates on stale
        samples; ``None`` when ``logp`` is the sampling policy.

    Returns:
      ``(loss_t, metrics)``: ``loss_t`` ``[B, T]`` in ``logp.dtype``; ``reverse_kl`` is the
      mean of ``d_t`` over the counted tokens.

    >>> lp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    >>> loss, m = reverse_kl_distill_loss(lp, torch.tensor([[-1.5, -0.5]]), torch.ones(1, 2))
    >>> loss.detach(), m["reverse_kl"]
    (tensor([[ 1.0000, -0.5000]]), tensor(0.2500))
    >>> loss.sum().backward(); lp.grad
    tensor([[ 1.0000, -0.5000]])
    """
    check_floating("logp", logp)
    check_ndim("logp", logp, 2)
    check_floating("teacher_logp", teacher_logp)
    check_same_shape("teacher_logp", teacher_logp, "logp", logp)
    check_same_shape("mask", mask, "logp", logp)
    if old_logp is not None:
        check_floating("old_logp", old_logp)
        check_same_shape("old_logp", old_logp, "logp", logp)
    acc = acc_dtype(logp.dtype)
    keep, weights, total = _keep_and_total(mask, acc)
    lp = torch.where(keep, logp.to(acc), 0.0)
    with torch.no_grad():
        d = lp.detach() - torch.where(keep, teacher_logp.detach().to(acc), 0.0)
        if old_logp is None:
            signal = d
        else:
            log_w = lp.detach() - torch.where(keep, old_logp.detach().to(acc), 0.0)
            signal = log_w.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp() * d
    loss = signal + signal * (lp - lp.detach())
    metrics = {"reverse_kl": ((d * weights).sum() / total).float()}
    return loss.to(logp.dtype), metrics


def _zero_where_not(cond: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` where ``cond``, else 0 (a 0-dim zero of ``x``'s dtype: ``torch.where`` with a Python float
    takes a slower casting loop on the CPU)."""
    return torch.where(cond, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """``sum_v p (log p - log q)`` over the last axis; a token with ``p = 0`` adds 0, to the value and the gradient.

    The difference is zeroed where ``p = 0`` before it is multiplied: ``0 * (-inf)`` would be
    ``nan`` in the gradient (a logit of ``-inf``, a masked vocabulary entry, has ``p = 0``).
    """
    p = p_log.exp()
    return (p * _zero_where_not(p > 0, p_log - q_log)).sum(-1)


class _ReverseKL(torch.autograd.Function):
    """``KL(S || T)`` per position (:func:`_kl`) from the student's logits ``z`` and the teacher's log-probs,
    with one fused backward.

    With ``p = softmax(z)`` and ``d = log p - log q`` (0 where ``p = 0``), the gradient is
    ``p * (d - KL)``. The forward saves only its inputs and the KL, and the backward
    recomputes ``p`` and ``d`` and takes that product, where autograd of the formula keeps
    several ``[B, T, V]`` tensors and takes a pass per op of the exp, the guard, the
    product and the log-softmax.
    """

    @staticmethod
    def forward(z: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _kl(z.log_softmax(-1), q_log)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        z, q_log = inputs
        ctx.save_for_backward(z, q_log, output)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[no-untyped-def,override]
        z, q_log, kl = ctx.saved_tensors
        s = z.log_softmax(-1)
        p = s.exp()
        d = _zero_where_not(p > 0, s.sub_(q_log).sub_(kl[..., None]))
        return d.mul_(p).mul_(g[..., None]), None


def _kl_finite(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """``sum_v p (log p - log q)`` for finite log-probabilities (where ``p`` underflows to 0, the term is 0)."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def check_jsd_options(
    beta: float, top_k: int | None, *, vocab: int | None = None, names: tuple[str, str] = ("beta", "top_k")
) -> None:
    """:func:`generalized_jsd_loss`'s ``beta`` in ``[0, 1]`` and ``top_k`` None or in ``[1, vocab]`` (``vocab`` None: unbounded).

    ``names``: what the errors call the two (e.g. the config keys that hold them).
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"{names[0]}: got {beta!r}, expected a number in [0, 1]")
    bad = isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1 or (vocab is not None and top_k > vocab)
    if top_k is not None and bad:
        bound = f"in [1, {vocab}] (the vocabulary size)" if vocab is not None else ">= 1"
        raise ValueError(f"{names[1]}: got {top_k!r}, expected None or an int {bound}")


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token generalised Jensen-Shannon divergence between teacher and student (GKD).

    Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (GKD), arXiv:2306.13649, eq. 1; TRL's
    ``GKDTrainer.generalized_jsd_loss`` (defaults ``beta=0.5``, ``temperature=1``; TRL's
    trainer config samples at 0.9 and passes that temperature here too).

    Formula, per token, with ``S = softmax(student_logits / temperature)``, ``T`` the
    teacher's likewise and ``M = beta T + (1 - beta) S``::

        JSD(beta) = beta KL(T || M) + (1 - beta) KL(S || M)       0 < beta < 1
                  = KL(T || S)     (forward KL)                    beta = 0
                  = KL(S || T)     (reverse KL)                    beta = 1

    The endpoints are the KLs themselves, as in TRL; the interior formula tends to 0 at
    both ends (``JSD(beta) ~ beta KL(T || S)`` near 0 and ``(1 - beta) KL(S || T)`` near
    1), so the loss's scale jumps by a factor ``1 / beta`` at ``beta = 0`` (``1 / (1 -
    beta)`` at 1). With ``top_k`` both distributions are restricted to the teacher's
    ``k`` most likely tokens at each position and renormalised there. Computed in
    float32 (float64 for float64 logits) over the whole ``[B, T, V]``. A logit of ``-inf``
    on both sides (a masked vocabulary entry) adds 0 and gets gradient 0 (TRL's loss is
    ``nan`` there).

    Args:
      student_logits: ``[B, T, V]`` the student's logits (with gradient).
      teacher_logits: ``[B, T, V]`` the teacher's logits at the same positions (detached).
      mask: ``[B, T]``, 1 where a token counts.
      beta: the interpolation ``beta`` in ``[0, 1]``.
      temperature: softmax temperature (> 0) applied to both.
      top_k: the teacher's top-``k`` support (``1 <= k <= V``), or ``None`` for the full vocabulary.

    Returns:
      ``(loss_t, metrics)``: ``loss_t`` ``[B, T]`` in ``student_logits.dtype``; ``jsd`` is its
      mean over the counted tokens.

    >>> s = torch.tensor([[[0.0, 0.0]]])
    >>> t = torch.tensor([[[0.0, math.log(3.0)]]])
    >>> [round(float(generalized_jsd_loss(s, t, torch.ones(1, 1), beta=b)[0]), 4) for b in (0.0, 0.5, 1.0)]
    [0.1308, 0.0338, 0.1438]
    """
    check_floating("student_logits", student_logits)
    check_ndim("student_logits", student_logits, 3)
    check_floating("teacher_logits", teacher_logits)
    check_same_shape("teacher_logits", teacher_logits, "student_logits", student_logits)
    check_shape("mask", mask, student_logits.shape[:2], what="[B, T] of the logits")
    check_positive("temperature", temperature, finite=True)
    check_jsd_options(beta, top_k, vocab=student_logits.shape[-1])
    acc = acc_dtype(student_logits.dtype)
    keep, weights, total = _keep_and_total(mask, acc)
    # Padding may hold nan: it reaches neither a value nor a gradient. The student's padding is
    # zeroed before anything reads it; the teacher's reaches only padded positions' values, which
    # the last where drops, and their gradients, which the student's where drops.
    student = _zero_where_not(keep[..., None], student_logits.to(acc))
    teacher = teacher_logits.detach().to(acc)
    if temperature != 1.0:
        student, teacher = student / temperature, teacher / temperature
    if top_k is not None:
        support = teacher.topk(top_k, dim=-1).indices
        student, teacher = student.gather(-1, support), teacher.gather(-1, support)
    t = teacher.log_softmax(-1)
    if beta == 0.0:
        jsd = _kl(t, student.log_softmax(-1))
    elif beta == 1.0:
        jsd = _ReverseKL.apply(student, t)
    else:
        s = student.log_softmax(-1)
        # Between the endpoints M covers both supports, so every term is finite: a log-prob of
        # -inf (p = 0) is raised to the lowest finite value, where it adds 0 and gets gradient 0
        # (logaddexp of two -inf would give nan gradients).
        lowest = torch.finfo(s.dtype).min
        s, t = s.clamp(min=lowest), t.clamp(min=lowest)
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        jsd = beta * _kl_finite(t, m) + (1.0 - beta) * _kl_finite(s, m)
    loss = torch.where(keep, jsd, 0.0)
    metrics = {"jsd": ((loss.detach() * weights).sum() / total).float()}
    return loss.to(student_logits.dtype), metrics
