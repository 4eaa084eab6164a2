"""Hypothesis strategies for preference data: paired and unpaired sequence log-probs.

The batch size and the value pattern are drawn by hypothesis; values come from a
seeded torch generator. Reference log-probs look like those of a real model
(``-U(0, 100)`` per sequence); the policy sits at a drawn log-ratio from it.

>>> from hypothesis import given
>>> @given(preference_pairs(max_batch=3))
... def check(p):
...     assert p["pi_chosen"].shape == p["ref_rejected"].shape
>>> check()
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

__all__ = ["PAIR_PATTERNS", "preference_pairs", "unpaired_samples"]

# normal: independent log-ratios; equal: policy == reference; tied: equal log-ratios
# for chosen and rejected (margin 0); wide: magnitudes spread over e^-6 .. scale.
PAIR_PATTERNS = ("normal", "equal", "tied", "wide")


def _logratios(n: int, pattern: str, scale: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if pattern == "equal":
        zero = torch.zeros(n, dtype=torch.float64)
        return zero, zero.clone()
    if pattern == "wide":
        mag = torch.exp(torch.empty(2, n, dtype=torch.float64).uniform_(-6.0, math.log(scale), generator=g))
        sign = torch.randint(0, 2, (2, n), generator=g, dtype=torch.float64) * 2 - 1
        lc, lr = mag * sign
        return lc, lr
    lc = torch.randn(n, generator=g, dtype=torch.float64) * scale
    lr = lc.clone() if pattern == "tied" else torch.randn(n, generator=g, dtype=torch.float64) * scale
    return lc, lr


@st.composite
def preference_pairs(
    draw: st.DrawFn,
    *,
    min_batch: int = 1,
    max_batch: int = 8,
    dtype: torch.dtype = torch.float32,
    scale: float = 5.0,
    patterns: Sequence[str] = PAIR_PATTERNS,
) -> dict[str, torch.Tensor]:
    """``{"pi_chosen", "pi_rejected", "ref_chosen", "ref_rejected"}``, each ``[B]`` in ``dtype``.

    Log-ratios ``pi - ref`` have magnitude about ``scale``.
    """
    b = draw(st.integers(min_batch, max_batch))
    pattern = draw(st.sampled_from(tuple(patterns)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ref = -torch.rand(2, b, generator=g, dtype=torch.float64) * 100.0
    lc, lr = _logratios(b, pattern, scale, g)
    return {
        "pi_chosen": (ref[0] + lc).to(dtype),
        "pi_rejected": (ref[1] + lr).to(dtype),
        "ref_chosen": ref[0].to(dtype),
        "ref_rejected": ref[1].to(dtype),
    }


@st.composite
def unpaired_samples(
    draw: st.DrawFn,
    *,
    min_batch: int = 1,
    max_batch: int = 8,
    dtype: torch.dtype = torch.float32,
    scale: float = 5.0,
) -> dict[str, torch.Tensor]:
    """KTO-style data: ``logp``, ``ref_logp``, ``desirable`` ``[B]`` and ``kl_logp``, ``kl_ref_logp`` ``[M]``.

    ``desirable`` may be all True or all False; the KL estimate may be negative
    (which KTO clamps to 0).
    """
    b = draw(st.integers(min_batch, max_batch))
    m = draw(st.integers(1, max_batch))
    desirable = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)), dtype=torch.bool)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ref = -torch.rand(b, generator=g, dtype=torch.float64) * 100.0
    kl_ref = -torch.rand(m, generator=g, dtype=torch.float64) * 100.0
    kl_shift = torch.randn((), generator=g, dtype=torch.float64) * scale
    return {
        "logp": (ref + torch.randn(b, generator=g, dtype=torch.float64) * scale).to(dtype),
        "ref_logp": ref.to(dtype),
        "desirable": desirable,
        "kl_logp": (kl_ref + kl_shift + torch.randn(m, generator=g, dtype=torch.float64)).to(dtype),
        "kl_ref_logp": kl_ref.to(dtype),
    }
