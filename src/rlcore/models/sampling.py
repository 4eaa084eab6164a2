"""The sampling step shared by every generation loop, with its helpers: left padding, top-k / top-p truncation.

:func:`sample_tokens` draws one token per row by inverse-CDF sampling from uniforms
that :func:`uniform_table` takes from the call's stream: per-row counter hashes for a
:class:`rlcore.seeding.RowStream` (the trainer's default: a row's tokens do not depend
on the batch it is in), ``torch.rand`` for a plain ``torch.Generator``.
"""

from __future__ import annotations

import torch

from rlcore.seeding import RowStream, row_keys, row_uniforms

__all__ = ["filter_logits", "left_pad", "sample_tokens", "uniform_table"]


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(ids [B, P], mask [B, P])``.

    >>> left_pad([[5, 6], [7]], 0)
    (tensor([[5, 6],
            [0, 7]]), tensor([[1, 1],
            [0, 1]]))
    """
    width = max((len(s) for s in sequences), default=0)
    # Built as Python lists and converted once: a tensor write per row costs more than the row.
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    return ids.reshape(len(sequences), width), mask.reshape(len(sequences), width)


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


def uniform_table(
    generator: torch.Generator | None, rows: int, positions: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """``[rows, S]`` float32 uniforms in ``[0, 1)`` on ``device``: column ``s`` feeds decoding step ``s``.

    Drawn once per decode loop, before its first step. A :class:`rlcore.seeding.RowStream`
    gives row ``i`` at step ``s`` the uniform of its global row index at token position
    ``positions[s]`` (``positions`` ``[S]``, or ``[rows, S]`` per row): the same value
    whatever the batch. Any other generator (or None: torch's default one) is drawn
    from in order, ``rows x S`` values.

    >>> one = uniform_table(RowStream(0, 2, 0, torch.tensor([5])), 1, torch.arange(3), torch.device("cpu"))
    >>> two = uniform_table(RowStream(0, 2, 0, torch.tensor([4, 5])), 2, torch.arange(3), torch.device("cpu"))
    >>> torch.equal(one, two[1:])
    True
    """
    steps = positions.shape[-1]
    if isinstance(generator, RowStream):
        keys = row_keys(generator.key, generator.row_ids(rows, device))
        return row_uniforms(keys[:, None], positions.to(device))
    where = generator.device if generator is not None else device
    return torch.rand(rows, steps, generator=generator, device=where).to(device)


def sample_tokens(
    logits: torch.Tensor,
    uniforms: torch.Tensor | None,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``softmax(filter(logits / T))``, and its log-prob under the temperature-scaled policy.

    Inverse-CDF sampling: row ``i`` takes the first token whose cumulative weight passes
    ``uniforms[i]`` times the row's total weight, the weights being
    ``exp(l / T - max)`` over the tokens :func:`filter_logits` keeps (top-k, then top-p).
    ``temperature=0`` is greedy (``uniforms`` unused, may be None). Sync-free.

    Args:
      logits: ``[N, V]`` last-position logits (any float dtype; computed in float32).
      uniforms: ``[N]`` draws in ``[0, 1)`` with 24 bits (a column of :func:`uniform_table`),
        or None when greedy.
      temperature, top_k, top_p: the sampling controls.

    Returns:
      ``(tokens [N] int64, logp [N] float32)``; ``logp`` is ``log softmax(logits / T)``
      at the token (``T = 1`` when greedy), before truncation.

    >>> tokens, logp = sample_tokens(torch.log(torch.tensor([[0.5, 0.3, 0.2]])), torch.tensor([0.6]))
    >>> tokens.tolist(), round(logp.exp().item(), 4)
    ([1], 0.3)
    """
    logits = logits.float()
    if temperature == 0:
        token = logits.argmax(-1)
        return token, logits.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
    if uniforms is None:
        raise ValueError(f"uniforms: got None with temperature {temperature}, expected [N] draws in [0, 1)")
    scaled = logits / temperature
    kept = filter_logits(scaled, top_k=top_k, top_p=top_p)
    weights = torch.exp(kept - kept.amax(-1, keepdim=True))
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:]
    # u has 24 bits and u <= 1 - 2**-24, so the float32 product u * total rounds to below total:
    # the first cdf entry past the target is a token of weight > 0.
    token = torch.searchsorted(cdf, uniforms[:, None].float() * total, right=True).squeeze(-1)
    return token, scaled.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(scaled, -1)
