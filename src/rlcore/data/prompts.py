"""Prompt datasets from local files through ``datasets``: JSONL, Parquet, CSV or a ``save_to_disk`` directory.

:func:`load_prompts` reads the file, takes the prompt and answer columns, applies the
tokenizer's chat template, tokenizes, and drops or truncates prompts longer than
``max_prompt_length`` tokens. Every other column travels with the prompts as a keyword
column for the rewards (the answer column under the name ``answers``). ``datasets``
is imported on first use; nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["OVERLONG", "RESERVED_COLUMNS", "PromptSet", "load_prompts", "read_table"]

OVERLONG = ("drop", "truncate_left", "truncate_right", "error")
#: Column names a prompt dataset may not have: the trainer passes the other columns to the
#: rewards as keywords beside these arguments (``reward(prompts, responses, batch=..., **columns)``).
RESERVED_COLUMNS = ("prompts", "responses", "batch", "reward", "self")
_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_CHUNK = 1 << 20
# The deepest nesting of lists and objects a JSON dataset may hold: pyarrow's JSON reader recurses
# per level and crashes the process (a segmentation fault) on tens of thousands, Python's json
# module raises RecursionError at a thousand; datasets nest a few levels (messages: 3).
_MAX_JSON_DEPTH = 100
_JSON_STRING = re.compile(rb'"(?:[^"\\\n]|\\.)*"')
_CSV_INDEX = re.compile(r"__index_level_\d+__")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}\n")


def _one_line(err: BaseException) -> str:
    # datasets wraps the reader's error in a DatasetGenerationError that says nothing: name the cause.
    while type(err).__name__ == "DatasetGenerationError" and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    text = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {text[0] if text else ''}"


class _DropErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def _reader_errors_unlogged(kind: str) -> Iterator[None]:
    """datasets' readers log their failure before raising it; the raised error is reported (named) instead,
    so the user sees one line. Their warnings still reach the log."""
    logger = logging.getLogger(f"datasets.packaged_modules.{kind}.{kind}")
    drop = _DropErrors()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _parquet_rows(path: str) -> int | None:
    """The rows a Parquet file's footer declares, or None when it cannot be read (the reader then says why)."""
    import pyarrow.parquet as pq

    try:
        return int(pq.read_metadata(path).num_rows)
    except Exception:  # a damaged file: the reader's error names it
        return None


def _check_utf8(path: str, what: str) -> None:
    """A text file that is not UTF-8 is refused naming its line (pyarrow would read the bytes and fail later)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                line += chunk.count(b"\n", 0, max(err.start, 0))
                raise ValueError(f"{what}: line {line} of {path!r} is not UTF-8 text ({err.reason})") from None
            if not chunk:
                return
            line += chunk.count(b"\n")


def _json_depth_problem(path: str) -> str | None:
    """Where a JSON / JSON Lines file nests lists and objects deeper than :data:`_MAX_JSON_DEPTH`, else None.

    Strings are left out (their brackets are text); each line of JSON Lines counts alone.
    """
    import numpy as np

    with open(path, "rb") as f:
        data = f.read()
    brackets = np.frombuffer(b"\n" + _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKET), dtype=np.uint8)
    step = np.zeros(len(brackets), dtype=np.int64)
    step[(brackets == ord("[")) | (brackets == ord("{"))] = 1
    step[(brackets == ord("]")) | (brackets == ord("}"))] = -1
    depth = np.cumsum(step)
    newline = brackets == ord("\n")
    line_start = np.maximum.accumulate(np.where(newline, np.arange(len(brackets)), 0))
    depth -= depth[line_start]
    if not len(depth) or depth.max() <= _MAX_JSON_DEPTH:
        return None
    line = int(np.count_nonzero(newline[: int(np.argmax(depth > _MAX_JSON_DEPTH)) + 1]))
    return f"line {line} nests lists and objects more than {_MAX_JSON_DEPTH} deep, expected a flatter record"


def _json_problem(path: str) -> str | None:
    """Where a JSON / JSON Lines file is malformed, in words with its line; None when the json module reads it."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        return "it holds only blank lines, expected one JSON object per line"
    if text.lstrip().startswith("["):  # one JSON document: a list of records
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            return f"line {err.lineno} column {err.colno}: {err.msg}"
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            return f"item {bad} of its list holds {type(rows[bad]).__name__}, expected an object of columns"
        return None if rows else "it holds an empty list, expected at least one record"
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return f"line {number} is not valid JSON ({err.msg} at column {err.colno})"
        if not isinstance(row, dict):
            return f"line {number} holds {type(row).__name__}, expected a JSON object of columns"
    return None


def _saved_without_rows(path: str, split: str) -> bool:
    # datasets cannot load a saved dataset of zero shards (it fails with an IndexError).
    state = os.path.join(path, split, "state.json")
    if not os.path.isfile(state):
        state = os.path.join(path, "state.json")
    try:
        with open(state) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    # A state.json of another shape: load_from_disk names the problem.
    return isinstance(saved, dict) and saved.get("_data_files") == []


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
    if os.path.isdir(path):
        if _saved_without_rows(path, split):
            raise ValueError(f"{what}: {path!r} is empty, expected at least one prompt")
        try:
            table = datasets.load_from_disk(path)
        except Exception as err:  # datasets' and pyarrow's own errors (ValueErrors among them), named
            raise ValueError(f"{what}: reading the saved dataset {path!r} failed with {_one_line(err)}") from err
        if isinstance(table, datasets.DatasetDict):
            if split not in table:
                raise ValueError(f"{what}: {path!r} holds splits {sorted(table)}, expected one named {split!r}")
            table = table[split]
    else:
        kind = _SUFFIXES.get(os.path.splitext(path)[1].lower())
        if kind is None:
            raise ValueError(f"{what}: got {path!r}, expected a file ending in {sorted(_SUFFIXES)} or a directory")
        if not os.path.isfile(path):
            raise ValueError(f"{what}: got {path!r}, which is not a regular file")
        if os.path.getsize(path) == 0:
            raise ValueError(f"{what}: {path!r} is empty, expected at least one prompt")
        if kind != "parquet":
            _check_utf8(path, what)
        if kind == "json" and (problem := _json_depth_problem(path)) is not None:
            raise ValueError(f"{what}: {path!r} is not a readable json file: {problem}")
        elif _parquet_rows(path) == 0:  # pyarrow's reader fails on it with "BatchSize must be greater than 0"
            raise ValueError(f"{what}: {path!r} holds no rows, expected at least one prompt")
        reader = {"json": datasets.Dataset.from_json, "parquet": datasets.Dataset.from_parquet}.get(
            kind, datasets.Dataset.from_csv
        )
        try:
            with _reader_errors_unlogged(kind):
                table = reader(path, keep_in_memory=True)
        except Exception as err:  # datasets' and pyarrow's own errors (ValueErrors among them), named
            problem = _json_problem(path) if kind == "json" else None
            if problem is None and "corresponds to no data" in str(err):  # a CSV of its header alone, say
                problem = "it holds no rows, expected at least one prompt"
            raise ValueError(f"{what}: {path!r} is not a readable {kind} file: {problem or _one_line(err)}") from err
        # pandas makes a row's fields beyond the header the index, shifting every column: refuse it.
        if kind == "csv" and any(_CSV_INDEX.fullmatch(c) for c in table.column_names):
            raise ValueError(
                f"{what}: {path!r} is not a readable csv file: its rows hold more fields than its header "
                f"names ({len([c for c in table.column_names if not _CSV_INDEX.fullmatch(c)])}), expected one "
                "field per column (quote fields holding commas)"
            )
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
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # Jinja's errors (syntax, undefined, raise_exception) and the template's own
            raise ValueError(
                f"apply_chat_template: the tokenizer's chat template failed on row {row} of {source!r}: {_one_line(err)}"
            ) from err
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
    response_keys: Sequence[str] = (),
    split_last_turn: bool = False,
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
      response_keys: columns holding responses (a preference dataset's), which never reach
        the rewards and so may have a name of :data:`RESERVED_COLUMNS`.
      split_last_turn: the prompt column holds whole conversations (SFT's ``messages``):
        the prompt is every message but the last, and the last one's content (the reply)
        is kept as the column ``prompt_key``.

    Returns:
      A :class:`PromptSet` with ``num_dropped`` / ``num_truncated`` for the log.

    Raises:
      ValueError: one line naming the setting, the column and the file; a column named as
        one of :data:`RESERVED_COLUMNS` is refused, and so is a chat template that fails.

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
    reserved = [c for c in others if c in RESERVED_COLUMNS and c not in response_keys]
    if reserved:
        raise ValueError(
            f"{what}: {source!r} has a column named {reserved[0]!r}, a name the rewards receive as an argument "
            f"of their own ({', '.join(RESERVED_COLUMNS)}); rename that column"
        )
    data = table.to_dict()
    prompts = data[prompt_key]
    replies: list[Any] = []
    if split_last_turn:
        for i, conversation in enumerate(prompts):
            if not (
                isinstance(conversation, list)
                and len(conversation) >= 2
                and all(isinstance(m, Mapping) for m in conversation)
                and isinstance(conversation[-1].get("content"), str)
            ):
                raise ValueError(
                    f"prompt_key: row {i} of {source!r} holds {type(conversation).__name__}, expected a list of at "
                    "least two {role, content} messages, the last one the reply"
                )
        replies = [c[-1]["content"] for c in prompts]
        prompts = [c[:-1] for c in prompts]
    texts = [_as_text(p, i, source, tokenizer, template, system_prompt) for i, p in enumerate(prompts)]
    columns = {name: data[name] for name in others}
    if answer_key is not None:
        columns = {"answers": data[answer_key], **columns}
    if split_last_turn:
        columns[prompt_key] = replies

    keep = list(range(len(texts)))
    ids: list[list[int]] | None = None
    dropped = truncated = 0
    if tokenizer is not None:
        ids = [list(x) for x in tokenizer(texts, add_special_tokens=not template)["input_ids"]]
        empty = next((i for i, x in enumerate(ids) if not x), None)
        if empty is not None:  # the policy would generate from padding alone (the rollout fails on it)
            raise ValueError(
                f"prompt_key: row {empty} of {source!r} holds {prompts[empty]!r}, which is no token at all; "
                "expected a prompt of at least one token"
            )
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
