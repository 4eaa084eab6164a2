"""Tiny verifiable tasks generated on the fly, with a character tokenizer: nothing to download.

A task makes prompts with reference answers from a ``torch.Generator`` (so a run's data
order is a function of its seed and step, which is what makes ``--resume`` exact), and
scores responses with a rule reward from :mod:`rlcore.rewards`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlcore.agent import Multiplication
from rlcore.rewards import AnswerMatch

__all__ = ["TASKS", "Addition", "CharTokenizer", "Reversal", "make_task"]


class CharTokenizer:
    """One token per character of a fixed alphabet, plus ``<pad>`` (id 0) and ``<eos>`` (id 1).

    >>> tok = CharTokenizer("0123456789+=")
    >>> tok.encode("12+3=")
    [3, 4, 12, 5, 13]
    >>> tok.decode([5, 6, tok.eos_token_id, 7])
    '34'
    """

    pad_token_id = 0
    eos_token_id = 1

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet: got {alphabet!r}, expected distinct characters")
        self.alphabet = alphabet
        self._ids = {c: i + 2 for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 2

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(self._ids))
        if unknown:
            raise ValueError(f"text: got characters {unknown} outside the alphabet {self.alphabet!r}")
        return [self._ids[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        """Characters up to the first ``<eos>``; ``<pad>`` is skipped."""
        out = []
        for i in ids:
            if i == self.eos_token_id:
                break
            if i >= 2:
                out.append(self.alphabet[i - 2])
        return "".join(out)


class Addition:
    """``"a+b="`` -> ``"c"`` for non-negative integers of 1 to ``digits`` digits; reward: numeric match.

    >>> task = Addition(digits=2)
    >>> s = task.sample(1, torch.Generator().manual_seed(0))[0]
    >>> a, b = s["prompt"].rstrip("=").split("+")
    >>> int(s["answer"]) == int(a) + int(b)
    True
    """

    alphabet = "0123456789+="

    def __init__(self, *, digits: int = 2):
        if digits < 1:
            raise ValueError(f"digits: got {digits}, expected >= 1")
        self.digits = digits
        self.tokenizer = CharTokenizer(self.alphabet)
        self.reward = AnswerMatch(numeric=True)
        self.max_answer_length = digits + 1

    def sample(self, n: int, generator: torch.Generator) -> list[dict[str, Any]]:
        ab = torch.randint(0, 10**self.digits, (n, 2), generator=generator).tolist()
        return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ab]


class Reversal:
    """``"abc>"`` -> ``"cba"`` for strings of ``min_length`` to ``length`` letters; reward: exact match.

    >>> task = Reversal(length=4, letters="abcd")
    >>> s = task.sample(1, torch.Generator().manual_seed(0))[0]
    >>> s["answer"] == s["prompt"][:-1][::-1]
    True
    """

    def __init__(self, *, length: int = 4, min_length: int = 2, letters: str = "abcdefgh"):
        if not 1 <= min_length <= length:
            raise ValueError(f"min_length, length: got {min_length}, {length}, expected 1 <= min_length <= length")
        if not isinstance(letters, str) or not letters:
            raise ValueError(f"letters: got {letters!r}, expected at least one letter")
        self.length, self.min_length, self.letters = length, min_length, letters
        self.tokenizer = CharTokenizer(letters + ">")
        self.reward = AnswerMatch(pattern=r"\S+")
        self.max_answer_length = length

    def sample(self, n: int, generator: torch.Generator) -> list[dict[str, Any]]:
        lengths = torch.randint(self.min_length, self.length + 1, (n,), generator=generator).tolist()
        chars = torch.randint(0, len(self.letters), (n, self.length), generator=generator).tolist()
        out = []
        for k, row in zip(lengths, chars):
            s = "".join(self.letters[c] for c in row[:k])
            out.append({"prompt": s + ">", "answer": s[::-1]})
        return out


TASKS = {"addition": Addition, "reversal": Reversal, "multiplication": Multiplication}


def make_task(name: str, **options: Any) -> Addition | Reversal | Multiplication:
    """Build a task by name (``"addition"``, ``"reversal"`` or ``"multiplication"``, the agent task with a calculator) with its options."""
    if name not in TASKS:
        raise ValueError(f"task: got {name!r}, expected one of {', '.join(repr(t) for t in TASKS)}")
    return TASKS[name](**options)
