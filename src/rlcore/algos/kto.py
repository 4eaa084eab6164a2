"""KTO: the prospect-theoretic loss over unpaired desirable / undesirable responses."""

from __future__ import annotations

import torch

from rlcore._checks import check_positive, check_same_shape, host_readable
from rlcore.algos.preference import check_sequences
from rlcore.ops import acc_dtype, masked_mean

__all__ = ["kto_loss"]


def _check_labels(desirable: torch.Tensor) -> None:
    """Labels are bool or exactly 0 / 1: read only on CPU tensors in eager mode (``bool()`` would make 0.5 True)."""
    if desirable.dtype == torch.bool or desirable.dtype.is_complex or not host_readable(desirable):
        return
    odd = desirable[(desirable != 0) & (desirable != 1)]
    if odd.numel():
        raise ValueError(
            f"desirable: got {odd[0].item()!r}, expected bool labels or 0/1 (True / 1 for a desirable response)"  # sync-ok: a CPU tensor in eager mode (host_readable), error path only
        )


def kto_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    desirable: torch.Tensor,
    kl_logp: torch.Tensor,
    kl_ref_logp: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO loss per sample, against the batch KL reference point.

    Ethayarajh et al., 2024, "KTO: Model Alignment as Prospect Theoretic
    Optimization", arXiv:2402.01306. With ``r = logp - ref_logp`` and the reference
    point ``z = max(0, mean(kl_logp - kl_ref_logp))`` (not back-propagated)::

        loss = lambda_D * (1 - sigmoid(beta (r - z)))   for a desirable response
        loss = lambda_U * (1 - sigmoid(beta (z - r)))   for an undesirable one

    ``1 - sigmoid(u)`` is computed as ``sigmoid(-u)``, exact where ``sigmoid(u)`` rounds
    to 1. The paper estimates ``z`` on mismatched pairs: completion ``y'`` of another
    prompt scored under prompt ``x`` (shift the completions by one within the batch).
    For data parallelism, pass the gathered ``kl_logp`` / ``kl_ref_logp``. The paper
    recommends weights with ``lambda_D n_D / (lambda_U n_U)`` in [1, 4/3].

    Args:
      logp: ``[B]`` sequence log-probs of the responses under the policy.
      ref_logp: ``[B]`` the same under the reference policy.
      desirable: ``[B]`` bool (or exactly 0/1: another value such as 0.5 or NaN is a
        ``ValueError`` where it can be read without a sync), True for a desirable response.
      kl_logp: ``[M]`` (M >= 1) policy log-probs of the mismatched pairs.
      kl_ref_logp: ``[M]`` reference log-probs of the mismatched pairs.
      beta: risk-aversion / KL strength. Default 0.1.
      desirable_weight: lambda_D. Default 1.
      undesirable_weight: lambda_U. Default 1.

    Returns:
      ``(loss [B], metrics)``, all metrics detached: ``rewards`` ``[B]`` (``beta r``);
      0-d ``kl`` (the reference point ``z``), ``chosen_rewards`` / ``rejected_rewards``
      (mean reward of the desirable / undesirable samples, 0 when there are none),
      ``margins`` (their difference) and ``accuracies`` (fraction of samples on the
      right side of ``z``).

    >>> loss, m = kto_loss(torch.tensor([-4.0, -9.0]), torch.tensor([-5.0, -8.0]),
    ...                    torch.tensor([True, False]), torch.tensor([-3.0]), torch.tensor([-3.0]), beta=1.0)
    >>> loss  # sigmoid(-1) for both: z = 0, r = (1, -1)
    tensor([0.2689, 0.2689])
    """
    check_sequences(logp=logp, ref_logp=ref_logp)
    check_same_shape("desirable", desirable, "logp", logp)
    _check_labels(desirable)
    check_sequences(kl_logp=kl_logp, kl_ref_logp=kl_ref_logp)
    if kl_logp.shape[0] == 0:
        raise ValueError("kl_logp: got shape (0), expected (M) with M >= 1 (the KL reference point needs samples)")
    check_positive("beta", beta, finite=True)
    check_positive("desirable_weight", desirable_weight, strict=False, finite=True)
    check_positive("undesirable_weight", undesirable_weight, strict=False, finite=True)
    dtype = logp.dtype
    acc = acc_dtype(dtype)
    good = desirable.bool()
    r = logp.to(acc) - ref_logp.to(acc)
    z = (kl_logp.to(acc) - kl_ref_logp.to(acc)).mean().clamp(min=0.0).detach()
    # Signed distance from the reference point, positive when the sample sits on its desired side.
    u = torch.where(good, r - z, z - r)
    weight = torch.where(good, desirable_weight, undesirable_weight)
    loss = weight * torch.sigmoid(-beta * u)
    rewards = (beta * r).detach()
    chosen = masked_mean(rewards, good)
    rejected = masked_mean(rewards, ~good)
    metrics = {
        "rewards": rewards.to(dtype),
        "kl": z.to(dtype),
        "chosen_rewards": chosen.to(dtype),
        "rejected_rewards": rejected.to(dtype),
        "margins": (chosen - rejected).to(dtype),
        "accuracies": (u > 0).to(acc).mean().to(dtype),
    }
    return loss.to(dtype), metrics
