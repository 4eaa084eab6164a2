"""Hypothesis strategies for loss tests: policy batches with controlled off-policy drift, and micro-batch splits.

>>> from hypothesis import given
>>> @given(policy_batches(max_batch=3, max_len=4))
... def check(batch):
...     assert batch["logp"].shape == batch["mask"].shape
>>> check()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from rlcore.testing.strategies import grouped_scores, masks

__all__ = ["DRIFTS", "microbatch_splits", "policy_batches", "recipe_batches"]

# How far the current policy has moved from the sampling one, in log-ratio units:
# "none" is on-policy, "small" stays near the clip band, "large" crosses it on most
# tokens, "extreme" reaches the +-20 clamp of the log-ratio.
DRIFTS = {"none": 0.0, "small": 0.1, "large": 1.0, "extreme": 30.0}


@st.composite
def policy_batches(
    draw: st.DrawFn,
    *,
    min_batch: int = 1,
    max_batch: int = 6,
    min_len: int = 1,
    max_len: int = 12,
    dtype: torch.dtype = torch.float32,
    drifts: Sequence[str] = tuple(DRIFTS),
    seq_advantages: bool | None = None,
    interior_zeros: bool = True,
    allow_empty_rows: bool = True,
) -> dict[str, torch.Tensor]:
    """A token batch for policy and value losses, every leaf ``[B, T]`` (mask bool).

    Keys: ``logp`` (log-probabilities in ``[-9.2, 0]``), ``old_logp`` (``logp`` minus a
    drift of the drawn size), ``ref_logp``, ``advantages`` (per token, or constant along
    each sequence when ``seq_advantages`` is True; drawn when None; some exact zeros),
    ``values``, ``old_values``, ``returns``, ``mask``. Positions with mask 0 hold
    ``nan`` so a leak of padding shows in a value or a gradient.
    """
    b = draw(st.integers(min_batch, max_batch))
    t = draw(st.integers(min_len, max_len))
    mask = draw(masks(b, t, interior_zeros=interior_zeros, allow_empty=allow_empty_rows))
    drift = DRIFTS[draw(st.sampled_from(tuple(drifts)))]
    per_seq = draw(st.booleans()) if seq_advantages is None else seq_advantages
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    f64 = torch.float64
    logp = torch.empty(b, t, dtype=f64).uniform_(1e-4, 1.0, generator=g).log()
    old_logp = logp - drift * torch.randn(b, t, generator=g, dtype=f64)
    ref_logp = logp - 0.5 * torch.randn(b, t, generator=g, dtype=f64)
    # Some exact zeros: whole sequences for sequence advantages, single tokens otherwise.
    rows = b if per_seq else (b, t)
    advantages = torch.randn(rows, generator=g, dtype=f64) * (torch.rand(rows, generator=g) > 0.1)
    advantages = advantages[:, None].expand(b, t).clone() if per_seq else advantages
    old_values = torch.randn(b, t, generator=g, dtype=f64)
    values = old_values + 0.3 * torch.randn(b, t, generator=g, dtype=f64)
    returns = old_values + torch.randn(b, t, generator=g, dtype=f64)
    leaves = {
        "logp": logp,
        "old_logp": old_logp,
        "ref_logp": ref_logp,
        "advantages": advantages,
        "values": values,
        "old_values": old_values,
        "returns": returns,
    }
    out = {k: torch.where(mask, v, float("nan")).to(dtype) for k, v in leaves.items()}
    out["mask"] = mask
    return out


@st.composite
def microbatch_splits(draw: st.DrawFn, batch: int, *, max_parts: int = 4) -> list[torch.Tensor]:
    """A partition of ``range(batch)`` into up to ``max_parts`` non-empty index tensors.

    Rows are shuffled before the cut, so micro-batches are uneven and non-contiguous.
    """
    order = draw(st.permutations(list(range(batch))))
    parts = draw(st.integers(1, max(1, min(max_parts, batch))))
    cuts = sorted(
        draw(st.lists(st.integers(1, max(1, batch - 1)), min_size=parts - 1, max_size=parts - 1, unique=True))
    )
    bounds = [0, *cuts, batch]
    return [torch.tensor(order[lo:hi], dtype=torch.long) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


@st.composite
def recipe_batches(
    draw: st.DrawFn,
    *,
    max_groups: int = 4,
    max_size: int = 4,
    max_len: int = 8,
    dtype: torch.dtype = torch.float32,
    drifts: Sequence[str] = ("none", "small", "large"),
) -> dict[str, torch.Tensor]:
    """A :func:`policy_batches` batch without ``advantages`` and ``returns``, plus ``scores`` and ``group_ids``.

    ``scores`` is ``[B]`` float32, ``group_ids`` ``[B]`` int64.

    Groups are uneven and shuffled; some have all-equal scores. Scores are binary,
    normal or constant per group (no large offsets: group stds stay well above the
    float32 rounding of the scores).
    """
    scores, ids = draw(
        grouped_scores(max_groups=max_groups, max_size=max_size, patterns=("binary", "normal", "constant"))
    )
    b = ids.shape[0]
    batch = draw(policy_batches(min_batch=b, max_batch=b, max_len=max_len, dtype=dtype, drifts=drifts))
    # A recipe computes these itself.
    del batch["advantages"], batch["returns"]
    batch["scores"] = scores.float()
    batch["group_ids"] = ids
    return batch
