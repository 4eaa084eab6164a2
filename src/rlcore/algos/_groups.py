"""Input checks shared by the estimators and filters over sequence scores and group ids."""

from __future__ import annotations

import torch

from rlcore._checks import check_floating, check_group_ids, check_integer, check_ndim, check_same_shape


def check_outcome(
    scores: torch.Tensor,
    group_ids: torch.Tensor | None,
    num_groups: int | None,
    group_size: int | None = None,
    *,
    check_ids: bool = True,
) -> int:
    """Validate ``scores [B]`` and ``group_ids [B]``; return the number of segments to use.

    With ``group_size`` (contiguous groups of that size) it is ``B / group_size``, and
    ``group_ids`` may be ``None``.
    Without ``num_groups`` the count is ``B``: every id of a valid batch is below ``B``,
    so this bound needs no read-back of ``group_ids.max()`` from the device.
    """
    check_ndim("scores", scores, 1)
    check_floating("scores", scores)
    if group_ids is None and group_size is None:
        raise ValueError("group_ids: got None, expected a [B] integer tensor (or declare the layout with group_size)")
    if group_ids is not None:
        check_ndim("group_ids", group_ids, 1)
        check_integer("group_ids", group_ids)
        check_same_shape("group_ids", group_ids, "scores", scores)
    if group_size is not None:
        b = scores.shape[0]
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or b % group_size:
            raise ValueError(f"group_size: got {group_size!r}, expected a positive int dividing the batch size {b}")
        if num_groups is not None and num_groups != b // group_size:
            raise ValueError(f"num_groups: got {num_groups!r}, expected None or {b // group_size} (B / group_size)")
        # The ids are checked against the declared layout where they are used (rlcore.ops).
        return b // group_size
    if num_groups is None:
        num_groups = scores.shape[0]
    elif isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups: got {num_groups!r}, expected a non-negative int (or None for B)")
    if check_ids and group_ids is not None:  # False where the segment op that uses the ids checks them
        check_group_ids(group_ids, num_groups)
    return num_groups
