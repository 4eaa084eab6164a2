"""The shipped agent task: multiply numbers too long to do in one's head, with a calculator tool.

A tiny model cannot multiply two 4-digit numbers token by token, but it can learn to
copy them into a Hermes tool call, read the calculator's answer back and repeat it::

    prompt   4821*3307=
    policy   <tool_call>{"name":"calculator","arguments":{"expression":"4821*3307"}}</tool_call>
    tool     <tool_response>15943047</tool_response>
    policy   15943047<eos>

The reward is 1 for the exact product in the last turn. A short supervised warm-up on
such traces (:meth:`Multiplication.warmup_batch`) teaches the format; GRPO does the rest.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlcore.agent.tokenizer import SpecialCharTokenizer
from rlcore.agent.tool_env import ToolEnv
from rlcore.agent.tools import Tool

__all__ = ["Multiplication", "calculator", "evaluate_arithmetic"]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate_arithmetic(expression: str) -> int:
    """Evaluate integer ``+``, ``-``, ``*`` (no names, no calls, at most 64 characters); raise ValueError otherwise.

    >>> evaluate_arithmetic("12*34+1")
    409
    """
    if not isinstance(expression, str) or len(expression) > 64:
        raise ValueError(f"expression: got {expression!r}, expected an arithmetic string of at most 64 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"expression: {expression!r} is not arithmetic") from err

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"expression: {expression!r} has {type(node).__name__}, expected integers and + - *")

    return ev(tree)


def _calculate(expression: str) -> str:
    return str(evaluate_arithmetic(expression))


calculator = Tool(
    name="calculator",
    fn=_calculate,  # module level: the task pickles (reward worker processes)
    description="Evaluate an integer arithmetic expression with + - *.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
    timeout=1.0,
)


class Multiplication:
    """``"a*b="`` with ``digits``-digit operands, a calculator tool and an exact-match reward.

    Operands are drawn from ``[ceil(sqrt(10**(2 * digits - 1))), 10**digits)``, so every
    product has exactly ``2 * digits`` digits and every trace the same layout: what the
    model must learn is to copy, never to multiply.

    Attributes: ``tokenizer`` (:class:`rlcore.agent.SpecialCharTokenizer`), ``tools``,
    ``stop_tokens`` (``</tool_call>`` ends a turn), ``response_format`` (how the
    environment writes a tool result).

    >>> task = Multiplication(digits=3)
    >>> s = task.sample(1, torch.Generator().manual_seed(0))[0]
    >>> a, b = s["prompt"].rstrip("=").split("*")
    >>> int(s["answer"]) == int(a) * int(b), len(s["answer"]), task.reward(s, s["answer"])
    (True, 6, 1.0)
    """

    alphabet = '0123456789*=+-{}:,"'
    specials = (
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        '"name"',
        '"arguments"',
        '"calculator"',
        '"expression"',
        "error",
    )
    response_format = "<tool_response>{}</tool_response>"
    stop_tokens = ("</tool_call>",)

    def __init__(self, *, digits: int = 4):
        if not isinstance(digits, int) or not 1 <= digits <= 9:
            raise ValueError(f"digits: got {digits!r}, expected an int in [1, 9]")
        self.digits = digits
        self.low = math.isqrt(10 ** (2 * digits - 1) - 1) + 1
        self.tokenizer = SpecialCharTokenizer(self.alphabet, specials=self.specials)
        self.tools = [calculator]

    def sample(self, n: int, generator: torch.Generator) -> list[dict[str, Any]]:
        """``n`` samples ``{"prompt": "a*b=", "answer": str(a*b)}``."""
        values = torch.randint(self.low, 10**self.digits, (n, 2), generator=generator)
        return [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in values.tolist()]

    def reward(self, sample: Mapping[str, Any], text: str) -> float:
        """1.0 when the final turn is exactly the product."""
        return float(text.strip() == sample["answer"])

    def make_env(self, *, timeout: float = 1.0) -> ToolEnv:
        """A fresh :class:`rlcore.agent.ToolEnv` with the calculator and this task's reward."""
        return ToolEnv(
            self.tools,
            reward=self.reward,
            timeout=timeout,
            response_format=self.response_format,
            separator="",
            error_format="error",
        )

    def trace(self, sample: Mapping[str, Any]) -> list[tuple[str, bool]]:
        """The reference tool-using trace after the prompt: ``(text, written by the policy)`` segments."""
        expression = sample["prompt"].rstrip("=")
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
        return [
            (f"<tool_call>{call}</tool_call>", True),
            (self.response_format.format(evaluate_arithmetic(expression)), False),
            (sample["answer"], True),
        ]

    def warmup_batch(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Right-padded supervised traces: ``input_ids``, ``attention_mask`` and ``mask`` (1 on the policy's tokens and its ``<eos>``)."""
        tok = self.tokenizer
        rows = []
        for s in samples:
            ids, mask = tok.encode(s["prompt"]), [0] * len(tok.encode(s["prompt"]))
            for text, policy in self.trace(s):
                piece = tok.encode(text)
                ids, mask = ids + piece, mask + [int(policy)] * len(piece)
            rows.append((ids + [tok.eos_token_id], mask + [1]))
        width = max(len(ids) for ids, _ in rows)
        out = {k: torch.zeros((len(rows), width), dtype=torch.long) for k in ("input_ids", "attention_mask", "mask")}
        for i, (ids, mask) in enumerate(rows):
            out["input_ids"][i, : len(ids)] = torch.tensor(ids)
            out["attention_mask"][i, : len(ids)] = 1
            out["mask"][i, : len(ids)] = torch.tensor(mask)
        return out
