"""Filter-and-refill over the dock: DAPO's dynamic sampling that draws prompts again until B groups are informative.

DAPO (Yu et al., 2025, arXiv 2503.14476) trains only on groups whose samples do not all
score the same (``0 < #correct < G``: a zero-variance group has no advantage), and keeps
drawing prompts until the batch holds ``B`` such groups, under a bound on the draws
(verl's ``max_num_gen_batches``). Here that is one sampling stage in place of the
rollout and the reward (``rl.max_refill_draws``, :class:`RefillPrompts`):

* the loader gives the iteration's slots only (``group``, ``iteration``, ``row``);
* the stage draws the step's ``B`` prompts (attempt 0: the same prompts as without
  refills), samples and scores them, and while fewer than ``B`` groups are informative
  and draws are left, draws as many new prompts as are missing (attempt ``a``: the
  prompt source's ``draw(..., attempt=a)``, their rows keyed past the earlier ones');
* :func:`rlcore.algos.refill_groups` picks the first ``B`` informative groups in draw
  order; the stage writes them into the slots, prompts and answers with them.

A slot no informative group was left for (the shortfall) holds a zero-variance group of
the draws: it trains nothing (its group advantage is 0; DAPO's filter masks it) and is
counted in the ``refill/shortfall`` metric. ``refill/draws`` counts the extra draws of a
step, ``refill/sampled_groups`` the groups sampled for it and ``refill/first_draw_reward``
the mean score of its first draw (the batch without refills; the step's ``reward`` is
the picked groups'), all this rank's.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from rlcore import algos
from rlcore.dataflow import Stage, stage
from rlcore.train.columns import COLUMNS

__all__ = ["RefillPrompts", "refill_stage"]

Batch = dict[str, Any]
# Token columns whose padding is on the left (a left-padded prompt ends at the response).
_LEFT = ("prompts", "prompt_mask")


def _rows(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, list) else list(value.unbind(0))


def _stack(rows: Sequence[torch.Tensor], *, left: bool) -> torch.Tensor:
    """Rows of one column (of different draws, so widths may differ) as one tensor, zero-padded."""
    if rows[0].dim() == 0:
        return torch.stack(list(rows))
    width = max(r.shape[0] for r in rows)
    pad = [torch.nn.functional.pad(r, (width - r.shape[0], 0) if left else (0, width - r.shape[0])) for r in rows]
    return torch.stack(pad)


def _padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged column as the dock hands it to a stage: right-padded rows and their ``_mask``."""
    mask = [torch.ones(len(r), dtype=torch.bool) for r in rows]
    return pad_sequence(rows, batch_first=True), pad_sequence(mask, batch_first=True)


def refill_stage(
    rollout: Stage,
    reward: Stage,
    draw: Callable[[int, int, int], Mapping[str, Any]],
    *,
    n_samples: int,
    max_draws: int,
    written: Sequence[str],
    on_metrics: Callable[[int, dict[str, float]], Any] | None = None,
) -> Stage:
    """One sampling stage: ``rollout`` and ``reward`` over drawn prompts, refilled until ``B`` groups are informative.

    Args:
      rollout: the deployment's rollout stage (its ``fn`` is called on each draw's rows,
        with the iteration's ``policy_version``).
      reward: the prompt source's reward stage (its ``fn`` is called on each draw's rows).
      draw: ``draw(step, count, attempt)`` -> the source columns of ``count`` prompts
        (each repeated ``n_samples`` times; ``group`` numbering them from 0).
      n_samples: responses per prompt.
      max_draws: extra draws at most after the first (``rl.max_refill_draws``, >= 0).
      written: the source columns the stage writes with the picked groups (the prompt
        source's, but the iteration's slots ``group``, ``iteration`` and ``row``).
      on_metrics: ``on_metrics(step, metrics)`` once per call (``refill/draws``,
        ``refill/shortfall``, ``refill/sampled_groups``, ``refill/first_draw_reward``).

    Returns:
      A rollout-role stage reading ``group``, ``iteration``, ``row`` and writing
      ``written`` plus the rollout's and the reward's outputs.
    """
    if isinstance(max_draws, bool) or not isinstance(max_draws, int) or max_draws < 0:
        raise ValueError(f"max_draws: got {max_draws!r}, expected an int >= 0")
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples: got {n_samples!r}, expected an int >= 1")
    outputs = [*written, *rollout.outputs, *reward.outputs]

    def sample(cols: Mapping[str, Any], version: torch.Tensor) -> Batch:
        rows = cols["iteration"].shape[0]
        ins: Batch = {c: cols[c] for c in rollout.inputs}
        ins["policy_version"] = version[:1].expand(rows).clone()
        out = {**cols, **rollout.fn(ins)}
        scoring: Batch = {}
        for c in reward.inputs:
            if isinstance(out[c], list):  # a ragged column reaches a stage padded, with its mask
                scoring[c], scoring[f"{c}_mask"] = _padded(out[c])
            else:
                scoring[c] = out[c]
        return {**out, **reward.fn(scoring)}

    def run(b: Batch) -> dict[str, Any]:
        step, slots = int(b["iteration"][0]), b["iteration"].shape[0]
        wanted = slots // n_samples
        draws: list[Batch] = []
        scores: list[torch.Tensor] = []
        pick = None
        for attempt in range(max_draws + 1):
            count = wanted if pick is None else int(pick.shortfall)
            if count == 0:
                break
            out = sample(draw(step, count, attempt), b["policy_version"])
            draws.append(out)
            scores.append(out["scores"].float())
            pick = algos.refill_groups(
                torch.cat(scores), torch.arange(sum(len(s) for s in scores)) // n_samples, wanted=wanted
            )
        assert pick is not None
        picked = pick.groups[pick.valid].tolist()
        # The shortfall's slots take the earliest groups not picked (zero-variance: they train nothing).
        total = sum(len(s) for s in scores) // n_samples
        chosen = set(picked)
        picked += [g for g in range(total) if g not in chosen][: wanted - len(picked)]
        where = [(i, g) for i, d in enumerate(draws) for g in range(d["iteration"].shape[0] // n_samples)]
        rows = [(where[g][0], where[g][1] * n_samples + k) for g in picked for k in range(n_samples)]
        result: dict[str, Any] = {}
        for c in outputs:
            per_draw = [_rows(d[c]) for d in draws]
            chosen_rows = [per_draw[i][r] for i, r in rows]
            result[c] = chosen_rows if isinstance(draws[0][c], list) else _stack(chosen_rows, left=c in _LEFT)
        if on_metrics is not None:
            on_metrics(
                step,
                {
                    "refill/draws": float(len(draws) - 1),
                    "refill/shortfall": float(pick.shortfall),
                    "refill/sampled_groups": float(total),
                    # The first draw's mean score: the reward of the batch without refills (the logged reward
                    # is the picked groups').
                    "refill/first_draw_reward": float(scores[0].mean()),
                },
            )
        return result

    return dataclasses.replace(
        stage(
            run,
            inputs=["group", "iteration", "row"],
            outputs=outputs,
            name="sample_refill",
            resource=rollout.resource,
            role="rollout",
            timeout=None if rollout.timeout is None else rollout.timeout * (max_draws + 1),
        ),
        phase=rollout.phase,
    )


# What the loader gives each slot of a refilled iteration; the sampling stage writes the rest.
SLOT_COLUMNS = COLUMNS.select("group", "iteration", "row")


class RefillPrompts:
    """A prompt source whose iterations are filled with informative groups (``rl.max_refill_draws``).

    Wraps a sampled prompt source (:class:`rlcore.train.TaskPrompts`,
    :class:`rlcore.train.DatasetPrompts`): its loader gives the slots only
    (:data:`SLOT_COLUMNS`) and its sampling is one :func:`refill_stage` over the
    source's ``draw``; everything else is the source's. Attempt 0 of a step draws the
    source's own batch, so a step whose groups are all informative is the same as
    without refills.

    Args:
      source: the prompt source (``draw(step, rank, count, n, attempt=)``, ``columns``).
      max_draws: extra draws at most per step (>= 1).
      n_samples: responses per prompt (``rl.num_rollouts``).
    """

    def __init__(self, source: Any, *, max_draws: int, n_samples: int):
        if isinstance(max_draws, bool) or not isinstance(max_draws, int) or max_draws < 1:
            raise ValueError(f"max_draws: got {max_draws!r}, expected an int >= 1")
        self.source, self.max_draws, self.n_samples = source, max_draws, n_samples
        self.columns = tuple(SLOT_COLUMNS)
        self._written = [c for c in source.columns if c not in SLOT_COLUMNS]
        self._where: tuple[int, int] | None = None
        self._metrics: dict[int, dict[str, float]] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def loader(self, rank: int, start: int, n: int) -> Callable[[int], dict[str, Any]]:
        """Pipeline iteration ``i`` -> the slots of step ``start + i``; the sampling stage draws for this ``rank``."""
        self._where = (rank, n)
        rows = self.source.batch_size * n

        def load(i: int) -> dict[str, Any]:
            return {
                "group": torch.arange(self.source.batch_size).repeat_interleave(n),
                "iteration": torch.full((rows,), start + i, dtype=torch.int64),
                "row": torch.arange(rows) + rank * rows,
            }

        return load

    def _draw(self, step: int, count: int, attempt: int) -> Mapping[str, Any]:
        if self._where is None:
            raise RuntimeError("RefillPrompts: the sampling stage ran before the loader was made (loader(rank, ...))")
        rank, n = self._where
        return self.source.draw(step, rank, count, n, attempt=attempt)

    def _record(self, step: int, metrics: dict[str, float]) -> None:
        with self._lock:
            self._metrics[step] = metrics

    def sampling(self, rollout: Stage, reward: Stage) -> list[Stage]:
        """One :func:`refill_stage` in place of the rollout and the reward."""
        return [
            refill_stage(
                rollout,
                reward,
                self._draw,
                n_samples=self.n_samples,
                max_draws=self.max_draws,
                written=self._written,
                on_metrics=self._record,
            )
        ]

    def step_metrics(self, step: int) -> dict[str, float]:
        """The source's metrics of step ``step`` and this rank's refill counts."""
        with self._lock:
            mine = self._metrics.pop(step, {})
        return {**self.source.step_metrics(step), **mine}
