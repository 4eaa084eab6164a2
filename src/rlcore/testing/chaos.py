"""Chaos for fault-tolerance tests: SIGKILL a run's rollout worker every N steps and its reward worker once.

:class:`ChaosReward` wraps the run's reward and does the killing from inside the reward
worker process (``trainer.reward_workers: 1``), at known points of the blocking
pipeline: when step ``s`` is scored, its rows are already sampled and the rollout of
step ``s + 1`` has not begun, so a rollout worker killed then is seen (and replaced) by
the next step's rollout, and a reward worker that kills itself there is seen by the
reward pool at once (its rows are scored again). Linux only (it reads ``/proc``).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ChaosReward", "descendants"]


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every living process below ``pid`` (children, their children, ...) with its command line, by pid."""
    parents = {}
    for entry in Path("/proc").iterdir():
        stat = _stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat[0] != "Z":  # a zombie is dead already
            parents[int(entry.name)] = int(stat[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    out = []
    for p in sorted(found):
        try:
            out.append((p, Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue
    return out


def _parent(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else int(stat[1])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


class ChaosReward:
    """``reward`` that SIGKILLs the rollout worker after every ``every``-th step's rollout and its own worker once.

    Runs in the run's one reward worker process. Calls are told apart by their prompts
    and responses (one call per step in the trainer), so a call scored again after its
    worker was killed is recognised and neither counted nor killed again. Each kill is
    a file in ``marker_dir`` (:meth:`kills` counts them).

    Args:
      reward: the reward to score with (picklable: it goes to the worker process).
      marker_dir: an empty directory shared with the test.
      every: kill the rollout worker while scoring calls ``every``, ``2 * every``, ... (1-based).
      reward_at: kill this worker process while scoring call ``reward_at`` (None: never).
      ray: the rollout worker is a Ray actor (found by its process title ``ray::RolloutActor``)
        instead of a process started by the trainer.
      last: the last call that may kill the rollout worker (so that a later rollout sees it).
    """

    name = "chaos"

    def __init__(
        self,
        reward: Any,
        marker_dir: str | os.PathLike,
        *,
        every: int,
        reward_at: int | None = None,
        ray: bool = False,
        last: int | None = None,
    ):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every: got {every!r}, expected an int >= 1")
        self.reward, self.dir = reward, str(marker_dir)
        self.every, self.reward_at, self.ray, self.last = every, reward_at, ray, last

    def kills(self) -> tuple[int, int]:
        """(rollout worker kills, reward worker kills) so far."""
        names = os.listdir(self.dir)
        return sum(n.startswith("rollout-kill") for n in names), sum(n.startswith("reward-kill") for n in names)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **columns: Any) -> Any:
        key = hashlib.sha256("\0".join([*prompts, "\1", *responses]).encode()).hexdigest()
        seen = Path(self.dir, f"call-{key}")
        if not seen.exists():
            n = sum(name.startswith("call-") for name in os.listdir(self.dir)) + 1
            seen.write_text(str(n))
            if n % self.every == 0 and (self.last is None or n <= self.last):
                self._kill_rollout(n)
            if n == self.reward_at:
                Path(self.dir, f"reward-kill-{n}").touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return self.reward(prompts, responses, **columns)

    def _kill_rollout(self, n: int) -> None:
        trainer = os.getppid()
        if self.ray:
            found = [p for p, cmd in descendants(trainer) if cmd.startswith("ray::RolloutActor")]
        else:  # the trainer's other spawned child: this worker is the only reward worker
            found = [
                p
                for p, cmd in descendants(trainer)
                if "spawn_main" in cmd and p != os.getpid() and _parent(p) == trainer
            ]
        if len(found) != 1:
            raise RuntimeError(f"chaos: expected one rollout worker to kill at call {n}, found {found}")
        os.kill(found[0], signal.SIGKILL)
        end = time.monotonic() + 30
        while _alive(found[0]) and time.monotonic() < end:  # gone before the next rollout can start
            time.sleep(0.01)
        Path(self.dir, f"rollout-kill-{n}").touch()
