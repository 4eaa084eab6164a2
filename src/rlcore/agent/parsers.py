"""Tool-call parsers: find the calls in a policy turn's text. Hermes / Qwen's format by default, pluggable.

A parser is any callable ``text -> ParsedCalls``. The Hermes function-calling format
(NousResearch's Hermes 2 Pro, adopted by Qwen2.5's chat template) wraps each call in
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = ["HermesParser", "ParsedCalls", "ToolCall", "ToolCallParser"]


class ToolCall(NamedTuple):
    """One well-formed call: the tool's name and its arguments object."""

    name: str
    arguments: Mapping[str, Any]


class ParsedCalls(NamedTuple):
    """The calls found in a turn, in order, and an error message per malformed call.

    >>> ParsedCalls([], []).found
    False
    """

    calls: list[ToolCall]
    errors: list[str]

    @property
    def found(self) -> bool:
        """The turn attempted at least one call (well-formed or not)."""
        return bool(self.calls or self.errors)


@runtime_checkable
class ToolCallParser(Protocol):
    """``parser(text) -> ParsedCalls``."""

    def __call__(self, text: str) -> ParsedCalls: ...


class HermesParser:
    """Parse ``<tool_call>{"name": str, "arguments": object}</tool_call>`` blocks.

    A block whose body is not JSON, not an object, lacks a string ``name`` or has
    non-object ``arguments`` becomes an error message, not a call. An opening tag
    without its closing tag (the turn was cut off) is an error too.

    Args:
      start, end: the tags around a call.

    >>> HermesParser()('<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>')
    ParsedCalls(calls=[ToolCall(name='calc', arguments={'expr': '2*3'})], errors=[])
    >>> HermesParser()("<tool_call>{oops}</tool_call>").errors
    ['malformed tool call: {oops} is not valid JSON']
    """

    def __init__(self, *, start: str = "<tool_call>", end: str = "</tool_call>"):
        if not start or not end:
            raise ValueError(f"start, end: got {start!r}, {end!r}, expected non-empty tags")
        self.start, self.end = start, end
        self._block = re.compile(re.escape(start) + r"(.*?)" + re.escape(end), re.DOTALL)

    def __call__(self, text: str) -> ParsedCalls:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for match in self._block.finditer(text):
            body = match.group(1).strip()
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError):  # invalid, or nested past the interpreter's recursion limit
                errors.append(f"malformed tool call: {body[:200]} is not valid JSON")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                errors.append(f"malformed tool call: {body[:200]} has no string 'name'")
                continue
            arguments = obj.get("arguments", {})
            if isinstance(arguments, str):  # some models emit the arguments as a JSON string
                with contextlib.suppress(ValueError, RecursionError):
                    arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                errors.append(f"malformed tool call: arguments of {obj['name']!r} are not a JSON object")
                continue
            calls.append(ToolCall(obj["name"], arguments))
        tail = text[text.rfind(self.end) + len(self.end) :] if self.end in text else text
        if self.start in tail:
            errors.append(f"malformed tool call: {self.start} without {self.end}")
        return ParsedCalls(calls, errors)
