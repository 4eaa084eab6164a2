"""Griffe extension for the API reference: docstring doctests render as ``pycon`` code blocks.

rlcore's docstrings end with bare doctests (``>>>`` lines and their output), which
pytest runs. Markdown would read them as block quotes and their outputs
(``[(1, 0), (0, 1)]``) as reference links; fencing each run of doctest lines keeps them
verbatim, highlighted, and out of the cross-reference resolver.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """Wrap every doctest (a ``>>>`` line through the next blank line) in a ``pycon`` fence.

    >>> fence_doctests("Sum.\\n\\n>>> 1 + 1\\n2").splitlines()
    ['Sum.', '', '```pycon', '>>> 1 + 1', '2', '```']
    """
    out: list[str] = []
    fenced = inside_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside_fence = not inside_fence
        if not fenced and not inside_fence and line.startswith(">>>"):
            out.append("```pycon")
            fenced = True
        elif fenced and not line.strip():
            out.append("```")
            fenced = False
        out.append(line)
    if fenced:
        out.append("```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fence the doctests of every docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
