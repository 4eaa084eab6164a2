"""Hypothesis strategies for the token log-prob engine and sequence packing.

Shapes, chunk sizes and lengths are drawn by hypothesis (they shrink); the values
come from a seeded torch generator. Chunk sizes are drawn so that they usually do
not divide the token count, the case where a chunked kernel's last chunk is ragged.

>>> from hypothesis import given
>>> @given(ragged_token_batches(max_batch=3, max_len=6))
... def check(batch):
...     assert batch["input_ids"].shape == batch["attention_mask"].shape
>>> check()
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

__all__ = ["chunk_sizes", "hidden_weight_labels", "lm_logits_and_labels", "ragged_token_batches", "token_lengths"]


@st.composite
def lm_logits_and_labels(
    draw: st.DrawFn,
    *,
    max_lead: int = 3,
    max_tokens: int = 40,
    max_vocab: int = 48,
    dtype: torch.dtype = torch.float32,
    neg_inf: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [*lead, V], labels [*lead])`` with 1..``max_lead`` leading dimensions.

    Logit scales range from near-uniform to very peaked, some with a large common
    offset (which a bfloat16 softmax without float32 accumulation gets wrong); with ``neg_inf`` some
    vocabulary entries may be ``-inf`` (a masked vocabulary), never a row's label.
    """
    ndim = draw(st.integers(1, max_lead))
    total = draw(st.integers(1, max_tokens))
    lead = [total] + [1] * (ndim - 1)
    for i in range(1, ndim):
        f = draw(st.sampled_from([d for d in range(1, lead[0] + 1) if lead[0] % d == 0]))
        lead[0] //= f
        lead[i] = f
    vocab = draw(st.integers(1, max_vocab))
    scale = draw(st.sampled_from([0.01, 1.0, 3.0, 20.0]))
    offset = draw(st.sampled_from([0.0, 0.0, -7.5, 100.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(*lead, vocab, generator=g, dtype=torch.float64) * scale + offset
    labels = torch.randint(0, vocab, tuple(lead), generator=g)
    if neg_inf and vocab > 1 and draw(st.booleans()):
        drop = torch.rand(*lead, vocab, generator=g) < 0.3
        drop.scatter_(-1, labels.unsqueeze(-1), False)
        logits = logits.masked_fill(drop, -math.inf)
    return logits.to(dtype), labels


def chunk_sizes(max_size: int = 16) -> st.SearchStrategy[int]:
    """Chunk sizes from 1 to ``max_size``."""
    return st.integers(1, max_size)


@st.composite
def hidden_weight_labels(
    draw: st.DrawFn,
    *,
    max_tokens: int = 24,
    max_hidden: int = 12,
    max_vocab: int = 40,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [N, H], weight [V, H], labels [N])`` at LM-like scales (logits of order 1..10)."""
    n = draw(st.integers(1, max_tokens))
    h = draw(st.integers(1, max_hidden))
    v = draw(st.integers(1, max_vocab))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (scale / math.sqrt(h))
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden.to(dtype), weight.to(dtype), labels


def token_lengths(
    *, min_len: int = 0, max_len: int = 12, min_batch: int = 1, max_batch: int = 6
) -> st.SearchStrategy[list[int]]:
    """Per-sequence token counts (zero allowed by default: an empty sequence)."""
    return st.lists(st.integers(min_len, max_len), min_size=min_batch, max_size=max_batch)


@st.composite
def ragged_token_batches(
    draw: st.DrawFn,
    *,
    max_batch: int = 6,
    max_len: int = 12,
    vocab: int = 50,
    left_padding: bool = True,
    allow_empty: bool = True,
) -> dict[str, torch.Tensor]:
    """``{"input_ids": [B, T], "attention_mask": [B, T]}`` with per-row lengths.

    Rows are right-padded; with ``left_padding`` some rows are also left-padded (a
    generation prompt), so real tokens sit in one contiguous run anywhere in the row.
    Padding positions hold token id ``vocab - 1`` so that a leak into a result shows.
    """
    lengths = draw(token_lengths(min_len=0 if allow_empty else 1, max_len=max_len, max_batch=max_batch))
    t = max(max(lengths), 1) + (draw(st.integers(0, 3)) if left_padding else 0)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ids = torch.full((len(lengths), t), vocab - 1, dtype=torch.int64)
    mask = torch.zeros(len(lengths), t, dtype=torch.int64)
    for b, n in enumerate(lengths):
        start = draw(st.integers(0, t - n)) if left_padding else 0
        ids[b, start : start + n] = torch.randint(0, vocab - 1, (n,), generator=g)
        mask[b, start : start + n] = 1
    return {"input_ids": ids, "attention_mask": mask}
