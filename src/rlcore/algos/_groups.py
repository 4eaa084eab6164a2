"""Input checks shared by the estimators and filters over sequence scores and group ids."""

from __future__ import annotations

import torch

from rlcore._checks import check_floating, check_group_ids, check_integer, check_ndim, check_same_shape


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
        num_groups = scores.shape[0]
    elif isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups: got {num_groups!r}, expected a non-negative int (or None for B)")
    check_group_ids(group_ids, num_groups)
    return num_groups
