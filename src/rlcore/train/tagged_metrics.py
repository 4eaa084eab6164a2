"""Metric values that carry their reduction: how a step's updates and the data-parallel ranks combine them.

A step's record is made from values each update produces on each rank. Each value says
where it is made how it combines: a ``"sum"`` adds (token counts, a rank's share of a
loss normalised by global counts), a ``"max"`` keeps the largest (the worst policy
lag), a ``"mean"`` averages over every (update, rank) that produced it (a recipe metric
that is already the whole batch's). :func:`merge` combines two values of one metric;
the same rule folds the updates of a step and, as one all-reduce per kind
(:func:`all_reduce_metrics`), the data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rlcore._checks import check_choice

__all__ = [
    "REDUCTIONS",
    "Metric",
    "all_reduce_metrics",
    "as_tensors",
    "maximum",
    "mean",
    "merge",
    "merge_into",
    "total",
]

REDUCTIONS = ("mean", "sum", "max")
"""How a metric combines over a step's updates and the data-parallel ranks."""


class Metric(NamedTuple):
    """A 0-d float32 metric and its reduction: one of :data:`REDUCTIONS`.

    ``num_values`` is the number of values a ``"mean"`` is the mean of (1 for a fresh one).
    """

    value: torch.Tensor
    reduce: str
    num_values: float = 1.0


def _make(value: Any, reduce: str) -> Metric:
    check_choice("reduce", reduce, REDUCTIONS)
    v = torch.as_tensor(value).detach()
    if v.numel() != 1:
        raise ValueError(f"value: got shape {tuple(v.shape)}, expected a scalar metric")
    return Metric(v.float().reshape(()), reduce)


def mean(value: Any) -> Metric:
    """A value averaged over the step's updates and the ranks."""
    return _make(value, "mean")


def total(value: Any) -> Metric:
    """A value added over the step's updates and the ranks."""
    return _make(value, "sum")


def maximum(value: Any) -> Metric:
    """A value whose largest over the step's updates and the ranks is kept."""
    return _make(value, "max")


def merge(a: Metric, b: Metric, *, name: str = "metric") -> Metric:
    """The metric of both values' (updates, ranks): added, the larger, or their count-weighted mean.

    >>> merge(mean(1.0), mean(4.0)).value
    tensor(2.5000)
    """
    check_choice(f"{name}.reduce", a.reduce, REDUCTIONS)
    if a.reduce != b.reduce:
        raise ValueError(f"{name}: got reductions {a.reduce!r} and {b.reduce!r}, expected one reduction per metric")
    if a.reduce == "sum":
        return Metric(a.value + b.value, "sum")
    if a.reduce == "max":
        return Metric(torch.maximum(a.value, b.value), "max")
    num = a.num_values + b.num_values
    return Metric((a.value * a.num_values + b.value * b.num_values) / num, "mean", num)


def merge_into(acc: dict[str, Metric], new: Mapping[str, Metric]) -> None:
    """Fold ``new`` into ``acc`` in place, metric by metric (:func:`merge`)."""
    for name, m in new.items():
        acc[name] = merge(acc[name], m, name=f"metrics[{name!r}]") if name in acc else m


def as_tensors(metrics: Mapping[str, Metric]) -> dict[str, torch.Tensor]:
    """The plain 0-d tensors, once every value is combined."""
    return {name: m.value for name, m in metrics.items()}


def all_reduce_metrics(metrics: Mapping[str, Metric], group: Any) -> dict[str, Metric]:
    """Every rank's metrics merged over ``group``: one ``SUM`` all-reduce (sums, weighted means), one ``MAX``.

    Every rank must hold the same names with the same reductions (the trainer's
    ranks run the same stages). ``group`` ``None``: nothing to combine.
    """
    if group is None:
        return dict(metrics)
    names = sorted(metrics)
    added = [n for n in names if metrics[n].reduce != "max"]
    tops = [n for n in names if metrics[n].reduce == "max"]
    out: dict[str, Metric] = {}
    if added:
        # A mean travels as its weighted sum and its count; a sum as itself.
        rows = [
            torch.stack([metrics[n].value * metrics[n].num_values, metrics[n].value.new_tensor(metrics[n].num_values)])
            if metrics[n].reduce == "mean"
            else torch.stack([metrics[n].value, metrics[n].value.new_tensor(0.0)])
            for n in added
        ]
        summed = torch.stack(rows)
        dist.all_reduce(summed, group=group)
        for n, (v, c) in zip(added, summed):
            # sync-ok: the count of a step's record, read once per step
            out[n] = Metric(v / c, "mean", float(c)) if metrics[n].reduce == "mean" else Metric(v, "sum")
    if tops:
        top = torch.stack([metrics[n].value for n in tops])
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        out.update({n: Metric(v, "max") for n, v in zip(tops, top)})
    return {n: out[n] for n in names}
