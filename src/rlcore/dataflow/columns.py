"""Column schemas: the name, dtype, per-row shape and meaning of every dock column a graph's stages exchange.

A :class:`Schema` is a table of :class:`Column` s. A :class:`rlcore.dataflow.StageGraph`
built with ``schema=`` refuses, when it is built, a stage or loader column the table does
not declare, and the pipeline refuses, before the dock stores anything, a column put
with another dtype or per-row rank than the table's (:meth:`Schema.check_put`: one
dtype comparison per column per put, no pass over the data). The trainer's table is
:data:`rlcore.train.COLUMNS`.

Per-row shapes (:data:`SHAPES`):

* ``"scalar"``: one value per row, put as ``[N]``;
* ``"token"``: one value per token position of the row's prompt or response, put as a
  padded ``[N, T]`` tensor or as a list of 1-D rows;
* ``"ragged"``: a 1-D sequence of the row's own length (an answer's ids, a pair's
  sequence), put as a list of rows.

When the dock pads rows of different lengths on a read, it adds a bool
``<column>_mask`` companion (:meth:`rlcore.dataflow.TransferDock.get`); those
companions are not columns (nothing puts them) and no schema declares them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["DTYPE_KINDS", "SHAPES", "Column", "Schema"]

SHAPES = ("scalar", "token", "ragged")
# A dtype kind a column may declare instead of one dtype: "float" is any floating-point dtype.
DTYPE_KINDS = ("float",)
_ROW_DIMS = {"scalar": 0, "token": 1, "ragged": 1}


class Column(NamedTuple):
    """One dock column: its name, dtype (a ``torch.dtype``, or a kind of :data:`DTYPE_KINDS`), per-row shape, meaning.

    >>> Column("mask", torch.float32, "token", "1.0 on the policy's tokens").shape
    'token'
    """

    name: str
    dtype: torch.dtype | str
    shape: str
    meaning: str


def _describe(dtype: torch.dtype | str) -> str:
    return "any floating-point dtype" if dtype == "float" else str(dtype)


class Schema:
    """The columns a graph's stages may read and write, by name; :meth:`check_put` checks what a stage writes.

    Args:
      columns: the :class:`Column` s (distinct names).
      declared_in: where the table is written, quoted by every error (e.g.
        ``"rlcore.train.columns.COLUMNS"``), so a new column is added there.

    >>> s = Schema([Column("scores", torch.float32, "scalar", "outcome reward")], declared_in="here")
    >>> s.check_put("stage 'reward'", {"scores": torch.ones(2)})
    >>> s.check_put("stage 'reward'", {"scores": torch.ones(2, dtype=torch.int64)})
    Traceback (most recent call last):
    ...
    ValueError: stage 'reward': column 'scores' got dtype torch.int64, expected torch.float32 (declared in here)
    """

    def __init__(self, columns: Iterable[Column], *, declared_in: str) -> None:
        if not isinstance(declared_in, str) or not declared_in:
            raise ValueError(f"declared_in: got {declared_in!r}, expected a non-empty str naming where the table is")
        self.declared_in = declared_in
        self._columns: dict[str, Column] = {}
        for c in columns:
            if not isinstance(c, Column):
                raise ValueError(f"columns: got a {type(c).__name__}, expected Column")
            if not isinstance(c.name, str) or not c.name:
                raise ValueError(f"columns: got name {c.name!r}, expected a non-empty str")
            if c.name in self._columns:
                raise ValueError(f"columns: got {c.name!r} twice, expected each column declared once")
            if not isinstance(c.dtype, torch.dtype) and c.dtype not in DTYPE_KINDS:
                raise ValueError(
                    f"columns[{c.name!r}]: got dtype {c.dtype!r}, expected a torch.dtype or one of {DTYPE_KINDS}"
                )
            if c.shape not in SHAPES:
                raise ValueError(f"columns[{c.name!r}]: got shape {c.shape!r}, expected one of {SHAPES}")
            if not isinstance(c.meaning, str) or not c.meaning:
                raise ValueError(
                    f"columns[{c.name!r}]: got meaning {c.meaning!r}, expected a line saying what it holds"
                )
            self._columns[c.name] = c
        # What a put is checked against: (exact dtype or None for a kind, rows' rank), looked up once per column.
        self._expect = {
            c.name: (c.dtype if isinstance(c.dtype, torch.dtype) else None, _ROW_DIMS[c.shape])
            for c in self._columns.values()
        }

    def __contains__(self, name: object) -> bool:
        return name in self._columns

    def __getitem__(self, name: str) -> Column:
        return self._columns[name]

    def __iter__(self) -> Iterator[Column]:
        return iter(self._columns.values())

    def __len__(self) -> int:
        return len(self._columns)

    @property
    def names(self) -> tuple[str, ...]:
        """The declared column names, in declaration order."""
        return tuple(self._columns)

    def select(self, *names: str) -> tuple[str, ...]:
        """``names`` as a tuple, each checked to be declared (for the name lists stages and loaders use)."""
        self.check_names("select", names)
        return names

    def check_names(self, who: str, names: Iterable[str], *, what: str = "column") -> None:
        """Raise ``ValueError`` naming ``who`` and the first of ``names`` the schema does not declare."""
        for name in names:
            if name not in self._columns:
                raise ValueError(
                    f"{who}: {what} {name!r} is not a declared column, expected one of the columns declared in "
                    f"{self.declared_in} (add a Column there for a new one)"
                )

    def check_put(self, who: str, columns: Mapping[str, Any]) -> None:
        """Refuse a put whose columns are undeclared or have another dtype or per-row rank than declared.

        ``columns`` maps a name to a tensor ``[N, ...]`` or a list of ``N`` row tensors
        (what :meth:`rlcore.dataflow.TransferDock.put` takes); only the first row of a
        list is looked at (the dock checks that the others match it). ``who`` names the
        writer in the message, e.g. ``"stage 'rollout'"``.
        """
        for name, value in columns.items():
            expect = self._expect.get(name)
            if expect is None:
                self.check_names(who, [name])
                continue
            if isinstance(value, torch.Tensor):
                dtype, dims = value.dtype, value.dim() - 1
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                dtype, dims = value[0].dtype, value[0].dim()
            else:
                continue  # no rows, or not tensors: the dock's own checks say what is wrong
            want, want_dims = expect
            if dtype != want and (want is not None or not dtype.is_floating_point):
                raise ValueError(
                    f"{who}: column {name!r} got dtype {dtype}, expected "
                    f"{_describe(self._columns[name].dtype)} (declared in {self.declared_in})"
                )
            if dims != want_dims:
                shape = self._columns[name].shape
                raise ValueError(
                    f"{who}: column {name!r} got rows of {dims} dims, expected {want_dims} (a {shape} column, "
                    f"declared in {self.declared_in})"
                )

    def placeholder(self, name: str, rows: int) -> torch.Tensor:
        """Zeros of column ``name``'s dtype, ``[rows]`` or ``[rows, 1]`` (what a simulated stage puts)."""
        c = self._columns[name]
        dtype = c.dtype if isinstance(c.dtype, torch.dtype) else torch.float32
        return torch.zeros((rows,) + (1,) * _ROW_DIMS[c.shape], dtype=dtype)

    def table(self) -> str:
        """The schema as a Markdown table: column, dtype, per-row shape, meaning."""
        lines = ["| column | dtype | per row | meaning |", "|---|---|---|---|"]
        for c in self._columns.values():
            dtype = str(c.dtype).removeprefix("torch.")
            lines.append(f"| `{c.name}` | {dtype} | {c.shape} | {c.meaning} |")
        return "\n".join(lines)
