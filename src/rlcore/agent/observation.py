"""Observation tokens: only the environment's text is tokenized, inside the chat template's role markers when there is one."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["observation_encoder"]


def observation_encoder(tokenizer: Any, *, role: str = "user") -> Callable[[str], list[int]]:
    """A function ``text -> token ids`` for observations, with chat-template role markers when the tokenizer has a template.

    With a chat template (a ``transformers`` tokenizer whose ``chat_template`` is set),
    the ids are what the template adds for one ``role`` message followed by the
    generation prompt of the next assistant turn, found as the difference between
    rendering ``[user]`` and ``[user, observation]`` (the policy's own tokens are
    never re-rendered; verl's tool agent loop does the same). ``role="user"`` suits the
    Hermes / Qwen convention, where tool responses go back in a user turn wrapped in
    ``<tool_response>`` tags (:class:`rlcore.agent.ToolEnv` writes the tags). Without a
    template, the text is encoded on its own, without special tokens.

    Args:
      tokenizer: a ``transformers`` tokenizer, or any object with ``encode(text) -> ids``.
      role: the chat role of observations.

    Returns:
      ``encode(text) -> list[int]``.

    >>> from rlcore.agent import SpecialCharTokenizer
    >>> observation_encoder(SpecialCharTokenizer("ab="))("=ab")
    [4, 2, 3]
    """
    template = getattr(tokenizer, "chat_template", None)
    if template and callable(getattr(tokenizer, "apply_chat_template", None)):
        base = [{"role": "user", "content": "x"}]

        def render(messages: list[dict[str, str]], generation: bool) -> list[int]:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)

        prefix = render(base, False)

        def encode_with_template(text: str) -> list[int]:
            full = render([*base, {"role": role, "content": text}], True)
            if full[: len(prefix)] != prefix:
                raise ValueError(
                    f"tokenizer: its chat template renders a {role!r} message by changing earlier tokens, "
                    "expected an append-only template (pass encode_observation= explicitly)"
                )
            return full[len(prefix) :]

        return encode_with_template
    try:
        takes_special = "add_special_tokens" in inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):
        takes_special = False
    if takes_special:
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    return lambda text: list(tokenizer.encode(text))
