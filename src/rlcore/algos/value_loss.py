"""Per-token clipped value (critic) loss of PPO."""

from __future__ import annotations

import torch

from rlcore._checks import check_floating, check_ndim, check_positive, check_same_shape
from rlcore.ops import acc_dtype, masked_mean

__all__ = ["value_loss"]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO value loss with the value prediction clipped around the rollout values.

    Schulman et al. 2017, arXiv:1707.06347, as implemented in OpenAI baselines ppo2 and
    in verl / TRL (``cliprange_value``; TRL's default 0.2).

    Formula, with ``v = values``, ``R = returns``::

        v_clip = old_values + clip(v - old_values, -clip, clip)
        loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2)

    The max makes the clipped term a pessimistic bound: a token whose clipped error is
    the larger one has zero gradient. ``clip=None`` gives ``0.5 * (v - R)^2``.

    Args:
      values: ``[B, T]`` current critic predictions.
      old_values: ``[B, T]`` critic predictions at rollout time.
      returns: ``[B, T]`` value targets (e.g. from :func:`rlcore.algos.gae`).
      mask: ``[B, T]``, 1 where a token counts.
      clip: clip range (>= 0) of the value change, or ``None``.

    Returns:
      ``(loss_t, metrics)``: ``loss_t`` ``[B, T]`` in ``values.dtype`` (0 where ``mask`` is
      0); detached metrics ``clip_frac`` (fraction of tokens where the clipped term is the
      larger) and ``mse`` (masked mean of ``(v - R)^2``).

    >>> loss, m = value_loss(torch.tensor([[1.0, 0.5]]), torch.zeros(1, 2), torch.tensor([[2.0, 0.0]]),
    ...                      torch.ones(1, 2))
    >>> loss
    tensor([[1.6200, 0.1250]])
    >>> m["clip_frac"]
    tensor(0.5000)
    """
    check_floating("values", values)
    check_ndim("values", values, 2)
    for name, x in (("old_values", old_values), ("returns", returns)):
        check_same_shape(name, x, "values", values)
        check_floating(name, x)
    check_same_shape("mask", mask, "values", values)
    if clip is not None:
        check_positive("clip", clip, strict=False)
    acc = acc_dtype(values.dtype)
    keep = mask != 0
    v = torch.where(keep, values.to(acc), 0.0)
    ret = torch.where(keep, returns.to(acc), 0.0)
    err = (v - ret).square()
    if clip is None:
        loss = 0.5 * err
        clip_frac = torch.zeros((), dtype=torch.float32, device=values.device)
    else:
        old = torch.where(keep, old_values.to(acc), 0.0)
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = (v_clip - ret).square()
        loss = 0.5 * torch.maximum(err, err_clip)
        clip_frac = masked_mean((err_clip > err).detach().float(), mask)
    metrics = {"clip_frac": clip_frac, "mse": masked_mean(err.detach().float(), mask)}
    return torch.where(keep, loss, 0.0).to(values.dtype), metrics
