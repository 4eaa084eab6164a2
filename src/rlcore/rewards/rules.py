"""Rule rewards for verifiable tasks: answer extraction and exact / numeric match, format regex, length."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch

from rlcore.rewards._answers import reference_answers

__all__ = ["AnswerMatch", "FormatMatch", "LengthReward", "extract_answer"]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


def extract_answer(text: str, *, pattern: str | None = None) -> str | None:
    """The final answer in a response, or ``None`` when it has none.

    With ``pattern``, the first group (or the whole match) of its *last* match.
    Otherwise the conventions of the math-reasoning datasets, in order: the last
    ``\\boxed{...}`` (MATH, Hendrycks et al. 2021, arXiv:2103.03874), the text after
    the last ``####`` (GSM8K, Cobbe et al. 2021, arXiv:2110.14168), the last number.

    >>> extract_answer("so 3 + 4 = \\\\boxed{7}")
    '7'
    >>> extract_answer("first 12, then 1,250.5 apples")
    '1,250.5'
    >>> extract_answer("<answer>abc</answer>", pattern=r"<answer>(.*?)</answer>")
    'abc'
    """
    if pattern is not None:
        matches = list(re.finditer(pattern, text))
        if not matches:
            return None
        last = matches[-1]
        return last.group(1) if last.re.groups else last.group(0)
    for regex in (_BOXED, _HASHES):
        found = regex.findall(text)
        if found:
            return found[-1].strip()
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def _regex(pattern: Any, flags: int = 0) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise ValueError(f"pattern: got {pattern!r}, expected a regular expression string")
    try:
        return re.compile(pattern, flags)
    except re.error as err:
        raise ValueError(f"pattern: got {pattern!r}, not a regular expression ({err})") from err


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def _check_column(name: str, values: Sequence[Any] | None, n: int) -> Sequence[Any]:
    if values is None:
        raise ValueError(f"{name}: got None, expected a column of {n} reference answers")
    if len(values) != n:
        raise ValueError(f"{name}: got {len(values)} values, expected {n} (one per response)")
    return reference_answers(values, name)


class AnswerMatch:
    """1.0 where the extracted answer equals the reference answer, else 0.0.

    Exact match compares stripped strings; ``numeric=True`` parses both as numbers
    (commas dropped) and compares with ``math.isclose(rel_tol=rel_tol, abs_tol=abs_tol)``.
    A response without an answer scores 0.

    Args (call): ``prompts``, ``responses`` (``B`` strings), ``answers`` (``B`` reference
    answers: strings, numbers, or one-element tensors read as their number).

    >>> AnswerMatch(numeric=True)(["1+1="], ["it is 2.0"], answers=["2"])
    tensor([1.])
    """

    name = "answer_match"

    def __init__(
        self, *, pattern: str | None = None, numeric: bool = False, rel_tol: float = 1e-12, abs_tol: float = 1e-9
    ):
        if pattern is not None:
            _regex(pattern)
        for key, tol in (("rel_tol", rel_tol), ("abs_tol", abs_tol)):
            if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < math.inf:
                raise ValueError(f"{key}: got {tol!r}, expected a finite number >= 0")
        self.pattern, self.numeric, self.rel_tol, self.abs_tol = pattern, numeric, rel_tol, abs_tol

    def _match(self, response: str, answer: Any) -> bool:
        got = extract_answer(response, pattern=self.pattern)
        if got is None:
            return False
        if not self.numeric:
            return got.strip() == str(answer).strip()
        a, b = _to_number(got), _to_number(str(answer))
        return a is not None and b is not None and math.isclose(a, b, rel_tol=self.rel_tol, abs_tol=self.abs_tol)

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], *, answers: Sequence[Any] | None = None, **_: Any
    ) -> torch.Tensor:
        answers = _check_column("answers", answers, len(responses))
        return torch.tensor([float(self._match(r, a)) for r, a in zip(responses, answers)], dtype=torch.float32)


class FormatMatch:
    """1.0 where the response matches a regular expression (the whole response, or anywhere with ``search=True``).

    The format reward of DeepSeek-R1 (arXiv:2501.12948), e.g.
    ``FormatMatch(r"<think>.*?</think>\\s*<answer>.*?</answer>")``.

    >>> FormatMatch(r"\\d+")(["q", "q"], ["42", "4 2"])
    tensor([1., 0.])
    """

    name = "format_match"

    def __init__(self, pattern: str, *, search: bool = False, flags: int = re.DOTALL):
        self.regex = _regex(pattern, flags)
        self.search = search

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **_: Any) -> torch.Tensor:
        test = self.regex.search if self.search else self.regex.fullmatch
        return torch.tensor([float(test(r) is not None) for r in responses], dtype=torch.float32)


class LengthReward:
    """1.0 for a response of ``min_length <= len <= max_length`` characters, falling linearly to 0 outside.

    Outside the range the score is ``max(0, 1 - distance / slack)``; ``slack=0`` makes it a
    hard 0/1 window.

    >>> LengthReward(min_length=2, max_length=4, slack=2)(["q"] * 3, ["abc", "abcdef", "a"])
    tensor([1.0000, 0.0000, 0.5000])
    """

    name = "length"

    def __init__(self, *, min_length: int = 0, max_length: int | None = None, slack: int = 0):
        for key, value in (("min_length", min_length), ("max_length", max_length), ("slack", slack)):
            if (value is not None or key != "max_length") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{key}: got {value!r}, expected an int (characters)")
        if min_length < 0 or (max_length is not None and max_length < min_length) or slack < 0:
            raise ValueError(
                f"min_length, max_length, slack: got {min_length}, {max_length}, {slack}, "
                "expected 0 <= min_length <= max_length and slack >= 0"
            )
        self.min_length, self.max_length, self.slack = min_length, max_length, slack

    def _score(self, n: int) -> float:
        hi = math.inf if self.max_length is None else self.max_length
        distance = max(self.min_length - n, n - hi, 0)
        if distance == 0:
            return 1.0
        return 0.0 if self.slack == 0 else max(0.0, 1.0 - distance / self.slack)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **_: Any) -> torch.Tensor:
        return torch.tensor([self._score(len(r)) for r in responses], dtype=torch.float32)
