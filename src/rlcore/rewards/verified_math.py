"""Verified maths: the final answer of a response checked against the reference with math-verify, under a timeout.

The answer is the last ``\\boxed{...}`` (nested braces balanced), else the text after
the last ``####``, else what math-verify's own extraction finds in the response (LaTeX
in math mode such as ``$\\frac{6}{8}$``, then plain expressions); it is compared by math-verify
(symbolic and numeric equivalence: ``\\frac{1}{2}`` = ``0.5`` = ``50\\%``,
``2(x+1)`` = ``2x+2``). Each comparison runs in a worker process that is killed when it
exceeds ``timeout`` seconds, so a pathological expression (``9^{9^{9^{9^9}}}``) scores
0 and is counted, instead of stalling the run (the extraction runs in the worker too,
under the same timeout); this works from any thread (math-verify's
own timeout uses signals, which work only on the main thread). The trainer's process
never imports math-verify or sympy.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from rlcore.rewards._answers import reference_answers
from rlcore.rewards._math_verify_worker import extract_final_answer

__all__ = ["VerifiedMath", "extract_final_answer"]

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_verify_worker.py")


def _gold_text(answer: Any) -> str:
    text = str(answer).strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


class _Worker:
    """One math-verify process and the thread that reads its replies."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.ready = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.replies.put(json.loads(line))
            except ValueError:
                continue
        self.replies.put(None)  # the process ended

    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            reply = None
        if not reply or not reply.get("ready"):
            self.kill()
            raise RuntimeError(
                f"VerifiedMath: the math-verify worker did not start within {timeout} s (is math-verify installed?)"
            )
        self.ready = True

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """The reply, or ``None`` when the worker ran past ``timeout`` (it is killed) or died."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return self.replies.get(timeout=timeout)
        except (queue.Empty, OSError):
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()


class VerifiedMath:
    """1.0 where the response's final answer is mathematically equal to the reference answer, else 0.0.

    Answers come from :func:`extract_final_answer` (a ``\\boxed{}`` answer, then ``####``),
    else from math-verify's own extraction over the whole response; equality is math-verify's
    ``verify(parse(gold), parse(answer))`` (Kydlíček et al., huggingface/Math-Verify),
    run in a worker process with a per-item ``timeout``: an item that runs longer scores
    0, the worker is replaced (a warm standby takes over at once) and the item is
    counted in :meth:`pop_metrics`. Thread-safe; pickles without its workers.

    Args:
      timeout: seconds one comparison may take.
      float_rounding, numeric_precision, strict: math-verify's ``verify`` options.
      startup_timeout: seconds a new worker may take to import math-verify.

    Call with ``prompts``, ``responses`` (``B`` strings) and ``answers`` (``B`` reference
    answers: strings, numbers, or one-element tensors read as their number); returns float32 ``[B]``.

    >>> reward = VerifiedMath()
    >>> reward(["q"] * 3, ["\\\\boxed{\\\\frac{1}{2}}", "#### 0.5", "it is 2"], answers=["0.5", "1/2", "3"])
    tensor([1., 1., 0.])
    >>> reward.pop_metrics()["checked"]
    3.0
    >>> reward.close()
    """

    name = "math"

    def __init__(
        self,
        *,
        timeout: float = 5.0,
        float_rounding: int = 6,
        numeric_precision: int = 15,
        strict: bool = True,
        startup_timeout: float = 120.0,
    ):
        for key, seconds in (("timeout", timeout), ("startup_timeout", startup_timeout)):
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
                raise ValueError(f"{key}: got {seconds!r}, expected a positive finite number of seconds")
        for key, value, low in (("float_rounding", float_rounding, 0), ("numeric_precision", numeric_precision, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key}: got {value!r}, expected an int >= {low} (digits)")
        if not isinstance(strict, bool):
            raise ValueError(f"strict: got {strict!r}, expected true or false")
        self.timeout = float(timeout)
        self.options = {"float_rounding": float_rounding, "numeric_precision": numeric_precision, "strict": strict}
        self.startup_timeout = float(startup_timeout)
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []  # [active, standby]
        self._counts = dict.fromkeys(("checked", "correct", "no_answer", "timeouts", "errors"), 0)
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    def __getstate__(self) -> dict[str, Any]:
        return {"timeout": self.timeout, "options": self.options, "startup_timeout": self.startup_timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def _active(self) -> _Worker:
        while len(self._workers) < 2:
            self._workers.append(_Worker())
        self._workers[0].wait_ready(self.startup_timeout)
        return self._workers[0]

    def _check(self, response: str, answer: Any) -> float:
        if answer is None:
            self._counts["no_answer"] += 1
            return 0.0
        request = {"gold": _gold_text(answer), "response": response, **self.options}
        reply = self._active().ask(request, self.timeout)
        if reply is None:
            self._workers.pop(0)
            self._counts["timeouts"] += 1
            return 0.0
        if "error" in reply:
            self._counts["errors"] += 1
            return 0.0
        if reply.get("found") is None:
            self._counts["no_answer"] += 1
        self._counts["correct"] += bool(reply["ok"])
        return float(bool(reply["ok"]))

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], *, answers: Sequence[Any] | None = None, **_: Any
    ) -> torch.Tensor:
        if answers is None or len(answers) != len(responses):
            got = None if answers is None else f"{len(answers)} values"
            raise ValueError(f"answers: got {got}, expected {len(responses)} reference answers (one per response)")
        answers = reference_answers(answers)
        with self._lock:
            scores = []
            for response, answer in zip(responses, answers):
                self._counts["checked"] += 1
                scores.append(self._check(response, answer))
        return torch.tensor(scores, dtype=torch.float32)

    def pop_metrics(self) -> dict[str, float]:
        """Counts since the last call: ``checked``, ``correct``, ``no_answer``, ``timeouts``, ``errors``."""
        with self._lock:
            out = {k: float(v) for k, v in self._counts.items()}
            self._counts = dict.fromkeys(self._counts, 0)
        return out

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        with self._lock:
            _kill_all(self._workers)
            self._workers.clear()
