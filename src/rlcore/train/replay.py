"""A replay buffer at the update: stored high-advantage rows mixed with each update's fresh ones (``rl.replay``).

Each update's fresh rows are offered to a prioritised buffer (:mod:`rlcore.algos.replay`):
a row whose sequence advantage (its advantages' mean over its loss mask) is above
``min_advantage`` may be stored, the ``capacity`` highest kept. Before they are stored,
``fraction`` of the update's row count is served from the buffer (the highest-priority
rows served fewer than ``max_reuse`` times) and appended to the fresh rows
(:meth:`Replay.dispatch`, the update's ``dispatch``). A replayed row is off-policy: its
loss mask is scaled by the truncated importance weight of the current policy's log-probs
against the ones it was sampled with (:func:`rlcore.algos.truncated_is_weights`, ``cap``,
``level``), and its ``old_logp`` is the current policy's, detached (the ratio's anchor is
the proximal policy, as in the decoupled objective) (:meth:`Replay.forward`). The step's
metrics are the fresh rows' (:meth:`Replay.on_metrics`), with ``replay/served`` and
``replay/stored`` beside them.

The buffer is this process's; it is saved with the checkpoint (:meth:`Replay.checkpoint_state`:
its slots and their rows), so a resumed run serves what an uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from rlcore import algos
from rlcore.ops import masked_mean

__all__ = ["Replay", "ReplayBuffer", "ReplayConfig", "parse_replay"]

Batch = dict[str, Any]
_LEVELS = ("token", "sequence")
# Columns the replay adds to the update's rows: the flag of a replayed row, the log-probs it was sampled with.
_ADDED = ("replayed", "replay_logp")


class ReplayConfig(NamedTuple):
    """``rl.replay``.

    Fields:
      capacity: rows the buffer holds.
      fraction: replayed rows per fresh row of an update (an update of ``N`` fresh rows
        gets ``floor(fraction * N)`` replayed ones, fewer while the buffer holds fewer).
      max_reuse: times a stored row may be served.
      min_advantage: a fresh row is stored when its sequence advantage is above this.
      cap: the truncation of the importance weights.
      level: ``token`` or ``sequence`` importance weights.
    """

    capacity: int = 256
    fraction: float = 0.25
    max_reuse: int = 2
    min_advantage: float = 0.0
    cap: float = 2.0
    level: str = "token"


def parse_replay(raw: Mapping[str, Any], *, key: str = "rl.replay") -> ReplayConfig:
    """Validate the ``rl.replay`` mapping into a :class:`ReplayConfig`; ``ValueError`` naming the key otherwise.

    >>> parse_replay({"capacity": 8}).capacity
    8
    >>> parse_replay({"max_reuse": 0})
    Traceback (most recent call last):
    ...
    ValueError: config key 'rl.replay.max_reuse': got 0, expected an int >= 1
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"config key {key!r}: got {type(raw).__name__}, expected a mapping of keys")
    values: dict[str, Any] = {}
    for name, value in raw.items():
        where = f"config key '{key}.{name}'"
        if name not in ReplayConfig._fields:
            raise ValueError(f"{where}: unknown, expected one of {', '.join(ReplayConfig._fields)}")
        if name in ("capacity", "max_reuse"):
            ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an int >= 1"
        elif name == "level":
            ok, want = value in _LEVELS, f"one of {', '.join(_LEVELS)}"
        else:
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if name == "fraction":
                ok, want = number and 0 < value <= 1, "a number in (0, 1]"
            elif name == "cap":
                ok, want = number and value > 0, "a number > 0"
            else:
                ok, want = number, "a finite number"
        if not ok:
            raise ValueError(f"{where}: got {value!r}, expected {want}")
        values[name] = float(value) if name in ("fraction", "min_advantage", "cap") else value
    return ReplayConfig(**values)


def _rows(b: Mapping[str, torch.Tensor], index: list[int]) -> list[dict[str, torch.Tensor]]:
    return [{k: v[i] for k, v in b.items()} for i in index]


class ReplayBuffer:
    """The stored rows of :mod:`rlcore.algos.replay`'s slots: ``add`` offers rows, ``serve`` takes some back.

    Args:
      capacity: rows held.
      max_reuse: times a row may be served.
    """

    def __init__(self, capacity: int, *, max_reuse: int):
        self.state = algos.replay_init(capacity)
        self.max_reuse = max_reuse
        self.rows: list[dict[str, torch.Tensor] | None] = [None] * capacity

    def __len__(self) -> int:
        return sum(r is not None for r in self.rows)

    def add(self, rows: Mapping[str, torch.Tensor], priority: torch.Tensor, keep: torch.Tensor) -> None:
        """Offer ``rows`` (columns ``[K, ...]``) with their ``priority [K]``; ``keep [K]`` marks those that may stay."""
        self.state, source = algos.replay_insert(self.state, priority, keep)
        capacity, src = len(self.rows), source.tolist()
        offered = _rows(rows, [s - capacity for s in src if s >= capacity])
        fresh = iter(offered)
        self.rows = [None if s < 0 else self.rows[s] if s < capacity else next(fresh) for s in src]

    def serve(self, k: int) -> list[dict[str, torch.Tensor]]:
        """Up to ``k`` stored rows (the highest priorities served fewer than ``max_reuse`` times), counted as served."""
        self.state, slots, valid = algos.replay_serve(self.state, k, max_reuse=self.max_reuse)
        out = [self.rows[s] for s in slots[valid].tolist()]
        self.rows = [r if f else None for r, f in zip(self.rows, self.state.filled.tolist())]
        return [r for r in out if r is not None]


def _stack(rows: list[dict[str, torch.Tensor]]) -> Batch:
    """Rows of several updates as one batch: token columns zero-padded (prompt columns on the left)."""
    out: Batch = {}
    for k in rows[0]:
        values = [r[k] for r in rows]
        if values[0].dim() == 0:
            out[k] = torch.stack(values)
            continue
        width = max(v.shape[0] for v in values)
        left = k.startswith("prompt")
        out[k] = torch.stack(
            [torch.nn.functional.pad(v, (width - v.shape[0], 0) if left else (0, width - v.shape[0])) for v in values]
        )
    return out


class Replay:
    """The replay buffer's three transforms of the update stage, from ``rl.replay``.

    Args:
      cfg: the :class:`ReplayConfig`.
    """

    def __init__(self, cfg: ReplayConfig):
        self.cfg = cfg
        self.buffer = ReplayBuffer(cfg.capacity, max_reuse=cfg.max_reuse)

    def dispatch(self, b: Batch) -> tuple[Batch, dict[str, Any]]:
        """The update's rows: the fresh ones, then the served ones (``replayed`` 1); the fresh offered to the buffer."""
        rows = b["advantages"].shape[0]
        served = self.buffer.serve(int(self.cfg.fraction * rows))
        recorded = b["rollout_logp"] if "rollout_logp" in b else b["old_logp"]
        fresh = {**b, "replayed": torch.zeros(rows), "replay_logp": recorded}
        on = b["loss_mask"] != 0
        advantage = masked_mean(b["advantages"], on.to(b["advantages"].dtype), dim=-1)
        keep = on.any(-1) & (advantage > self.cfg.min_advantage)
        self.buffer.add(fresh, advantage.float(), keep)
        mixed = fresh
        if served:
            old = _stack([{**r, "replayed": torch.ones(())} for r in served])
            mixed = _stack([*_rows(fresh, list(range(rows))), *_rows(old, list(range(len(served))))])
        metrics = {
            "replay/served": torch.tensor(float(len(served))),
            "replay/stored": torch.tensor(float(len(self.buffer))),
        }
        return mixed, metrics

    def forward(self, forward: Callable[[Batch], Batch]) -> Callable[[Batch], Batch]:
        """``forward`` with the replayed rows' loss mask weighted by ``min(pi / pi_sampled, cap)`` and ``old_logp`` anchored now."""
        cfg = self.cfg

        def run(b: Batch) -> Batch:
            batch = forward(b)
            if "replayed" not in b:
                return batch
            replayed = (b["replayed"] != 0)[:, None]
            logp = batch["logp"].detach()
            w = algos.truncated_is_weights(logp, b["replay_logp"], batch["mask"], level=cfg.level, cap=cfg.cap)
            out = {**batch, "mask": torch.where(replayed, batch["mask"] * w.to(batch["mask"].dtype), batch["mask"])}
            if "old_logp" in batch:
                out["old_logp"] = torch.where(replayed, logp, batch["old_logp"])
            return out

        return run

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """The buffer after step ``step``: its slots' state and their rows (copies: a background save may read them)."""
        state = self.buffer.state
        return {
            "priority": state.priority.clone(),
            "uses": state.uses.clone(),
            "filled": state.filled.clone(),
            "rows": [None if r is None else {k: v.clone() for k, v in r.items()} for r in self.buffer.rows],
        }

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`checkpoint_state`'s buffer (its capacity must be this one's)."""
        rows = list(state["rows"])
        if len(rows) != len(self.buffer.rows):
            raise ValueError(
                f"rl.replay.capacity: the checkpoint's buffer holds {len(rows)} slots, expected {len(self.buffer.rows)}"
            )
        self.buffer.state = algos.ReplayState(state["priority"], state["uses"], state["filled"])
        self.buffer.rows = rows

    def on_metrics(self, on_metrics: Callable[[Batch, torch.Tensor, dict[str, Any]], Any]) -> Callable[..., Any]:
        """``on_metrics`` over the fresh rows only: the step's reward, lengths and KL are not the replayed rows'."""

        def run(b: Batch, loss: torch.Tensor, metrics: dict[str, Any]) -> Any:
            if "replayed" in b:
                fresh = b["replayed"] == 0
                b = {k: v[fresh] for k, v in b.items() if k not in _ADDED}
            return on_metrics(b, loss, metrics)

        return run
