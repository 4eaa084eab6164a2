"""Chaos for fault-tolerance tests: SIGKILL a run's rollout worker every N steps and a reward worker once.

:class:`Chaos` watches a run's ``metrics.jsonl`` from a thread of the process that runs
:func:`rlcore.train.train` and kills the workers that process started, by their process
ids: the disaggregated rollout worker (a :class:`rlcore.dataflow.RolloutWorker` process,
or a :class:`rlcore.dataflow.RayRolloutWorker` actor of a Ray instance this process
started) and a :class:`rlcore.rewards.RewardPool` worker. Linux only (it reads ``/proc``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["Chaos", "descendants"]


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if stat[0] != "Z":  # a zombie is dead already
                parents[int(entry.name)] = int(stat[1])
    return parents


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every living process below ``pid`` (children, their children, ...) with its command line, by pid."""
    parents, found, frontier = _parents(), set(), {pid}
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


class Chaos:
    """SIGKILL the rollout worker after every ``every``-th step and a reward worker after step ``reward_at``.

    A kill is made only while a later step is still to run (its rollout sees the death),
    so with restarts the run's restart counts equal :attr:`rollout_kills` and
    :attr:`reward_kills`. Use as a context manager around the run.

    Args:
      out: the run's ``trainer.output_dir`` (its ``metrics.jsonl`` counts the finished steps).
      steps: the run's ``trainer.steps``.
      every: kill the rollout worker when ``every``, ``2 * every``, ... steps have finished.
      reward_at: kill one reward worker process when this many steps have finished (None: never).
      ray: the rollout worker is a Ray actor (found by its process title) instead of a process.
      poll: seconds between looks at the metrics.
    """

    def __init__(
        self, out: str | os.PathLike, steps: int, *, every: int, reward_at: int | None = None, ray: bool = False,
        poll: float = 0.02,
    ):
        if every < 1:
            raise ValueError(f"every: got {every!r}, expected an int >= 1")
        self.metrics = Path(out) / "metrics.jsonl"
        self.steps, self.every, self.reward_at, self.ray, self.poll = steps, every, reward_at, ray, poll
        self.rollout_kills = 0
        self.reward_kills = 0
        self.missed: list[str] = []  # kills due that found no process to kill
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rlcore-chaos")

    def __enter__(self) -> Chaos:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)

    def _done(self) -> int:
        try:
            with open(self.metrics) as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def _rollout_pids(self) -> list[int]:
        if self.ray:
            return [p for p, cmd in descendants(os.getpid()) if cmd.startswith("ray::RolloutActor")]
        return _children("rlcore-rollout-worker")

    def _run(self) -> None:
        next_kill, reward_due = self.every, self.reward_at
        while not self._stop.wait(self.poll):
            done = self._done()
            if done >= self.steps:
                return
            if done >= next_kill:
                next_kill += self.every
                if _kill(self._rollout_pids()):
                    self.rollout_kills += 1
                else:
                    self.missed.append(f"rollout worker after step {done}")
            if reward_due is not None and done >= reward_due:
                reward_due = None
                if _kill(_children("rlcore-reward-worker")[:1]):
                    self.reward_kills += 1
                else:
                    self.missed.append(f"reward worker after step {done}")


def _children(name: str) -> list[int]:
    return [p.pid for p in multiprocessing.active_children() if p.name == name and p.pid is not None]


def _kill(pids: Sequence[int]) -> bool:
    killed = False
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed = True
        except ProcessLookupError:
            continue
    # The kill is seen by the next call: wait until the process is gone, so it is never counted twice.
    end = time.monotonic() + 10
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.01)
    return killed


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
