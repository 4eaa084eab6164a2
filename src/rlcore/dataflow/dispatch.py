"""Sample-flow dispatch: token-balanced partitions and a data-parallel sharding transform.

A data-parallel step is as slow as its most loaded rank. Splitting a batch of
sequences into contiguous, equal-count pieces leaves that load to chance; balancing by
token count (prompt + response) makes every rank do about the same work. This is the
sample-flow dispatch of MindSpeed-RL (arXiv:2507.19017); verl does the same with
Karmarkar-Karp over sequence lengths.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlcore._checks import check_choice, check_integer, check_ndim, check_same_shape
from rlcore._process_group import as_process_group
from rlcore.pytree import NAMESPACE, batch_size, tree_cat, tree_index

__all__ = ["PARTITION_METHODS", "balanced_partition", "deal_rows", "shard_samples"]

PARTITION_METHODS = ("kk", "lpt")

# One part of a partial partition: (load, item indices).
_Part = tuple[int, list[int]]


def _karmarkar_karp(weights: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """k-way largest differencing: merge the two most spread partial partitions, heaviest part with lightest."""
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    # A state is k parts, each (load, items); the heap pops the largest spread first.
    if equal_size:
        seeds = [order[j : j + k] for j in range(0, len(order), k)]
    else:
        seeds = [[i] for i in order]
    heap: list[tuple[int, int, list[_Part]]] = []
    for n, seed in enumerate(seeds):
        parts: list[_Part] = sorted(((weights[i], [i]) for i in seed), key=lambda p: -p[0])
        parts += [(0, []) for _ in range(k - len(parts))]
        heap.append((-(parts[0][0] - parts[-1][0]), n, parts))
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda p: -p[0])
        b = sorted(b, key=lambda p: p[0])
        merged = sorted(((pa[0] + pb[0], pa[1] + pb[1]) for pa, pb in zip(a, b)), key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [items for _, items in heap[0][2]]


def _lpt(weights: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """Longest processing time first: each item, heaviest first, to the least loaded part with room."""
    cap = len(weights) // k if equal_size else len(weights)
    loads = [0] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        part = min((p for p in range(k) if len(parts[p]) < cap), key=lambda p: (loads[p], p))
        loads[part] += weights[i]
        parts[part].append(i)
    return parts


def balanced_partition(
    lengths: torch.Tensor,
    k: int,
    *,
    group_ids: torch.Tensor | None = None,
    method: str = "kk",
    equal_size: bool = False,
) -> list[torch.Tensor]:
    """Split samples into ``k`` parts whose token totals are as even as possible.

    Multiway number partitioning, minimising the heaviest part
    ``max_p sum_{i in part p} lengths_i``: ``"kk"`` is the Karmarkar-Karp largest
    differencing method (Karmarkar & Karp, 1982; k-way form of Michiels et al., 2003),
    ``"lpt"`` is Graham's longest-processing-time greedy (1969); both are within
    ``4/3 - 1/(3k)`` of the optimum. Host-side: the lengths are read to the CPU.

    Args:
      lengths: ``[B]`` integer tokens per sample (prompt + response).
      k: number of parts (data-parallel ranks).
      group_ids: optional ``[B]`` integer group of each sample; a group goes whole to
        one part (GRPO-style groups stay on one rank).
      method: ``"kk"`` or ``"lpt"``.
      equal_size: every part gets the same number of samples (groups, with
        ``group_ids``); that number must divide evenly.

    Returns:
      ``k`` int64 tensors of sample indexes, each in ascending order; together they hold
      every index in ``[0, B)`` exactly once.

    The textbook case: Karmarkar-Karp splits 8, 7, 6, 5, 4 into loads 16 / 14 (the
    optimum is 15 / 15), LPT into 17 / 13.

    >>> [p.tolist() for p in balanced_partition(torch.tensor([8, 7, 6, 5, 4]), 2)]
    [[1, 3, 4], [0, 2]]
    """
    check_ndim("lengths", lengths, 1)
    check_integer("lengths", lengths)
    check_choice("method", method, PARTITION_METHODS)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k: got {k!r}, expected a positive int")
    lengths = lengths.detach().to("cpu", torch.int64)  # sync-ok: dispatch is host-side
    if bool((lengths < 0).any()):
        raise ValueError("lengths: got negative values, expected token counts >= 0")
    if group_ids is None:
        units = torch.arange(lengths.numel())
        weights = lengths
    else:
        check_same_shape("group_ids", group_ids, "lengths", lengths)
        check_integer("group_ids", group_ids)
        _, units = torch.unique(group_ids.detach().cpu(), return_inverse=True)
        weights = torch.zeros(int(units.max()) + 1 if units.numel() else 0, dtype=torch.int64).index_add_(
            0, units, lengths
        )
    n = weights.numel()
    if equal_size and n % k:
        what = "groups" if group_ids is not None else "samples"
        raise ValueError(f"k: got {k}, expected a divisor of the number of {what} {n} (equal_size=True)")
    solve = _karmarkar_karp if method == "kk" else _lpt
    parts = solve(weights.tolist(), k, equal_size) if n else [[] for _ in range(k)]
    unit_part = torch.empty(n, dtype=torch.int64)
    for p, items in enumerate(parts):
        unit_part[items] = p
    sample_part = unit_part[units]
    return [(sample_part == p).nonzero().squeeze(1) for p in range(k)]


def _mask_lengths(batch: Any) -> torch.Tensor:
    """Tokens per sample: the sum of every leaf whose key ends in ``mask`` (e.g. prompt_mask + mask)."""
    import optree

    paths, leaves, _ = optree.tree_flatten_with_path(batch, namespace=NAMESPACE)
    masks = [leaf for path, leaf in zip(paths, leaves) if path and str(path[-1]).endswith("mask")]
    if not masks:
        raise ValueError("batch: got no leaf whose key ends in 'mask', expected one, or pass lengths=")
    return sum(m.reshape(m.shape[0], -1).sum(1, dtype=torch.int64) for m in masks)


def shard_samples(
    fn: Callable[..., Any],
    group: Any = None,
    *,
    src: int = 0,
    balance: str = "tokens",
    lengths: Callable[[Any], torch.Tensor] | None = None,
    group_key: str | None = None,
    method: str = "kk",
    equal_size: bool = False,
) -> Callable[..., Any]:
    """Wrap ``fn`` to run data-parallel: scatter the batch by token load, gather results in order.

    The sample flow of MindSpeed-RL (arXiv:2507.19017) without a central trainer's
    gather-scatter of whole batches: the source rank partitions the batch with
    :func:`balanced_partition` (``balance="tokens"``) or into contiguous, equal-count
    pieces (``"contiguous"``), sends each rank its shard, every rank runs
    ``fn(shard, *args, **kwargs)``, and the source gathers the results and puts their
    rows back in the original sample order.

    Args:
      fn: ``fn(batch, *args, **kwargs) -> pytree`` whose every leaf has the shard's rows
        along dim 0 (per-sample outputs).
      group: the data-parallel process group, or a 1-D ``DeviceMesh`` such as
        ``mesh["dp"]`` (default: the world).
      src: group rank holding the batch and receiving the results.
      balance: ``"tokens"`` or ``"contiguous"``.
      lengths: ``lengths(batch) -> [B]`` tokens per sample; default, the sum of every
        leaf whose key ends in ``mask``.
      group_key: key of a ``[B]`` group-id leaf whose groups must stay on one rank.
      method: partition method, ``"kk"`` or ``"lpt"``.
      equal_size: every rank gets the same number of samples (groups with ``group_key``).

    Returns:
      ``sharded(batch, *args, **kwargs)``: on ``src``, ``fn``'s result for the whole
      batch in the original row order; ``None`` on the other ranks (which pass any
      ``batch``, e.g. ``None``). Shards and results travel as pickled objects
      (``scatter_object_list`` / ``gather_object``), so ragged pytrees work.

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> double = shard_samples(lambda b: {"y": b["x"] * 2})
    >>> double({"x": torch.tensor([1, 2]), "mask": torch.ones(2, 3)})["y"].tolist()
    [2, 4]
    >>> dist.destroy_process_group()
    """
    check_choice("balance", balance, ("tokens", "contiguous"))
    check_choice("method", method, PARTITION_METHODS)
    measure = lengths or _mask_lengths
    group = as_process_group("group", group, optional=True)

    def sharded(batch: Any, *args: Any, **kwargs: Any) -> Any:
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if not 0 <= src < world:
            raise ValueError(f"src: got {src}, expected a group rank in [0, {world})")
        shards: list[Any] | None = None
        if rank == src:
            size = batch_size(batch)
            if balance == "tokens":
                groups = None if group_key is None else batch[group_key]
                parts = balanced_partition(
                    measure(batch), world, group_ids=groups, method=method, equal_size=equal_size
                )
            else:
                parts = list(torch.arange(size).tensor_split(world))
            shards = [tree_index(batch, part) for part in parts]
        received: list[Any] = [None]
        dist.scatter_object_list(received, shards, group=group, group_src=src)
        out = fn(received[0], *args, **kwargs)
        results: list[Any] | None = [None] * world if rank == src else None
        dist.gather_object(out, results, group=group, group_dst=src)
        if rank != src:
            return None
        assert results is not None, "the source rank gathers the results"
        order = torch.cat(parts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return tree_index(tree_cat(results), inverse)

    return sharded


def _gather(t: torch.Tensor, group: Any, world: int) -> list[torch.Tensor]:
    """``all_gather`` of equally shaped tensors; bool travels as uint8 (not every backend sends bool)."""
    send = t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous()
    out = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(out, send, group=group)
    return [o.to(torch.bool) for o in out] if t.dtype == torch.bool else out


def deal_rows(
    rows: Mapping[str, torch.Tensor],
    group: Any,
    *,
    lengths: torch.Tensor,
    left_padded: Sequence[str] = (),
    method: str = "kk",
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Deal the rows every rank holds over ``group`` by :func:`balanced_partition` of their tokens.

    Where :func:`shard_samples` scatters one rank's batch, here each data-parallel rank
    holds its own rows (its prompts' samples) and every rank leaves with a share of the
    union whose token load is as even as the partition makes it. The token counts are
    all-gathered, every rank computes the same partition, and the rows travel as one
    all-gather per column: every rank receives every row and keeps its share, an
    exchange that runs alike over gloo, nccl and hccl. Rows keep their global order
    (rank, then row). Columns whose trailing sizes differ between ranks are padded with
    zeros to the largest: on the right, or on the left of dim 1 for the names in
    ``left_padded`` (left-padded prompts stay left-padded). Host-side: the sizes and
    token counts are read to the CPU.

    Args:
      rows: column -> ``[R, ...]`` tensor, the same names and dtypes on every rank; ``R``
        may differ between ranks.
      group: the data-parallel process group (``None``: one rank, nothing moves).
      lengths: ``[R]`` integer tokens of each row (prompt + response).
      left_padded: the columns padded on the left of their dim 1.
      method: the partition method, ``"kk"`` or ``"lpt"``.

    Returns:
      ``(dealt, loads)``: this rank's rows, and ``[world]`` int64 the tokens each rank holds after the deal.
    """
    check_ndim("lengths", lengths, 1)
    check_integer("lengths", lengths)
    check_choice("method", method, PARTITION_METHODS)
    group = as_process_group("group", group, optional=True)
    names = sorted(rows)
    for name in names:
        t = rows[name]
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != lengths.shape[0]:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"rows[{name!r}]: got {got}, expected a tensor of {lengths.shape[0]} rows (lengths')")
    if group is None or dist.get_world_size(group) == 1:
        return dict(rows), lengths.sum(dtype=torch.int64).reshape(1).cpu()  # sync-ok: host-side dispatch
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = lengths.device
    meta = torch.tensor(
        [lengths.shape[0], *(d for name in names for d in rows[name].shape[1:])], dtype=torch.int64, device=device
    )
    metas = torch.stack(_gather(meta, group, world)).cpu()  # sync-ok: host-side dispatch
    counts = metas[:, 0].tolist()
    top = metas.max(0).values.tolist()
    most = top[0]
    padded = F.pad(lengths.to(torch.int64), (0, most - lengths.shape[0]))
    everyone = torch.cat([g[:c] for g, c in zip(_gather(padded, group, world), counts)]).cpu()  # sync-ok
    parts = balanced_partition(everyone, world, method=method)
    mine = parts[rank].to(device)
    dealt: dict[str, torch.Tensor] = {}
    at = 1
    for name in names:
        t = rows[name]
        widths = top[at : at + t.dim() - 1]
        at += t.dim() - 1
        pad: list[int] = []
        for d in range(t.dim() - 1, 0, -1):  # F.pad lists the last dim first
            extra = widths[d - 1] - t.shape[d]
            pad += [extra, 0] if d == 1 and name in left_padded else [0, extra]
        full = t.to(torch.uint8) if t.dtype == torch.bool else t
        full = F.pad(full, pad) if any(pad) else full
        full = torch.cat([full, full.new_zeros((most - t.shape[0], *full.shape[1:]))]).to(t.dtype)
        every = torch.cat([g[:c] for g, c in zip(_gather(full, group, world), counts)])
        dealt[name] = every[mine]
    loads = torch.stack([everyone[p].sum() for p in parts])
    return dealt, loads
