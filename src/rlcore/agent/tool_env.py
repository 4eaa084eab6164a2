"""An environment built from a list of tools: each turn's tool calls run concurrently, errors become observations."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlcore.agent.parsers import HermesParser, ToolCall, ToolCallParser
from rlcore.agent.protocols import StepResult
from rlcore.agent.tools import Tool, ToolError, call_tool

__all__ = ["ToolEnv"]


class ToolEnv:
    """A turn with tool calls gets their results as the observation; a turn without one ends the episode.

    ``step(action)`` (a coroutine function) parses the turn with ``parser``; every
    well-formed call runs concurrently with ``timeout`` seconds each. An unknown tool,
    malformed JSON, a raising tool or one past its timeout becomes an ``error: ...``
    response in the observation and counts in ``info["tool_errors"]``; nothing raises.
    A turn without a tool call is the final answer: ``reward(sample, action)`` scores
    it (0 without a reward function) and the episode is done.

    Args:
      tools: the tools the policy may call (distinct names).
      reward: ``(sample, final_text) -> float``; None scores every answer 0 (score later).
      parser: a :class:`rlcore.agent.ToolCallParser` (default :class:`HermesParser`).
      timeout: seconds per call for tools without their own timeout.
      response_format: how one result is written into the observation (``{}`` is the text).
      separator: between the responses of one turn.
      error_format: how a failure is written (``{}`` is the message; without it the
        text is fixed, for tokenizers that cannot spell messages).

    >>> env = ToolEnv([Tool("add", lambda a, b: a + b)], reward=lambda s, text: float(text == s["answer"]))
    >>> env.reset({"answer": "5"})
    ''
    >>> asyncio.run(env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'))[:3]
    ('<tool_response>\\n5\\n</tool_response>', 0.0, False)
    >>> asyncio.run(env.step("5"))[1:3]
    (1.0, True)
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        reward: Callable[[Mapping[str, Any], str], float] | None = None,
        parser: ToolCallParser | None = None,
        timeout: float = 10.0,
        response_format: str = "<tool_response>\n{}\n</tool_response>",
        separator: str = "\n",
        error_format: str = "error: {}",
    ):
        tools = list(tools)
        bad = [t for t in tools if not isinstance(t, Tool)]
        if bad:
            raise ValueError(f"tools: got {type(bad[0]).__name__}, expected rlcore.agent.Tool objects")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: got names {names}, expected distinct names")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout: got {timeout!r}, expected a number > 0")
        if parser is not None and not callable(parser):
            raise ValueError(f"parser: got {parser!r}, expected a ToolCallParser (text -> ParsedCalls)")
        if not isinstance(separator, str):
            raise ValueError(f"separator: got {separator!r}, expected a str")
        for key, fmt in (("response_format", response_format), ("error_format", error_format)):
            if not isinstance(fmt, str):
                raise ValueError(f"{key}: got {fmt!r}, expected a str")
            try:
                fmt.format("x")
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(
                    f"{key}: got {fmt!r}, which str.format cannot fill with one text ({type(err).__name__}: {err}); "
                    "expected one '{}' (write '{{' and '}}' for literal braces)"
                ) from None
        if "{}" not in response_format:
            raise ValueError(f"response_format: got {response_format!r}, expected a format with one '{{}}'")
        self.tools = {t.name: t for t in tools}
        self.reward, self.timeout = reward, timeout
        self.parser = parser if parser is not None else HermesParser()
        self.response_format, self.separator, self.error_format = response_format, separator, error_format
        self.sample: Mapping[str, Any] = {}

    def reset(self, sample: Mapping[str, Any]) -> str:
        """Start an episode for ``sample`` (kept for the reward); no initial observation."""
        self.sample = sample
        return ""

    async def _run(self, call: ToolCall) -> tuple[str, bool, float]:
        t0 = time.perf_counter()
        try:
            if call.name not in self.tools:
                raise ToolError(f"unknown tool {call.name!r}, expected one of {sorted(self.tools)}")
            text, failed = await call_tool(self.tools[call.name], call.arguments, timeout=self.timeout), False
        except ToolError as err:
            text, failed = self.error_format.format(err), True
        return text, failed, time.perf_counter() - t0

    async def step(self, action: str) -> StepResult:
        """One turn: run its tool calls, or score it as the final answer."""
        parsed = self.parser(action)
        if not parsed.found:
            score = float(self.reward(self.sample, action)) if self.reward is not None else 0.0
            return StepResult("", score, True, {"tool_calls": 0, "tool_errors": 0, "tool_latency": 0.0})
        results = await asyncio.gather(*(self._run(c) for c in parsed.calls))
        texts = [text for text, _, _ in results] + [self.error_format.format(e) for e in parsed.errors]
        observation = self.separator.join(self.response_format.format(t) for t in texts)
        info = {
            "tool_calls": len(texts),
            "tool_errors": sum(failed for _, failed, _ in results) + len(parsed.errors),
            "tool_latency": sum(latency for _, _, latency in results),
        }
        return StepResult(observation, 0.0, False, info)
