"""A prioritised replay buffer's bookkeeping as pure functions: which rows it keeps, which it serves, how often.

The buffer is an ``(init, insert, serve)`` family over an explicit state
(:class:`ReplayState`): ``capacity`` slots, each with a priority (the row's advantage),
a count of the times it was served and whether it holds a row. The rows themselves live
wherever the caller keeps them; these functions only say which slot holds which row:

* :func:`replay_insert` keeps the ``capacity`` highest-priority rows of those stored and
  those offered (ties: stored rows first, then the offered in order);
* :func:`replay_serve` serves the ``k`` highest-priority rows served fewer than
  ``max_reuse`` times, counts the serve, and frees a slot once its row has been served
  ``max_reuse`` times, so no row is ever served more often.

Replaying high-reward samples beside fresh ones: e.g. Schaul et al., "Prioritized
Experience Replay", arXiv 1511.05952; for LLM RL, Li et al., "RePO: Replay-Enhanced
Policy Optimization", arXiv 2506.09340. The replayed rows are off-policy: weight them by
:func:`rlcore.algos.truncated_is_weights` of the current log-probs against the recorded ones.
Everything is sync-free (sizes are the capacity and ``k``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlcore._checks import check_floating, check_ndim, check_same_shape

__all__ = ["ReplayState", "replay_init", "replay_insert", "replay_serve"]


class ReplayState(NamedTuple):
    """The buffer's slots.

    Fields:
      priority: ``[C]`` float32, the stored row's priority (``-inf`` in an empty slot).
      uses: ``[C]`` int64, times the slot's row was served.
      filled: ``[C]`` bool, the slot holds a row.
    """

    priority: torch.Tensor
    uses: torch.Tensor
    filled: torch.Tensor


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: got {value!r}, expected an int >= {minimum}")
    return value


def replay_init(capacity: int, *, device: torch.device | str | None = None) -> ReplayState:
    """An empty buffer of ``capacity`` slots.

    >>> replay_init(2)
    ReplayState(priority=tensor([-inf, -inf]), uses=tensor([0, 0]), filled=tensor([False, False]))
    """
    _check_count("capacity", capacity, 1)
    return ReplayState(
        torch.full((capacity,), float("-inf"), device=device),
        torch.zeros(capacity, dtype=torch.int64, device=device),
        torch.zeros(capacity, dtype=torch.bool, device=device),
    )


def _check_state(state: ReplayState) -> int:
    if not isinstance(state, ReplayState):
        raise ValueError(f"state: got {type(state).__name__}, expected a ReplayState (replay_init)")
    check_ndim("state.priority", state.priority, 1)
    check_same_shape("state.uses", state.uses, "state.priority", state.priority)
    check_same_shape("state.filled", state.filled, "state.priority", state.priority)
    return state.priority.shape[0]


def replay_insert(state: ReplayState, priority: torch.Tensor, keep: torch.Tensor) -> tuple[ReplayState, torch.Tensor]:
    """Offer ``K`` rows to the buffer: it keeps the ``C`` highest-priority rows of the stored and the offered.

    An offered row with ``keep`` False (or a non-finite priority) is not stored. A new
    row starts with 0 uses; a stored row keeps its count.

    Args:
      state: the buffer (:func:`replay_init`).
      priority: ``[K]`` priorities of the offered rows (e.g. their advantages).
      keep: ``[K]`` bool, the rows that may be stored (e.g. advantage above a floor).

    Returns:
      ``(state, source)``: the new state and ``source [C]`` int64, where each slot's row
      comes from: ``s < C`` the row of old slot ``s``, ``s >= C`` offered row ``s - C``,
      ``-1`` an empty slot.

    >>> s, src = replay_insert(replay_init(2), torch.tensor([0.5, 2.0, 1.0]), torch.tensor([True, True, True]))
    >>> src.tolist(), s.priority.tolist()  # sync-ok: doctest output, not the function
    ([3, 4], [2.0, 1.0])
    """
    c = _check_state(state)
    check_ndim("priority", priority, 1)
    check_floating("priority", priority)
    check_same_shape("keep", keep, "priority", priority)
    offered = torch.where(keep.bool() & torch.isfinite(priority), priority.float(), float("-inf"))
    pool = torch.cat([torch.where(state.filled, state.priority, float("-inf")), offered])
    # Stable: among equal priorities the stored rows stay, then the offered in order.
    order = torch.sort(pool, descending=True, stable=True).indices[:c]
    filled = torch.isfinite(pool[order])
    uses = torch.cat([state.uses, torch.zeros_like(offered, dtype=torch.int64)])[order]
    source = torch.where(filled, order, -1)
    new = ReplayState(torch.where(filled, pool[order], float("-inf")), torch.where(filled, uses, 0), filled)
    return new, source


def replay_serve(state: ReplayState, k: int, *, max_reuse: int) -> tuple[ReplayState, torch.Tensor, torch.Tensor]:
    """Serve up to ``k`` rows: the highest-priority ones served fewer than ``max_reuse`` times.

    Each served row's count goes up by one; a row served ``max_reuse`` times leaves its
    slot (which is then empty), so no row is served more than ``max_reuse`` times.

    Args:
      state: the buffer.
      k: rows wanted (an int >= 0).
      max_reuse: times a row may be served (an int >= 1).

    Returns:
      ``(state, slots, valid)``: ``slots [k]`` int64 (the served slots in the state
      *before* the call, -1 where none was left) and ``valid [k]`` bool.

    >>> s, _ = replay_insert(replay_init(3), torch.tensor([1.0, 3.0]), torch.tensor([True, True]))
    >>> s, slots, valid = replay_serve(s, 2, max_reuse=1)
    >>> slots.tolist(), valid.tolist(), s.filled.tolist()  # sync-ok: doctest output, not the function
    ([0, 1], [True, True], [False, False, False])
    """
    c = _check_state(state)
    _check_count("k", k, 0)
    _check_count("max_reuse", max_reuse, 1)
    eligible = state.filled & (state.uses < max_reuse)
    key = torch.where(eligible, state.priority, float("-inf"))
    m = min(k, c)
    order = torch.sort(key, descending=True, stable=True).indices[:m]
    ok = eligible[order]
    pad = k - m
    slots = torch.cat([torch.where(ok, order, -1), torch.full((pad,), -1, dtype=torch.long, device=order.device)])
    valid = torch.cat([ok, torch.zeros(pad, dtype=torch.bool, device=ok.device)])
    served = torch.zeros(c, dtype=torch.int64, device=order.device).index_add(0, order, ok.to(torch.int64))
    uses = state.uses + served
    filled = state.filled & (uses < max_reuse)
    new = ReplayState(torch.where(filled, state.priority, float("-inf")), torch.where(filled, uses, 0), filled)
    return new, slots, valid
