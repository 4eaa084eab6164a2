"""Prompt datasets from local files through ``datasets``: JSONL, Parquet, CSV or a ``save_to_disk`` directory.

:func:`load_prompts` reads the file, takes the prompt and answer columns, applies the
tokenizer's chat template, tokenizes, and drops or truncates prompts longer than
``max_prompt_length`` tokens. Every other column travels with the prompts as a keyword
column for the rewards (the answer column under the name ``answers``). ``datasets``
is imported on first use; nothing is ever downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["OVERLONG", "PromptSet", "load_prompts", "read_table"]

OVERLONG = ("drop", "truncate_left", "truncate_right", "error")
_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _saved_without_rows(path: str, split: str) -> bool:
    # datasets cannot load a saved dataset of zero shards (it fails with an IndexError).
    state = os.path.join(path, split, "state.json")
    if not os.path.isfile(state):
        state = os.path.join(path, "state.json")
    try:
        with open(state) as f:
            return json.load(f).get("_data_files") == []
    except (OSError, ValueError):
        return False


def read_table(path: str | os.PathLike, *, split: str = "train", what: str = "data.path") -> Any:
    """A local dataset file or ``save_to_disk`` directory as a ``datasets.Dataset``.

    Args:
      path: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, or a directory written
        by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``: ``split`` is taken).
      split: the split of a saved ``DatasetDict``.
      what: the name of the setting that gave ``path``, for error messages.

    Returns:
      The ``datasets.Dataset``.

    Raises:
      ValueError: one line naming ``what`` and the path, when it is missing, of an
        unknown kind, unreadable, or empty.
    """
    import datasets

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{what}: got {path!r}, which does not exist (rlcore reads local datasets only)")
    try:
        if os.path.isdir(path):
            if _saved_without_rows(path, split):
                raise ValueError(f"{what}: {path!r} is empty, expected at least one prompt")
            table = datasets.load_from_disk(path)
            if isinstance(table, datasets.DatasetDict):
                if split not in table:
                    raise ValueError(f"{what}: {path!r} holds splits {sorted(table)}, expected one named {split!r}")
                table = table[split]
        else:
            kind = _SUFFIXES.get(os.path.splitext(path)[1].lower())
            if kind is None:
                raise ValueError(f"{what}: got {path!r}, expected a file ending in {sorted(_SUFFIXES)} or a directory")
            if os.path.getsize(path) == 0:
                raise ValueError(f"{what}: {path!r} is empty, expected at least one prompt")
            reader = {"json": datasets.Dataset.from_json, "parquet": datasets.Dataset.from_parquet}.get(
                kind, datasets.Dataset.from_csv
            )
            table = reader(path, keep_in_memory=True)
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"{what}: reading {path!r} failed with {_one_line(err)}") from err
    if len(table) == 0:
        raise ValueError(f"{what}: {path!r} is empty, expected at least one prompt")
    return table


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Prompts ready for rollout, with their reward columns.

    Attributes:
      prompts: the user's prompts as written in the file (messages lists stay lists),
        what rewards receive as ``prompts``.
      texts: the text given to the policy: the chat template applied (and truncated) when
        there is a tokenizer, else the prompt itself.
      prompt_ids: token ids of each text, or ``None`` without a tokenizer.
      columns: column name -> one value per prompt; the answer column is ``"answers"``.
      source: the file or directory the prompts came from.
      num_dropped: prompts dropped as longer than ``max_prompt_length``.
      num_truncated: prompts truncated to ``max_prompt_length``.
    """

    prompts: tuple[Any, ...]
    texts: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...] | None
    columns: Mapping[str, tuple[Any, ...]]
    source: str
    num_dropped: int = 0
    num_truncated: int = 0

    def __len__(self) -> int:
        return len(self.texts)

    def reward_columns(self, indices: Sequence[int]) -> dict[str, list[Any]]:
        """The keyword columns for a reward call over the prompts at ``indices`` (``answers=...`` and the rest)."""
        return {name: [values[i] for i in indices] for name, values in self.columns.items()}

    def select(self, indices: Sequence[int], *, drop_columns: Sequence[str] = ()) -> PromptSet:
        """The prompts at ``indices`` (in that order), without the columns ``drop_columns``; the counts are kept.

        >>> PromptSet(("a", "b"), ("a", "b"), None, {"x": (1, 2), "y": (3, 4)}, "f").select([1], drop_columns=["y"])
        PromptSet(prompts=('b',), texts=('b',), prompt_ids=None, columns={'x': (2,)}, source='f', num_dropped=0, num_truncated=0)
        """
        return dataclasses.replace(
            self,
            prompts=tuple(self.prompts[i] for i in indices),
            texts=tuple(self.texts[i] for i in indices),
            prompt_ids=None if self.prompt_ids is None else tuple(self.prompt_ids[i] for i in indices),
            columns={k: tuple(v[i] for i in indices) for k, v in self.columns.items() if k not in drop_columns},
        )


def _check_column(table: Any, key: str, name: str, source: str) -> None:
    if key not in table.column_names:
        raise ValueError(f"{name}: column {key!r} is not in {source!r} (its columns: {table.column_names})")


def _as_text(prompt: Any, row: int, source: str, tokenizer: Any, template: bool, system_prompt: str | None) -> str:
    if template:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and all(isinstance(m, Mapping) for m in prompt):
            messages = list(prompt)
        else:
            raise ValueError(
                f"prompt_key: row {row} of {source!r} holds {type(prompt).__name__}, "
                "expected a string or a list of {role, content} messages"
            )
        if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise ValueError(
            f"prompt_key: row {row} of {source!r} holds {type(prompt).__name__}, expected a string "
            "(a list of messages needs a tokenizer with a chat template)"
        )
    return prompt if system_prompt is None else f"{system_prompt}\n{prompt}"


def load_prompts(
    path: str | os.PathLike,
    *,
    tokenizer: Any = None,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    apply_chat_template: bool | None = None,
    system_prompt: str | None = None,
    max_prompt_length: int | None = None,
    overlong: str = "drop",
    split: str = "train",
    what: str = "data.path",
) -> PromptSet:
    """Read a prompt dataset and prepare its prompts for the policy.

    Args:
      path: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file or a ``save_to_disk``
        directory (see :func:`read_table`).
      tokenizer: a Hugging Face tokenizer; ``None`` keeps the prompts as text.
      prompt_key: the prompt column: strings, or lists of ``{role, content}`` messages.
      answer_key: the reference-answer column, passed to rewards as ``answers``; ``None``
        when the dataset has none.
      apply_chat_template: apply the tokenizer's chat template (with the generation
        prompt); ``None`` applies it when the tokenizer has one.
      system_prompt: a system message put before each prompt.
      max_prompt_length: the longest prompt in tokens (needs a tokenizer); ``None``: no limit.
      overlong: what happens to a longer prompt: ``"drop"`` it, ``"truncate_left"`` (keep
        its last tokens, with the generation prompt), ``"truncate_right"`` (keep its first
        tokens) or raise an ``"error"``.
      split: the split of a saved ``DatasetDict``.
      what: the setting that gave ``path``, named in errors.

    Returns:
      A :class:`PromptSet` with ``num_dropped`` / ``num_truncated`` for the log.

    Raises:
      ValueError: one line naming the setting, the column and the file.

    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
    >>> with open(path, "w") as f:
    ...     _ = f.write(json.dumps({"prompt": "1+1?", "answer": "2", "level": 1}) + "\\n")
    >>> data = load_prompts(path)
    >>> data.texts, data.reward_columns([0])
    (('1+1?',), {'answers': ['2'], 'level': [1]})
    """
    if overlong not in OVERLONG:
        raise ValueError(f"overlong: got {overlong!r}, expected one of {list(OVERLONG)}")
    if max_prompt_length is not None and (
        isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int) or max_prompt_length < 1
    ):
        raise ValueError(f"max_prompt_length: got {max_prompt_length!r}, expected a positive int or None")
    if max_prompt_length is not None and tokenizer is None:
        raise ValueError("max_prompt_length: counts tokens, so it needs a tokenizer; got tokenizer=None")
    has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if apply_chat_template and not has_template:
        raise ValueError("apply_chat_template: got True, but the tokenizer has no chat template")
    template = has_template if apply_chat_template is None else bool(apply_chat_template)

    source = os.fspath(path)
    table = read_table(source, split=split, what=what)
    _check_column(table, prompt_key, "prompt_key", source)
    if answer_key is not None:
        _check_column(table, answer_key, "answer_key", source)
    others = [c for c in table.column_names if c not in (prompt_key, answer_key)]
    if answer_key is not None and "answers" in others:
        raise ValueError(
            f"answer_key: {source!r} has a column 'answers' besides the answer column {answer_key!r}; "
            "rewards receive the answer column as 'answers', so rename one of them"
        )
    data = table.to_dict()
    prompts = data[prompt_key]
    texts = [_as_text(p, i, source, tokenizer, template, system_prompt) for i, p in enumerate(prompts)]
    columns = {name: data[name] for name in others}
    if answer_key is not None:
        columns = {"answers": data[answer_key], **columns}

    keep = list(range(len(texts)))
    ids: list[list[int]] | None = None
    dropped = truncated = 0
    if tokenizer is not None:
        ids = [list(x) for x in tokenizer(texts, add_special_tokens=not template)["input_ids"]]
        if max_prompt_length is not None:
            long = [i for i, x in enumerate(ids) if len(x) > max_prompt_length]
            if long and overlong == "error":
                raise ValueError(
                    f"max_prompt_length: {len(long)} prompts of {source!r} are longer than {max_prompt_length} "
                    f"tokens (the first is row {long[0]}, {len(ids[long[0]])} tokens)"
                )
            if overlong == "drop":
                dropped = len(long)
                keep = [i for i in keep if len(ids[i]) <= max_prompt_length]
            else:
                truncated = len(long)
                for i in long:
                    ids[i] = ids[i][-max_prompt_length:] if overlong == "truncate_left" else ids[i][:max_prompt_length]
                    texts[i] = tokenizer.decode(ids[i], skip_special_tokens=False)
    if not keep:
        raise ValueError(
            f"max_prompt_length: all {len(texts)} prompts of {source!r} are longer than {max_prompt_length} tokens"
        )
    return PromptSet(
        prompts=tuple(prompts[i] for i in keep),
        texts=tuple(texts[i] for i in keep),
        prompt_ids=None if ids is None else tuple(tuple(ids[i]) for i in keep),
        columns={name: tuple(values[i] for i in keep) for name, values in columns.items()},
        source=source,
        num_dropped=dropped,
        num_truncated=truncated,
    )
