"""Supervised datasets for SFT: prompt / response rows, or ``messages`` conversations, tokenized with prompt masking.

The layouts of TRL's SFT datasets: a prompt column (a string, or ``{role, content}``
messages) and a response column, or one ``messages`` column per conversation whose last
message is the assistant's reply. The prompt goes through the chat template with the
generation prompt (:func:`rlcore.data.load_prompts`); the response is tokenized without
special tokens and ends with EOS, so the loss mask covers the reply and its EOS only.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rlcore.data.prompts import OVERLONG, PromptSet, load_prompts

__all__ = ["SupervisedSet", "load_supervised"]


@dataclasses.dataclass(frozen=True)
class SupervisedSet:
    """Demonstrations ready for SFT: the prompts (as :class:`rlcore.data.PromptSet`) and their responses, tokenized.

    Attributes:
      prompts: the prompts, templated and tokenized.
      responses: the responses as text.
      response_ids: their token ids, EOS last (unless truncated away).
      num_dropped: rows dropped as a response longer than ``max_response_length``.
      num_truncated: rows whose response was truncated to ``max_response_length``.
    """

    prompts: PromptSet
    responses: tuple[str, ...]
    response_ids: tuple[tuple[int, ...], ...]
    num_dropped: int = 0
    num_truncated: int = 0

    def __len__(self) -> int:
        return len(self.responses)


def load_supervised(
    path: str | os.PathLike,
    *,
    tokenizer: Any,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str | None = None,
    eos_token_id: int | None = None,
    apply_chat_template: bool | None = None,
    system_prompt: str | None = None,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    overlong: str = "drop",
    split: str = "train",
    what: str = "data.path",
) -> SupervisedSet:
    """Read an SFT dataset and tokenize it: prompt ids (not trained on) and response ids + EOS (trained on).

    Args:
      path: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file or a ``save_to_disk`` directory.
      tokenizer: the model's Hugging Face tokenizer.
      prompt_key, response_key: the prompt and response columns (``messages_key`` unset).
      messages_key: a column of whole conversations instead; the last message is the reply.
      eos_token_id: the id appended to each response; ``None``: the tokenizer's EOS.
      apply_chat_template, system_prompt, max_prompt_length, overlong, split, what: as in
        :func:`rlcore.data.load_preferences`.
      max_response_length: the longest response in tokens, EOS included; ``None``: no limit.

    Returns:
      A :class:`SupervisedSet`.

    >>> import json, os, tempfile
    >>> from rlcore.testing.hf_fixtures import tiny_tokenizer
    >>> path = os.path.join(tempfile.mkdtemp(), "sft.jsonl")
    >>> with open(path, "w") as f:
    ...     _ = f.write(json.dumps({"prompt": "1+1?", "response": "2"}) + "\\n")
    >>> tok = tiny_tokenizer(["1+1? 2"], chat_template=None)
    >>> data = load_supervised(path, tokenizer=tok)
    >>> data.responses, data.response_ids[0][-1] == tok.eos_token_id
    (('2',), True)
    """
    if tokenizer is None:
        raise ValueError("tokenizer: got None, expected the model's tokenizer (SFT rows are tokenized)")
    if max_response_length is not None and (
        isinstance(max_response_length, bool) or not isinstance(max_response_length, int) or max_response_length < 1
    ):
        raise ValueError(f"max_response_length: got {max_response_length!r}, expected a positive int or None")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong: got {overlong!r}, expected one of {list(OVERLONG)}")
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if not isinstance(eos, int):
        raise ValueError(f"eos_token_id: got {eos!r}, and the tokenizer has no EOS token; expected an int")
    conversations = messages_key is not None
    column = prompt_key if messages_key is None else messages_key
    prompts = load_prompts(
        path,
        tokenizer=tokenizer,
        prompt_key=column,
        answer_key=None,
        apply_chat_template=apply_chat_template,
        system_prompt=system_prompt,
        max_prompt_length=max_prompt_length,
        overlong=overlong,
        split=split,
        what=what,
        response_keys=() if conversations else (response_key,),
        split_last_turn=conversations,
    )
    key = column if conversations else response_key
    if key not in prompts.columns or (not conversations and key == prompt_key):
        raise ValueError(
            f"response_key: column {key!r} is not in {prompts.source!r} (its columns: {[prompt_key, *prompts.columns]})"
        )
    texts = list(prompts.columns[key])
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ValueError(
                f"{'messages_key' if conversations else 'response_key'}: row {i} of {prompts.source!r} "
                f"holds {type(t).__name__}, expected a string"
            )
    ids = [[*tokenizer(t, add_special_tokens=False)["input_ids"], eos] for t in texts]
    keep, truncated = [], 0
    for i, row in enumerate(ids):
        long = max_response_length is not None and len(row) > max_response_length
        if long and overlong == "error":
            raise ValueError(
                f"max_response_length: row {i} of {prompts.source!r} has a response longer than "
                f"{max_response_length} tokens (EOS included)"
            )
        if long and overlong == "drop":
            continue
        if long:
            truncated += 1
            ids[i] = row[:max_response_length]
        keep.append(i)
    if not keep:
        raise ValueError(
            f"max_response_length: every row of {prompts.source!r} has a response longer than {max_response_length} "
            "tokens (EOS included)"
        )
    return SupervisedSet(
        prompts=prompts.select(keep, drop_columns=(key,)),
        responses=tuple(texts[i] for i in keep),
        response_ids=tuple(tuple(ids[i]) for i in keep),
        num_dropped=len(prompts) - len(keep),
        num_truncated=truncated,
    )
