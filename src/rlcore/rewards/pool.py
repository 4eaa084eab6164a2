"""Rewards evaluated off the training thread, in a pool of worker processes."""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import torch

from rlcore.rewards.protocol import evaluate, reward_name

__all__ = ["RewardPool"]


def _score(reward: Any, prompts: list[str], responses: list[str], batch: Any, columns: dict[str, Any]) -> list[float]:
    # Lists cross the process boundary more cheaply than tensors (no shared-memory handles).
    return evaluate(reward, prompts, responses, batch=batch, **columns).tolist()


class RewardPool:
    """Score batches in worker processes while the trainer keeps computing.

    ``submit`` returns at once with a future of the float32 scores ``[B]``; rule rewards
    that parse text (regexes, a sandboxed verifier) then overlap the reference and
    old-policy forward passes instead of stalling them. Workers are started with
    ``spawn`` (safe with torch's threads); the reward is pickled once per batch, so it
    must be a module-level function or an instance of a module-level class.
    Errors raised in a worker come back from ``result()`` naming the reward and the batch.

    Args:
      reward: a :class:`rlcore.rewards.Reward` or ``BaseReward``-style object.
      num_workers: worker processes; ``0`` scores in the calling thread (for debugging).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, reward: Any, *, num_workers: int = 1):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers: got {num_workers!r}, expected an int >= 0")
        if num_workers:
            try:
                pickle.dumps(reward)
            except Exception as err:
                raise ValueError(
                    f"reward: {reward_name(reward)!r} cannot be pickled for a worker process ({err}); "
                    "define it at module level, or use num_workers=0"
                ) from err
        self.reward = reward
        self._executor = (
            ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn")) if num_workers else None
        )

    def submit(self, prompts: Sequence[str], responses: Sequence[str], *, batch: Any = None, **columns: Any) -> Future:
        """Start scoring one batch; ``.result()`` is the float32 tensor ``[B]``."""
        if self._executor is None:
            done: Future = Future()
            try:
                done.set_result(evaluate(self.reward, prompts, responses, batch=batch, **columns))
            except Exception as err:
                done.set_exception(err)
            return done
        inner = self._executor.submit(_score, self.reward, list(prompts), list(responses), batch, columns)
        outer: Future = Future()

        def convert(f: Future) -> None:
            if f.cancelled():
                outer.cancel()
                return
            err = f.exception()
            if err is not None:
                outer.set_exception(err)
            else:
                outer.set_result(torch.tensor(f.result(), dtype=torch.float32))

        inner.add_done_callback(convert)
        return outer

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], *, batch: Any = None, **columns: Any
    ) -> torch.Tensor:
        return self.submit(prompts, responses, batch=batch, **columns).result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
