"""Rewards that hang or die, importable by worker processes (tests/ is on their path), and process probes."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path


class StuckInC:
    """Writes its worker's pid to ``marker``, then backtracks in ``re`` for ever: C code holding the GIL."""

    name = "stuck_in_c"

    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, prompts, responses, **columns):
        # Written whole, then renamed: a test polling for the file never reads it half-written.
        Path(self.marker + ".tmp").write_text(str(os.getpid()))
        os.replace(self.marker + ".tmp", self.marker)
        re.match(r"(a+)+$", "a" * 64 + "b")
        return [0.0] * len(responses)


class Sleeps:
    """Sleeps ``seconds`` in Python when a response is ``"slow"``, then scores 1.0."""

    name = "sleeps"

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, prompts, responses, **columns):
        if "slow" in responses:
            time.sleep(self.seconds)
        return [1.0] * len(responses)


class DiesInWorker:
    """Ends its process at once (as an out-of-memory kill or a segfault would) when called."""

    name = "dies"

    def __call__(self, prompts, responses, **columns):
        os._exit(9)


def count_chars(prompts, responses, **columns):
    return [float(len(r)) for r in responses]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Every living process below ``pid`` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p for p in found if alive(p)}


def wait_for(predicate, seconds: float, poll: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``seconds`` pass; returns its last value."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def process_report(pid: int) -> str:
    """What a stuck process is doing, for a test's failure message: its signal masks and each thread's state."""
    lines = []
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        lines += [
            line
            for line in status
            if line.startswith(("State", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
        ]
        for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            blocked = next(x for x in (task / "status").read_text().splitlines() if x.startswith("SigBlk"))
            lines.append(f"thread {task.name}: {stat} {(task / 'wchan').read_text()} {blocked}")
    except OSError as err:
        lines.append(f"({err})")
    return "\n".join(lines)


def math_verify_verdict(gold, response) -> bool:  # type: ignore[no-untyped-def]
    """math-verify's own verdict on the same strings (the gold as rlcore hands it over: in math mode)."""
    from math_verify import parse, verify

    logging.disable(logging.WARNING)
    try:
        text = str(gold)
        return bool(verify(parse(text if "$" in text else f"${text}$"), parse(response)))
    finally:
        logging.disable(logging.NOTSET)


class FailsFirst:
    """The first ``times`` calls (counted by files in ``marker_dir``, over every worker) die, or hang with ``hang``;
    later calls score each response by its length."""

    name = "fails_first"

    def __init__(self, marker_dir: str, times: int, *, hang: bool = False):
        self.marker_dir, self.times, self.hang = marker_dir, times, hang

    def __call__(self, prompts, responses, **columns):
        done = len(os.listdir(self.marker_dir))
        if done < self.times:
            Path(self.marker_dir, f"fault{done}").touch()
            if self.hang:
                time.sleep(600)
            os._exit(9)
        return [float(len(r)) for r in responses]
