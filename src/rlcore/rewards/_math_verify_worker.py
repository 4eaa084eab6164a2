"""The math-verify worker: run as a script (``python _math_verify_worker.py``), one JSON request per stdin line.

A request is ``{"gold", "response", <verify options>}``. The worker extracts the
response's final answer (:func:`extract_final_answer`, then math-verify's own LaTeX and
expression extraction), parses and compares, and answers ``{"ok": bool, "found": kind}``
or ``{"error": str}`` per request on the original stdout. It imports only math-verify
(not torch or rlcore), and exits when stdin closes or its parent dies. It has no
timeout of its own: the parent kills it when an item runs too long -- extraction
included -- which works from any thread of the parent (math-verify's own timeout uses
signals, which work only on the main thread).

The extraction is plain Python here so that the trainer's process imports it without
math-verify: ``rlcore.rewards.extract_final_answer`` is this function.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any

# One token of the brace scan: an opening box, a brace, or a backslash-escaped brace (\{ \}).
_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|\\[{}]|[{}]")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_SOLID = re.compile(r"\S")


def _last_box(text: str) -> tuple[int, int] | None:
    """``(start, end)`` of the contents of the last complete ``\\boxed{...}`` with non-blank contents, or None.

    One pass over the text with a stack of open braces: linear in the text, however many
    boxes are left unclosed. "Last" is the box that opens last (``\\boxed{\\boxed{3}}``
    gives the inner one); blank boxes are skipped.
    """
    stack: list[int] = []  # per open brace: where its box's contents start, or -1 for a plain brace
    closed: list[tuple[int, int]] = []  # (start, end) of each complete box
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token[0] == "\\" and len(token) == 2:  # an escaped brace: a literal character, as in \{1,2\}
            continue
        if token == "}":
            if stack:
                start = stack.pop()
                if start >= 0:
                    closed.append((start, match.start()))
        elif token == "{":
            stack.append(-1)
        else:
            stack.append(match.end())
    # Blank boxes hold no other box, so they are disjoint: the scan below is linear too.
    for start, end in sorted(closed, reverse=True):
        if _SOLID.search(text, start, end):
            return start, end
    return None


def extract_final_answer(text: str) -> tuple[str, str] | None:
    """The marked final answer of a response and its mark: ``("boxed", answer)``, ``("####", answer)``, or ``None``.

    In order: the last complete ``\\boxed{...}`` (braces balanced, so
    ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``; MATH, arXiv:2103.03874), then the
    text after the last ``####`` (GSM8K, arXiv:2110.14168). ``None`` when the response
    marks no answer: :class:`rlcore.rewards.VerifiedMath` then hands the whole response
    to math-verify's own extraction (LaTeX in math mode, then plain expressions), so
    ``The answer is $\\frac{6}{8}$`` is read as ``3/4``. Linear in the length of ``text``.

    >>> extract_final_answer("so \\\\boxed{\\\\frac{1}{2}} it is")
    ('boxed', '\\\\frac{1}{2}')
    >>> extract_final_answer("she pays 3 + 4 dollars\\n#### 7")
    ('####', '7')
    >>> extract_final_answer("first 12, then -1,250.5") is None
    True
    """
    box = _last_box(text)
    if box is not None:
        return "boxed", text[box[0] : box[1]].strip()
    last = None
    for match in _HASHES.finditer(text):
        if match.group(1).strip():
            last = match.group(1).strip()
    return ("####", last) if last is not None else None


def _watch_parent(parent: int) -> None:
    # A runaway sympy computation never reads stdin again, so EOF alone cannot stop it.
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _answer(req: dict[str, Any], parse: Any, configs: list[Any]) -> tuple[str | None, Any]:
    """``(kind, parsed answer)``: the marked answer parsed, else math-verify's extraction over the whole response."""
    found = extract_final_answer(req["response"])
    if found is None:
        parsed = parse(req["response"], extraction_config=configs, parsing_timeout=None)
        return ("math-verify" if parsed else None), parsed
    kind, text = found
    return kind, parse(
        f"\\boxed{{{text}}}" if kind == "boxed" else text, extraction_config=configs, parsing_timeout=None
    )


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the replies
    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeout is off
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    # The first parse and verify build math-verify's grammars and import sympy's parts: done
    # here, under the start-up timeout, so that no item's own timeout pays for them.
    verify(
        parse("\\boxed{1}", extraction_config=configs, parsing_timeout=None),
        parse("1", parsing_timeout=None),
        timeout_seconds=None,
    )
    out.write('{"ready": true}\n')
    for line in sys.stdin:
        try:
            req = json.loads(line)
            kind, answer = _answer(req, parse, configs)
            gold = parse(req["gold"], parsing_timeout=None)
            ok = bool(
                gold
                and answer
                and verify(
                    gold,
                    answer,
                    float_rounding=req["float_rounding"],
                    numeric_precision=req["numeric_precision"],
                    strict=req["strict"],
                    timeout_seconds=None,
                )
            )
            reply: dict[str, Any] = {"ok": ok, "found": kind}
        except Exception as err:
            reply = {"error": f"{type(err).__name__}: {err}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
