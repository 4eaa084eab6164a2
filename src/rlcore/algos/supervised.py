"""The supervised fine-tuning loss: the negative log-likelihood of the response tokens.

Per-token like every loss in :mod:`rlcore.algos`; reduce it with
:func:`rlcore.algos.aggregate` (``token-mean`` or ``seq-mean-token-mean``) over the same mask.
"""

from __future__ import annotations

import torch

from rlcore._checks import check_floating, check_ndim, check_same_shape
from rlcore.ops import acc_dtype

__all__ = ["sft_loss"]


def sft_loss(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token negative log-likelihood of the target tokens (supervised fine-tuning), 0 off the mask.

    Ouyang et al. 2022 (InstructGPT), arXiv:2203.02155, section 3.5 ("SFT"): maximum
    likelihood of the demonstration's response given its prompt; the prompt's tokens are
    not trained on (the mask is 0 there), as in TRL's ``SFTTrainer`` with
    ``completion_only_loss``.

    Formula, with ``m`` the mask::

        loss_t = -m_t * log pi(y_t | x, y_<t)

    Args:
      logp: ``[B, T]`` log-probs of the target tokens under the policy (with gradient).
      mask: ``[B, T]``, 1 (or a weight) on the response tokens, 0 on the prompt and padding.

    Returns:
      ``(loss_t, metrics)``: ``loss_t`` ``[B, T]`` in ``logp.dtype``; ``metrics["nll"]`` the
      detached float32 token-mean negative log-likelihood over the mask (0 for an empty mask).

    >>> loss, m = sft_loss(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[0, 1, 1]]))
    >>> loss, m["nll"]
    (tensor([[0., 2., 3.]]), tensor(2.5000))
    """
    check_floating("logp", logp)
    check_ndim("logp", logp, 2)
    check_same_shape("mask", mask, "logp", logp)
    acc = acc_dtype(logp.dtype)
    weights = mask.to(acc)
    loss = torch.where(mask != 0, -logp.to(acc) * weights, 0.0)
    with torch.no_grad():
        total = weights.sum()
        nll = (loss.sum() / torch.where(total > 0, total, 1.0)).float()
    return loss.to(logp.dtype), {"nll": nll}
