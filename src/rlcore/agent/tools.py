"""Tools: a name, a JSON-schema description and a callable (sync or async), called with a timeout.

The description follows the OpenAI / Hermes function-calling schema (``{"type":
"function", "function": {"name", "description", "parameters": <JSON schema>}}``), which
chat templates such as Qwen2.5's render into the system prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from rlcore.agent.threads import in_daemon_thread, labelled

__all__ = ["Tool", "ToolError", "call_tool", "tool"]


class ToolError(Exception):
    """A tool call failed: unknown tool, bad arguments, the tool raised, or it ran past its timeout."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable the policy may invoke by name.

    Fields:
      name: the name the policy writes in its call.
      fn: ``fn(**arguments) -> result`` (any value; ``str()`` of it is the observation),
        a plain function or a coroutine function.
      description: what the tool does, for the schema.
      parameters: JSON schema of the arguments object.
      timeout: seconds one call may take (None: the environment's default).

    >>> t = Tool("add", lambda a, b: a + b, "Add two numbers.", {"type": "object"})
    >>> t.schema()["function"]["name"]
    'add'
    """

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: got {self.name!r}, expected a non-empty str")
        if not callable(self.fn):
            raise ValueError(f"fn: got {type(self.fn).__name__}, expected a callable")
        if inspect.isasyncgenfunction(self.fn) or inspect.isgeneratorfunction(self.fn):
            raise ValueError(
                f"fn: got the generator function {getattr(self.fn, '__name__', self.fn)!r} (its observation would be "
                "the generator's repr), expected a function or a coroutine function returning the result"
            )
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout: got {self.timeout!r}, expected a number > 0 or None")

    def schema(self) -> dict[str, Any]:
        """The OpenAI / Hermes function schema of this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Any:
    """Make a :class:`Tool` of a function (usable as a decorator); the docstring's first line is the description.

    Without ``parameters`` the schema lists the function's arguments (JSON type from
    the annotation: str, int, float, bool; anything else is unconstrained).

    >>> @tool
    ... def calculator(expression: str) -> str:
    ...     '''Evaluate an arithmetic expression.'''
    ...     return expression
    >>> calculator.name, calculator.parameters["required"]
    ('calculator', ['expression'])
    """
    if fn is None:
        return functools.partial(tool, name=name, description=description, parameters=parameters, timeout=timeout)
    if parameters is None:
        kinds = {str: "string", int: "integer", float: "number", bool: "boolean", "str": "string", "int": "integer"}
        kinds.update({"float": "number", "bool": "boolean"})
        props: dict[str, Any] = {}
        required = []
        for p in inspect.signature(fn).parameters.values():
            kind = kinds.get(p.annotation)
            props[p.name] = {"type": kind} if kind else {}
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
        parameters = {"type": "object", "properties": props, "required": required}
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    return Tool(
        name=name or fn.__name__,
        fn=fn,
        description=description if description is not None else (doc[0] if doc else ""),
        parameters=parameters,
        timeout=timeout,
    )


async def _outcome(awaitable: Any, label: str) -> tuple[bool, Any]:
    """``(True, result)`` or ``(False, error)``: a ``SystemExit`` of the tool's code is its failure, not the loop's end."""
    try:
        return True, await labelled(awaitable, label)
    except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: closed unfinished
        raise
    except BaseException as err:
        return False, err


async def call_tool(t: Tool, arguments: Mapping[str, Any], *, timeout: float | None = None) -> str:
    """Run one tool call, sync tools in a daemon thread, bounded by ``timeout`` seconds; the result as text.

    Raises :class:`ToolError` (never anything else) when the arguments are not a JSON
    object, the tool raises (``SystemExit`` and ``KeyboardInterrupt`` of its code
    included), or it runs past the timeout. A sync tool that overruns keeps its daemon
    thread until it returns (it does not hold the interpreter's exit); the call itself is
    abandoned at once. A coroutine tool that blocks the event loop is marked with
    :func:`rlcore.agent.labelled` as ``tool '<name>'``, so the rollout can name it.

    >>> asyncio.run(call_tool(Tool("add", lambda a, b: a + b), {"a": 2, "b": 3}))
    '5'
    """
    if not isinstance(arguments, Mapping):
        raise ToolError(f"tool {t.name!r}: arguments must be a JSON object, got {type(arguments).__name__}")
    limit = t.timeout if t.timeout is not None else timeout
    label = f"tool {t.name!r}"
    try:
        if inspect.iscoroutinefunction(t.fn):
            ok, result = await asyncio.wait_for(_outcome(t.fn(**arguments), label), limit)
        else:
            ok, result = await asyncio.wait_for(_outcome(in_daemon_thread(t.fn, **arguments), label), limit)
            if ok and inspect.isawaitable(result):
                ok, result = await asyncio.wait_for(_outcome(result, label), limit)
    except (TimeoutError, asyncio.TimeoutError):
        raise ToolError(f"tool {t.name!r} timed out after {limit} s") from None
    except asyncio.CancelledError:
        raise
    except Exception as err:  # calling it failed (e.g. arguments its signature refuses)
        raise ToolError(f"tool {t.name!r} raised {type(err).__name__}: {err}") from err
    if not ok:
        raise ToolError(f"tool {t.name!r} raised {type(result).__name__}: {result}") from result
    try:
        # An exact str: a subclass's own __format__ would run, and could raise, in the environment's formatting.
        return str.__str__(result) if isinstance(result, str) else str.__str__(str(result))
    except Exception as err:  # a result whose __str__ raises
        raise ToolError(f"tool {t.name!r} returned a {type(result).__name__} whose str() raised {err!r}") from err
