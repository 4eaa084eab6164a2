"""Metrics of the whole batch from each rank's metrics of its share: token-weighted means, sums, true extremes.

A loss's metrics are statistics of the tokens (or pairs) a rank holds: masked means
(``approx_kl``, ``ratio_mean``, the clip fractions), extremes (``ratio_max``,
``ratio_min``) and terms already normalised by global counts (``pg_loss``, ``kl``,
``entropy``, ``vf_loss``, ``distill``: each rank holds its share). Averaging them over ranks is
wrong twice over: a mean of means weights a rank with few tokens like one with many,
and a mean of maxima is no maximum. :func:`reduce_metrics` combines them exactly: each
mean as the global weighted sum over the global weight, each extreme with an
all-reduce ``MAX`` / ``MIN``, each share with a sum, so the result equals the metric of
the whole batch computed in one process.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlcore._checks import check_choice, check_count, check_tensor
from rlcore.algos.collectives import resolve_process_group

__all__ = ["METRIC_REDUCTIONS", "RL_METRIC_REDUCTIONS", "reduce_metrics"]

METRIC_REDUCTIONS = ("mean", "sum", "max", "min")
"""How a metric combines over ranks: a weighted ``"mean"``, a ``"sum"`` of shares, or a true ``"max"`` / ``"min"``."""

RL_METRIC_REDUCTIONS: Mapping[str, str] = {
    "pg_loss": "sum",
    "kl": "sum",
    "entropy": "sum",
    "vf_loss": "sum",
    "distill": "sum",
    "ratio_max": "max",
    "ratio_min": "min",
}
"""The non-mean metrics of :meth:`rlcore.algos.Algorithm.loss`: its aggregated terms and the ratio extremes."""


def _check_weight(weight: Any) -> None:
    if isinstance(weight, torch.Tensor):
        check_count("weight", weight)
    elif (
        isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight) and weight >= 0)
    ):
        raise ValueError(
            f"weight: got {weight!r}, expected a finite number >= 0 (the tokens or pairs the means are over)"
        )


def _check_ranks_agree(groups: list[Any], kinds: Mapping[str, str], local: ValueError | None) -> None:
    """Every rank of gloo ``groups`` raises the same ``ValueError`` when one rejected its input or the names differ.

    The all-reduces of :func:`reduce_metrics` are sized by the metrics: ranks holding
    other names or reductions would abort inside gloo or mix unrelated metrics, and a
    rank raising alone would leave its peers waiting until the process-group timeout.
    So first one ``MAX`` all-reduce per group of three int64 (a rejection flag and a
    digest of the names and reductions, and its negation): a CPU tensor, read on the
    host without stalling a device. Over other backends (NCCL: reading would stall the
    device) nothing is exchanged and a local error is raised at once.
    """
    if not groups or not all("gloo" in str(dist.get_backend(g)) for g in groups):
        if local is not None:
            raise local
        return
    text = repr(sorted(kinds.items())).encode()
    digest = int.from_bytes(hashlib.sha256(text).digest()[:7], "little")
    header = torch.tensor([int(local is not None), digest, -digest], dtype=torch.int64)
    for group in groups:
        dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group)
    if local is not None:
        raise local
    bad, top, low = header.tolist()  # sync-ok: a CPU tensor, the result of a gloo collective
    if bad:
        raise ValueError(
            "metrics: another rank rejected its metrics or weight (see its error), expected every rank to call "
            "reduce_metrics with valid inputs; nothing was reduced"
        )
    if top != digest or -low != digest:
        raise ValueError(
            f"metrics: got names and reductions {sorted(kinds.items())} on this rank, but another rank holds others; "
            "expected every rank to reduce the same metrics with the same reductions; nothing was reduced"
        )


def reduce_metrics(
    metrics: Mapping[str, torch.Tensor],
    weight: torch.Tensor | float,
    *,
    process_groups: Sequence[Any],
    reductions: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Combine each rank's 0-d metrics of its share into the metrics of the whole batch, over one or more groups.

    A metric named in ``reductions`` is combined as it says; every other one is a mean
    weighted by ``weight`` (the tokens, or pairs, the rank's means are over): the global
    ``sum(weight * value) / sum(weight)``, 0 when no rank holds any weight. A rank with
    zero weight takes no part in a ``"max"`` / ``"min"`` either (its empty-mask 0 is no
    extreme); the extreme of a batch with no weight anywhere is 0. Over several groups
    (context parallel, then data parallel) the sums and extremes are taken over each in
    turn, which is the reduction over their product. Two all-reduces per group (three
    over gloo, where the ranks first check that they reduce the same names and that
    none rejected its input: every rank then raises the same ``ValueError``).

    Args:
      metrics: name -> 0-d (or one-element) tensor, this rank's metric of its share.
      weight: the weight of this rank's means (a number or a 0-d tensor, ``>= 0``).
      process_groups: the groups to reduce over (process groups, 1-D ``DeviceMesh`` es or
        ``None``, which are skipped).
      reductions: name -> one of :data:`METRIC_REDUCTIONS`; unnamed metrics are means.

    Returns:
      name -> float32 0-d tensor, the same on every rank of the groups.

    >>> reduce_metrics({"approx_kl": torch.tensor(0.5), "ratio_max": torch.tensor(1.2)}, 4,
    ...                process_groups=[None], reductions={"ratio_max": "max"})
    {'approx_kl': tensor(0.5000), 'ratio_max': tensor(1.2000)}
    """
    groups = [resolve_process_group(g)[0] for g in process_groups]
    groups = [g for g in groups if g is not None]
    values: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    local: ValueError | None = None
    try:
        _check_weight(weight)
        reductions = dict(reductions or {})
        for name, how in reductions.items():
            check_choice(f"reductions[{name!r}]", how, METRIC_REDUCTIONS)
        for name in sorted(metrics):
            v = check_tensor(f"metrics[{name!r}]", metrics[name])
            if v.numel() != 1:
                raise ValueError(f"metrics[{name!r}]: got shape {tuple(v.shape)}, expected a scalar metric")
            values[name] = v.detach().float().reshape(())
            kinds[name] = reductions.get(name, "mean")
    except ValueError as err:
        local = err
    _check_ranks_agree(groups, kinds, local)
    names = sorted(values)
    if not names:
        return {}
    device = values[names[0]].device
    w = torch.as_tensor(weight, dtype=torch.float32, device=device).reshape(())
    held = w > 0
    added = [n for n in names if kinds[n] in ("mean", "sum")]
    extreme = [n for n in names if kinds[n] in ("max", "min")]
    # Means travel as weighted sums (0 from a rank without weight, whatever its value), then the weight.
    summed = torch.stack(
        [torch.where(held, values[n] * w, 0.0) if kinds[n] == "mean" else values[n] for n in added] + [w]
    )
    # Both extremes as maxima (a min is minus the max of minus); a rank without weight offers -inf.
    signs = {n: 1.0 if kinds[n] == "max" else -1.0 for n in extreme}
    tops = torch.stack([torch.where(held, signs[n] * values[n], -torch.inf) for n in extreme]) if extreme else None
    for group in groups:
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        if tops is not None:
            dist.all_reduce(tops, op=dist.ReduceOp.MAX, group=group)
    total = summed[-1]
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate(added):
        out[name] = summed[i] / torch.where(total > 0, total, 1.0) if kinds[name] == "mean" else summed[i]
    for i, name in enumerate(extreme):
        top = tops[i] if tops is not None else None
        assert top is not None
        out[name] = torch.where(top > -torch.inf, signs[name] * top, 0.0)
    return {name: out[name] for name in names}
