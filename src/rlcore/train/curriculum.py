"""The pass-rate curriculum as a prompt source (``data.curriculum``): steps drawn by difficulty band.

:class:`CurriculumPrompts` wraps a prompt dataset (:class:`rlcore.train.DatasetPrompts`):
its reward stage records each sample's score against its prompt (``index``), and its
loader draws each step's prompts by :func:`rlcore.data.curriculum_probs` of the running
pass rates (:func:`rlcore.data.pass_rate_update`, :func:`rlcore.data.difficulty_bands`).

The pipeline loads a step while earlier ones are still scored (the loader runs ahead),
so the draw of step ``s`` reads the rates of steps up to ``s - lag`` only, with ``lag``
the loader's lead (2, plus ``deploy.staleness`` when the rollout runs ahead): which
scores a draw sees then never depends on timing, and a run is reproducible. The rates
are this rank's; the checkpoint of step ``s`` holds them as the draw of step ``s + 1``
reads them, with the recorded scores of the steps after those
(:meth:`CurriculumPrompts.checkpoint_state`), so a resumed run draws what an uninterrupted
one would.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlcore import seeding
from rlcore.data import (
    CurriculumConfig,
    curriculum_draw,
    curriculum_probs,
    difficulty_bands,
    pass_rate_update,
)
from rlcore.dataflow import Stage

__all__ = ["CurriculumPrompts"]


class CurriculumPrompts:
    """A prompt dataset drawn by the pass-rate curriculum; everything else is the dataset's.

    Args:
      source: a :class:`rlcore.train.DatasetPrompts` (``dataset``, ``columns_of``, ``reward_stage``).
      cfg: the :class:`rlcore.data.CurriculumConfig`.
      lag: a step's draw reads the pass rates of steps up to ``step - lag`` (>= 1).
    """

    def __init__(self, source: Any, cfg: CurriculumConfig, *, lag: int):
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag: got {lag!r}, expected an int >= 1")
        self.source, self.cfg, self.lag = source, cfg, lag
        self.rates = torch.full((len(source.dataset),), cfg.initial, dtype=torch.float64)
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # What a checkpoint needs: the rates with the steps up to `_base_through` folded, and every
        # recorded score of a later step (a draw may have folded some of them into `rates` already).
        self._base, self._base_through = self.rates.clone(), -1
        self._kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def _fold(self, rates: torch.Tensor, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        for index, scores in batches:
            rates = pass_rate_update(rates, index, scores, decay=self.cfg.decay, threshold=self.cfg.threshold)
        return rates

    def _catch_up(self, step: int) -> None:
        """Fold the recorded scores of the steps up to ``step - lag`` into the rates, in step order."""
        with self._lock:
            due = sorted(s for s in self._pending if s <= step - self.lag)
            batches = [b for s in due for b in self._pending.pop(s)]
        self.rates = self._fold(self.rates, batches)

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """After step ``step``: the rates the draw of step ``step + 1`` reads, and the scores of the steps after those.

        The steps up to ``step + 1 - lag`` are folded into the saved rates (in step order, as
        the draws fold them); the recorded scores of the steps after, up to ``step``, are kept
        as they were recorded.
        """
        through = step + 1 - self.lag
        with self._lock:
            due = sorted(s for s in self._kept if s <= through)
            batches = [b for s in due for b in self._kept.pop(s)]
            later = {s: [(i.clone(), v.clone()) for i, v in self._kept[s]] for s in sorted(self._kept) if s <= step}
        if through > self._base_through:
            self._base, self._base_through = self._fold(self._base, batches), through
        return {"rates": self._base.clone(), "through": self._base_through, "pending": later}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`checkpoint_state`'s rates and scores (the same dataset)."""
        rates = state["rates"]
        if rates.shape != self.rates.shape:
            raise ValueError(
                f"data.curriculum: the checkpoint's pass rates cover {rates.shape[0]} prompts, expected "
                f"{self.rates.shape[0]} (the dataset's rows)"
            )
        with self._lock:
            self.rates, self._base, self._base_through = rates.clone(), rates.clone(), int(state["through"])
            self._pending = {int(s): list(b) for s, b in state["pending"].items()}
            self._kept = {int(s): list(b) for s, b in state["pending"].items()}

    def pick(self, step: int, rank: int, count: int, *, attempt: int = 0) -> list[int]:
        """Attempt 0: ``count`` prompts by band (stream ``(seed, Purpose.CURRICULUM, step, rank)``); else the dataset's draw."""
        if attempt:
            return self.source.pick(step, rank, count, attempt=attempt)
        self._catch_up(step)
        probs = curriculum_probs(difficulty_bands(self.rates, self.cfg.edges), self.cfg.weights)
        g = seeding.generator(self.source.seed, seeding.Purpose.CURRICULUM, step, rank)
        return curriculum_draw(probs, count, g)

    def draw(self, step: int, rank: int, count: int, n: int, *, attempt: int = 0) -> dict[str, Any]:
        """The source columns of ``count`` prompts (:meth:`pick`), each repeated ``n`` times."""
        return self.source.columns_of(self.pick(step, rank, count, attempt=attempt), step, rank, n, attempt=attempt)

    def loader(self, rank: int, start: int, n: int) -> Callable[[int], dict[str, Any]]:
        """Pipeline iteration ``i`` -> the source columns of step ``start + i``, drawn by the curriculum."""

        def load(i: int) -> dict[str, Any]:
            return self.draw(start + i, rank, self.source.batch_size, n)

        return load

    def reward_stage(self, pool: Any, **kwargs: Any) -> Stage:
        """The dataset's reward stage, recording each scored row's prompt and score for the rates."""
        inner = self.source.reward_stage(pool, **kwargs)

        def reward(b: dict[str, torch.Tensor]) -> Any:
            out = inner.fn(b)
            with self._lock:
                step, record = int(b["iteration"][0]), (b["index"].clone(), out["scores"])
                self._pending.setdefault(step, []).append(record)
                self._kept.setdefault(step, []).append(record)
            return out

        return dataclasses.replace(inner, fn=reward)

    def sampling(self, rollout: Stage, reward: Stage) -> list[Stage]:
        """The rollout, then the reward."""
        return [rollout, reward]

    def step_metrics(self, step: int) -> dict[str, float]:
        """The dataset's metrics, the share of prompts in each band (``curriculum/band_<i>``) and the mean rate."""
        bands = difficulty_bands(self.rates, self.cfg.edges)
        share = torch.bincount(bands, minlength=len(self.cfg.weights)).double() / max(len(bands), 1)
        out = {f"curriculum/band_{i}": float(v) for i, v in enumerate(share.tolist())}
        return {**self.source.step_metrics(step), **out, "curriculum/mean_rate": float(self.rates.mean())}
