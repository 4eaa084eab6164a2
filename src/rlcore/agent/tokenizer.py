"""A character tokenizer with whole-word special tokens (tool-call tags, JSON keys): nothing to download."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SpecialCharTokenizer"]


class SpecialCharTokenizer:
    """One token per character of ``alphabet`` (like :class:`rlcore.train.CharTokenizer`) and one per string of ``specials`` (matched first, longest first).

    Ids: ``<pad>`` 0, ``<eos>`` 1, the alphabet from 2, then the specials, so a tiny
    model writes ``<tool_call>`` or ``"expression"`` in one step, as a BPE vocabulary
    would.

    >>> tok = SpecialCharTokenizer("0123456789*", specials=["<tool_call>", "</tool_call>"])
    >>> ids = tok.encode("<tool_call>12*3</tool_call>")
    >>> len(ids), tok.decode(ids)
    (6, '<tool_call>12*3</tool_call>')
    >>> tok.token_id("</tool_call>")
    14
    """

    pad_token_id = 0
    eos_token_id = 1

    def __init__(self, alphabet: str, *, specials: Sequence[str] = ()):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet: got {alphabet!r}, expected distinct characters")
        self.alphabet = alphabet
        self._ids = {c: i + 2 for i, c in enumerate(alphabet)}
        specials = list(specials)
        if len(set(specials)) != len(specials) or any(len(s) < 2 for s in specials):
            raise ValueError(f"specials: got {specials!r}, expected distinct strings of 2+ characters")
        self.specials = specials
        self._special_ids = {s: len(alphabet) + 2 + i for i, s in enumerate(specials)}
        self._by_length = sorted(specials, key=len, reverse=True)

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 2 + len(self.specials)

    def token_id(self, token: str) -> int:
        """The id of one special token or one character."""
        if token in self._special_ids:
            return self._special_ids[token]
        if token not in self._ids:
            raise ValueError(f"token: got {token!r}, expected a special token or one character of the alphabet")
        return self._ids[token]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for s in self._by_length:
                if text.startswith(s, i):
                    ids.append(self._special_ids[s])
                    i += len(s)
                    break
            else:
                if text[i] not in self._ids:
                    raise ValueError(f"text: got character {text[i]!r} outside the alphabet {self.alphabet!r}")
                ids.append(self._ids[text[i]])
                i += 1
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the first ``<eos>``; ``<pad>`` is skipped."""
        out = []
        first_special = len(self.alphabet) + 2
        for i in ids:
            if i == self.eos_token_id:
                break
            if i >= first_special:
                out.append(self.specials[i - first_special])
            elif i >= 2:
                out.append(self.alphabet[i - 2])
        return "".join(out)
