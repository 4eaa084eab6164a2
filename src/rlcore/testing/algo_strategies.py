"""Hypothesis strategies for advantage estimators, KL terms, reward shaping and filters.

>>> from hypothesis import given
>>> @given(reward_batches(max_batch=3, max_len=4))
... def check(batch):
...     assert batch["rewards"].shape == batch["values"].shape == batch["mask"].shape
>>> check()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from rlcore.testing.strategies import float_tensors, masks

__all__ = ["LOG_RATIO_SCALES", "logp_batches", "reward_batches"]

# Spread of log pi - log pi_ref per token: identical policies, close ones, far ones, and
# ones beyond the +-20 clamp that k3 applies for stability.
LOG_RATIO_SCALES = {"zero": 0.0, "small": 0.05, "large": 2.0, "extreme": 40.0}


@st.composite
def reward_batches(
    draw: st.DrawFn,
    *,
    min_batch: int = 1,
    max_batch: int = 6,
    min_len: int = 1,
    max_len: int = 24,
    dtype: torch.dtype = torch.float32,
    interior_zeros: bool = True,
    allow_empty_rows: bool = True,
) -> dict[str, torch.Tensor]:
    """``{"rewards", "values", "mask"}``, all ``[B, T]``, right-padded with interior mask holes.

    Rewards are either dense (one per token) or sparse (outcome rewards on one token per
    row, some of them on mask-0 tokens, which estimators must ignore). Every position
    with mask 0 holds ``nan`` in ``values``, and in ``rewards`` unless it carries a
    (to-be-ignored) reward, so any leak of padding shows.
    """
    b = draw(st.integers(min_batch, max_batch))
    t = draw(st.integers(min_len, max_len))
    mask = draw(masks(b, t, interior_zeros=interior_zeros, allow_empty=allow_empty_rows))
    values = draw(float_tensors((b, t), dtype=torch.float64, patterns=("normal", "constant", "offset")))
    if draw(st.booleans()):
        rewards = draw(float_tensors((b, t), dtype=torch.float64, patterns=("normal", "binary", "wide")))
        rewards = torch.where(mask, rewards, float("nan"))
    else:
        at = draw(st.lists(st.integers(0, t - 1), min_size=b, max_size=b))
        hits = torch.zeros(b, t, dtype=torch.bool)
        hits[torch.arange(b), torch.tensor(at, dtype=torch.long)] = True
        score = draw(float_tensors((b, 1), dtype=torch.float64, patterns=("normal", "binary")))
        rewards = torch.where(hits, score, torch.where(mask, 0.0, float("nan")))
    values = torch.where(mask, values, float("nan"))
    return {"rewards": rewards.to(dtype), "values": values.to(dtype), "mask": mask}


@st.composite
def logp_batches(
    draw: st.DrawFn,
    *,
    min_batch: int = 1,
    max_batch: int = 6,
    min_len: int = 1,
    max_len: int = 16,
    dtype: torch.dtype = torch.float32,
    scales: Sequence[str] = tuple(LOG_RATIO_SCALES),
) -> dict[str, torch.Tensor]:
    """``{"logp", "ref_logp", "mask"}``, all ``[B, T]``; ``nan`` where the mask is 0.

    ``logp`` lies in ``[-9.2, 0]``; ``ref_logp = logp + scale * noise`` with a drawn
    scale from :data:`LOG_RATIO_SCALES` (so ``"zero"`` gives identical policies).
    """
    b = draw(st.integers(min_batch, max_batch))
    t = draw(st.integers(min_len, max_len))
    mask = draw(masks(b, t))
    scale = LOG_RATIO_SCALES[draw(st.sampled_from(tuple(scales)))]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logp = torch.empty(b, t, dtype=torch.float64).uniform_(1e-4, 1.0, generator=g).log()
    ref_logp = logp + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    out = {k: torch.where(mask, v, float("nan")).to(dtype) for k, v in (("logp", logp), ("ref_logp", ref_logp))}
    out["mask"] = mask
    return out
