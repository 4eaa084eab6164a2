"""Preference datasets for offline DPO: a prompt column and ``chosen`` / ``rejected`` response columns, tokenized.

The layout of TRL's preference datasets: each row holds a prompt (a string, or a list of
``{role, content}`` messages, put through the chat template as :func:`rlcore.data.load_prompts`
does) and two responses, each a string or a list of messages whose last one is the
assistant's reply. Responses are tokenized without special tokens and end with EOS;
pairs whose prompt or response is longer than the limits are dropped or truncated,
with the counts kept for the log.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from rlcore.data.prompts import OVERLONG, PromptSet, load_prompts

__all__ = ["PreferenceSet", "load_preferences"]


@dataclasses.dataclass(frozen=True)
class PreferenceSet:
    """Preference pairs ready for DPO: the prompts (as :class:`rlcore.data.PromptSet`) and both responses, tokenized.

    Attributes:
      prompts: the pairs' prompts, templated and tokenized; their ``columns`` hold the
        dataset's other columns (the response columns left out).
      chosen, rejected: the responses as text.
      chosen_ids, rejected_ids: their token ids, EOS last (unless truncated away).
      num_dropped: pairs dropped as a response longer than ``max_response_length``
        (prompts dropped as too long are counted in ``prompts.num_dropped``).
      num_truncated: pairs with a response truncated to ``max_response_length``.
    """

    prompts: PromptSet
    chosen: tuple[str, ...]
    rejected: tuple[str, ...]
    chosen_ids: tuple[tuple[int, ...], ...]
    rejected_ids: tuple[tuple[int, ...], ...]
    num_dropped: int = 0
    num_truncated: int = 0

    def __len__(self) -> int:
        return len(self.chosen)


def _response_text(value: Any, key: str, row: int, source: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, Mapping) for m in value):
        content = value[-1].get("content")
        if isinstance(content, str):
            return content
    raise ValueError(
        f"{key}: row {row} of {source!r} holds {type(value).__name__}, expected a string or a list of "
        "{role, content} messages ending with the reply"
    )


def load_preferences(
    path: str | os.PathLike,
    *,
    tokenizer: Any,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    eos_token_id: int | None = None,
    apply_chat_template: bool | None = None,
    system_prompt: str | None = None,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    overlong: str = "drop",
    split: str = "train",
    what: str = "data.path",
) -> PreferenceSet:
    """Read a preference dataset and tokenize its pairs for DPO (Rafailov et al., 2023, arXiv:2305.18290).

    Args:
      path: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file or a ``save_to_disk``
        directory (see :func:`rlcore.data.read_table`).
      tokenizer: the model's Hugging Face tokenizer.
      prompt_key: the prompt column (strings, or lists of ``{role, content}`` messages).
      chosen_key, rejected_key: the preferred and the dispreferred response columns.
      eos_token_id: the id appended to each response; ``None``: the tokenizer's EOS.
      apply_chat_template, system_prompt, max_prompt_length: as in :func:`rlcore.data.load_prompts`.
      max_response_length: the longest response in tokens, EOS included; ``None``: no limit.
      overlong: what happens to a prompt longer than ``max_prompt_length`` (as in
        :func:`rlcore.data.load_prompts`) and to a pair with a longer response: ``"drop"``
        the pair, truncate the response (keeping its first tokens, for either
        ``"truncate_*"``) or raise an ``"error"``.
      split: the split of a saved ``DatasetDict``.
      what: the setting that gave ``path``, named in errors.

    Returns:
      A :class:`PreferenceSet`.

    Raises:
      ValueError: one line naming the setting, the column and the file.

    >>> import json, os, tempfile
    >>> from rlcore.testing.hf_fixtures import tiny_tokenizer
    >>> path = os.path.join(tempfile.mkdtemp(), "pairs.jsonl")
    >>> with open(path, "w") as f:
    ...     _ = f.write(json.dumps({"prompt": "1+1?", "chosen": "2", "rejected": "3"}) + "\\n")
    >>> tok = tiny_tokenizer(["1+1? 2 3"], chat_template=None)
    >>> pairs = load_preferences(path, tokenizer=tok)
    >>> pairs.chosen, pairs.chosen_ids[0][-1] == tok.eos_token_id
    (('2',), True)
    """
    if tokenizer is None:
        raise ValueError("tokenizer: got None, expected the model's tokenizer (preference pairs are tokenized)")
    if max_response_length is not None and (
        isinstance(max_response_length, bool) or not isinstance(max_response_length, int) or max_response_length < 1
    ):
        raise ValueError(f"max_response_length: got {max_response_length!r}, expected a positive int or None")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong: got {overlong!r}, expected one of {list(OVERLONG)}")
    if chosen_key == rejected_key:
        raise ValueError(
            f"rejected_key: got {rejected_key!r}, the same column as chosen_key; expected the dispreferred responses"
        )
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if not isinstance(eos, int):
        raise ValueError(f"eos_token_id: got {eos!r}, and the tokenizer has no EOS token; expected an int")
    prompts = load_prompts(
        path,
        tokenizer=tokenizer,
        prompt_key=prompt_key,
        answer_key=None,
        apply_chat_template=apply_chat_template,
        system_prompt=system_prompt,
        max_prompt_length=max_prompt_length,
        overlong=overlong,
        split=split,
        what=what,
        response_keys=(chosen_key, rejected_key),
    )
    source = prompts.source
    for name, key in (("chosen_key", chosen_key), ("rejected_key", rejected_key)):
        if key not in prompts.columns or key == prompt_key:
            raise ValueError(
                f"{name}: column {key!r} is not in {source!r} (its columns: {[prompt_key, *prompts.columns]})"
            )
    sides = []
    for key in (chosen_key, rejected_key):
        texts = [_response_text(v, key, i, source) for i, v in enumerate(prompts.columns[key])]
        ids = [[*tokenizer(t, add_special_tokens=False)["input_ids"], eos] for t in texts]
        sides.append((texts, ids))
    keep, truncated = [], 0
    limit = max_response_length
    for i in range(len(prompts)):
        long = limit is not None and any(len(ids[i]) > limit for _, ids in sides)
        if long and overlong == "error":
            raise ValueError(
                f"max_response_length: pair {i} of {source!r} has a response longer than {limit} tokens (EOS included)"
            )
        if long and overlong == "drop":
            continue
        if long:
            truncated += 1
            for _, ids in sides:
                ids[i] = ids[i][:limit]
        keep.append(i)
    if not keep:
        raise ValueError(
            f"max_response_length: every pair of {source!r} has a response longer than {limit} tokens (EOS included)"
        )
    (chosen, chosen_ids), (rejected, rejected_ids) = sides
    return PreferenceSet(
        prompts=prompts.select(keep, drop_columns=(chosen_key, rejected_key)),
        chosen=tuple(chosen[i] for i in keep),
        rejected=tuple(rejected[i] for i in keep),
        chosen_ids=tuple(tuple(chosen_ids[i]) for i in keep),
        rejected_ids=tuple(tuple(rejected_ids[i]) for i in keep),
        num_dropped=len(prompts) - len(keep),
        num_truncated=truncated,
    )
