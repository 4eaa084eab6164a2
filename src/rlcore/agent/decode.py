"""One turn of batched, KV-cached sampling that reports each row the moment it stops."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from rlcore.models.decoding import CachedDecoder
from rlcore.models.sampling import sample_tokens, uniform_table

__all__ = ["Turn", "sample_turn"]


class Turn(NamedTuple):
    """The tokens one turn sampled: row ``i`` wrote ``tokens[i, :lengths[i]]``.

    Fields:
      tokens: ``[B, S]`` int64, the pad id after each row's end.
      logp: ``[B, S]`` float32 log-probs of the sampled tokens (temperature-scaled
        policy, before top-k / top-p), 0 after each row's end.
      lengths: ``[B]`` int64 tokens per row.
    """

    tokens: torch.Tensor
    logp: torch.Tensor
    lengths: torch.Tensor


@torch.no_grad()
def sample_turn(
    model: Any,
    ids: torch.Tensor,
    attention: torch.Tensor,
    budgets: Sequence[int],
    *,
    stop_token_ids: Sequence[int],
    pad_token_id: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    positions: torch.Tensor | None = None,
    on_stop: Callable[[int, list[int]], None] | None = None,
) -> Turn:
    """Sample until each row emits a stop token or spends its budget; call ``on_stop(row, tokens)`` as each row stops.

    The decoding steps are those of :func:`rlcore.train.rollout.generate` (the same
    :class:`rlcore.models.decoding.CachedDecoder` and
    :func:`rlcore.models.sampling.sample_tokens`), so with the end-of-sequence id as the
    only stop token and equal budgets the two sample the same tokens. ``on_stop`` runs on this thread between
    steps; it is where the rollout hands a finished turn to the environment, so tool
    calls run while the other rows keep decoding.

    Args:
      model: a ``transformers`` causal LM (``.logits`` and a KV cache).
      ids: ``[B, L]`` left-padded context ids; attention: ``[B, L]``.
      budgets: per-row maximum of new tokens (each >= 1).
      stop_token_ids: ids that end a turn (kept as the turn's last token).
      pad_token_id, temperature, top_p, top_k, generator: as in ``generate`` (a
        :class:`rlcore.seeding.RowStream` names the global row of each of the ``B`` rows).
      positions: ``[B]`` the response position of each row's first token this turn
        (tokens of earlier turns and observations before it; default 0): a
        ``RowStream`` draws row ``i``'s ``s``-th token at ``positions[i] + s``.
      on_stop: callback ``(row, tokens)``.

    Returns:
      a :class:`Turn`.
    """
    rows = ids.shape[0]
    device = ids.device
    if len(budgets) != rows or min(budgets, default=1) < 1:
        raise ValueError(f"budgets: got {list(budgets)}, expected {rows} ints >= 1")
    if positions is not None and (positions.shape != (rows,) or positions.is_floating_point()):
        raise ValueError(f"positions: got {positions.dtype} of shape {tuple(positions.shape)}, expected [{rows}] ints")
    steps = max(budgets, default=0)
    if rows == 0:
        empty = torch.zeros((0, 0), dtype=torch.long, device=device)
        return Turn(empty, empty.float(), torch.zeros(0, dtype=torch.long, device=device))
    budget = torch.tensor(list(budgets), device=device)
    stops = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    offset = torch.zeros(rows, dtype=torch.long, device=device) if positions is None else positions.to(device)
    tokens = torch.full((rows, steps), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros((rows, steps), dtype=torch.float32, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    reported = [False] * rows
    decoder = CachedDecoder(model, ids, attention)
    at = offset[:, None] + torch.arange(steps, device=device)
    draws = uniform_table(generator, rows, at, device) if temperature > 0 else None
    width = steps
    for step in range(steps):
        active = decoder.active
        sampled, sampled_logp = sample_tokens(
            decoder.logits,
            draws[active, step] if draws is not None else None,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        token = torch.full((rows,), pad_token_id, dtype=sampled.dtype, device=device).index_copy_(0, active, sampled)
        logp = torch.zeros(rows, dtype=sampled_logp.dtype, device=device).index_copy_(0, active, sampled_logp)
        alive = ~done
        token = torch.where(alive, token, pad_token_id)
        tokens[:, step] = token
        logps[:, step] = torch.where(alive, logp, 0.0)
        lengths += alive.to(torch.long)
        done = done | torch.isin(token, stops) | (lengths >= budget)
        stopped = done.tolist()  # sync-ok: the decode loop hands finished rows to the environment
        for row, now in enumerate(stopped):
            if now and not reported[row]:
                reported[row] = True
                if on_stop is not None:
                    on_stop(row, tokens[row, : step + 1].tolist())
        if all(stopped):
            width = step + 1
            break
        decoder.drop(done)  # finished turns leave the batch: a long tail costs its own rows only
        decoder.feed(token)
    return Turn(tokens[:, :width], logps[:, :width], lengths)
