"""Input checks and group centring shared by the estimators and filters over sequence scores and group ids."""

from __future__ import annotations

import torch

from rlcore._checks import check_floating, check_integer, check_ndim, check_same_shape
from rlcore.ops import segment_mean


def check_outcome(scores: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None) -> int:
    """Validate ``scores [B]`` and ``group_ids [B]``; return the number of segments to use.

    Without ``num_groups`` the count is ``B``: every id of a valid batch is below ``B``,
    so this bound needs no read-back of ``group_ids.max()`` from the device.
    """
    check_ndim("scores", scores, 1)
    check_floating("scores", scores)
    check_ndim("group_ids", group_ids, 1)
    check_integer("group_ids", group_ids)
    check_same_shape("group_ids", group_ids, "scores", scores)
    if num_groups is None:
        return scores.shape[0]
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups: got {num_groups!r}, expected a non-negative int (or None for B)")
    return num_groups


def group_centred(s: torch.Tensor, group_ids: torch.Tensor, n: int) -> torch.Tensor:
    """``s_i - mean_{g(i)}`` without rounding the group mean at the scale of ``s``.

    Each group is first shifted by its smallest member (an exact subtraction for
    values of similar size), so scores like ``1e4 + noise`` keep their float32
    resolution and a group of equal scores is exactly 0.
    """
    idx = group_ids.long()
    pivot = s.detach().new_zeros(n).scatter_reduce(0, idx, s.detach(), "amin", include_self=False)
    d = s - pivot[idx]
    return d - segment_mean(d, group_ids, num_segments=n)[idx]
