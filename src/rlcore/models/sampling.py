"""Sampling helpers shared by every generation loop: left padding of prompts, top-k / top-p truncation."""

from __future__ import annotations

import torch

__all__ = ["filter_logits", "left_pad"]


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(ids [B, P], mask [B, P])``.

    >>> left_pad([[5, 6], [7]], 0)
    (tensor([[5, 6],
            [0, 7]]), tensor([[1, 1],
            [0, 1]]))
    """
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
    return ids, mask


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and the top-p nucleus to ``-inf``.

    Top-k (Fan et al. 2018, arXiv:1805.04833) keeps the ``k`` largest logits (``0``: all);
    nucleus sampling (Holtzman et al. 2019, arXiv:1904.09751) keeps the smallest set of
    tokens whose probability reaches ``top_p``, always including the most likely one.

    >>> filter_logits(torch.log(torch.tensor([[0.5, 0.3, 0.2]])), top_p=0.7)
    tensor([[-0.6931, -1.2040,    -inf]])
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # A token is dropped when the tokens ranked above it already reach top_p.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
