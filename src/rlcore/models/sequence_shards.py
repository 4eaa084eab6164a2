"""The load-balanced split of one packed row of tokens over the ranks of a context-parallel group.

The row of ``N`` tokens (``B`` packed sequences, ``cu_seqlens``) is padded to
``P = 2 * cp * L`` tokens, ``L = ceil(N / (2 * cp))``, with one extra padding
sequence, and cut into ``2 * cp`` chunks of ``L`` tokens. Rank ``r`` holds chunk
``r`` and chunk ``2 * cp - 1 - r``: one from the start and one from the end of the
row, so under a causal mask every rank does the same attention work (the zig-zag
split of Megatron-LM's context parallelism and of Brandon et al., "Striped
Attention", arXiv:2311.09431). The plan is host data, made once per packed batch
and shared by the Ulysses and ring attention and by the sharded scoring.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import numbers

import torch

from rlcore._checks import check_ndim

__all__ = ["SequenceShards", "plan_sequence_shards"]

# One attention task on a (query chunk, key chunk) pair: local query rows
# [q_lo, q_hi), rows [k_lo, k_hi) of the key block, causal (diagonal) or full.
Task = tuple[int, int, int, int, bool]


@dataclasses.dataclass(frozen=True)
class SequenceShards:
    """Which tokens of a packed row each context-parallel rank holds (host data, no tensors).

    Attributes:
      bounds: the padded sequence boundaries, from 0 to ``padded_len`` (the padding, if
        any, is one extra sequence at the end).
      num_tokens: ``N``, the real tokens of the row.
      world: the context-parallel size ``cp``.
      rank: this rank's index in the context-parallel group.
      chunk: ``L``, tokens per chunk; a rank holds ``2 * L``.
    """

    bounds: tuple[int, ...]
    num_tokens: int
    world: int
    rank: int
    chunk: int

    @property
    def padded_len(self) -> int:
        """``P = 2 * world * chunk``, the row length after padding."""
        return 2 * self.world * self.chunk

    @property
    def local_len(self) -> int:
        """``2 * chunk``, the tokens each rank holds."""
        return 2 * self.chunk

    @property
    def max_seqlen(self) -> int:
        """The longest sequence of the padded row."""
        return max(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk indices ``rank`` holds, in local order."""
        return rank, 2 * self.world - 1 - rank

    def positions_of(self, rank: int) -> list[int]:
        """The padded-row positions of ``rank``'s ``2 * chunk`` local tokens, in local order."""
        c = self.chunk
        return [p for a in self.chunks_of(rank) for p in range(a * c, (a + 1) * c)]

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """``[2 * chunk]`` int64 padded-row positions of this rank's tokens."""
        return torch.tensor(self.positions_of(self.rank), dtype=torch.int64)

    @functools.cached_property
    def gathered_positions(self) -> torch.Tensor:
        """``[P]`` positions of the rows of an all-gather over the group (rank-major)."""
        return torch.tensor([p for r in range(self.world) for p in self.positions_of(r)], dtype=torch.int64)

    @functools.cached_property
    def natural_order(self) -> torch.Tensor:
        """``[P]`` indices that put rank-major gathered rows back in row order."""
        return torch.argsort(self.gathered_positions)

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """``[B' + 1]`` int32 padded boundaries (a CPU tensor)."""
        return torch.tensor(self.bounds, dtype=torch.int32)

    def check_local(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, world: int, rank: int
    ) -> None:
        """Check one rank's attention inputs against the plan (``ValueError`` naming the argument)."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            check_ndim(name, t, 3)
            if t.shape[0] != self.local_len:
                raise ValueError(
                    f"{name}: got {t.shape[0]} tokens, expected {self.local_len} (this rank's shard of the packed "
                    f"row: two chunks of {self.chunk} tokens)"
                )
        q, k, v = query, key, value
        if k.shape != v.shape or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
            raise ValueError(
                f"key: got key {tuple(k.shape)} and value {tuple(v.shape)}, expected ({q.shape[0]}, Hkv, "
                f"{q.shape[2]}) both, with Hkv dividing {q.shape[1]} (the query heads)"
            )
        if (world, rank) != (self.world, self.rank):
            raise ValueError(
                f"group: got rank {rank} of {world}, expected rank {self.rank} of {self.world} (the plan's shards)"
            )

    def _doc(self, position: int) -> tuple[int, int]:
        """``(start, end)`` of the (non-empty) sequence holding ``position``."""
        i = bisect.bisect_right(self.bounds, position) - 1
        return self.bounds[i], self.bounds[i + 1]

    def tasks(self, src: int) -> tuple[Task, ...]:
        """The attention tasks of this rank's queries against the key/value block of rank ``src``.

        A query sees a key of the same sequence at or before it. For a pair of chunks
        ``a`` (queries) and ``b`` (keys): ``b > a`` has nothing to see; ``b == a`` is
        causal attention within each sequence piece of the chunk; ``b < a`` is full
        attention of the one sequence that spans from chunk ``b`` into chunk ``a`` (the
        sequence holding the chunk's first token), if any.
        """
        return self._task_table[src]

    @functools.cached_property
    def _task_table(self) -> tuple[tuple[Task, ...], ...]:
        return tuple(self._tasks_against(src) for src in range(self.world))

    def _tasks_against(self, src: int) -> tuple[Task, ...]:
        c = self.chunk
        out: list[Task] = []
        for qi, a in enumerate(self.chunks_of(self.rank)):
            for ki, b in enumerate(self.chunks_of(src)):
                qbase, kbase = qi * c - a * c, ki * c - b * c
                if b == a:
                    i = bisect.bisect_right(self.bounds, a * c) - 1
                    while i + 1 < len(self.bounds) and self.bounds[i] < (a + 1) * c:
                        lo, hi = max(self.bounds[i], a * c), min(self.bounds[i + 1], (a + 1) * c)
                        if hi > lo:
                            out.append((qbase + lo, qbase + hi, kbase + lo, kbase + hi, True))
                        i += 1
                elif b < a:
                    start, end = self._doc(a * c)
                    if start < (b + 1) * c:
                        q_hi = min(end, (a + 1) * c)
                        out.append((qbase + a * c, qbase + q_hi, kbase + max(start, b * c), kbase + (b + 1) * c, False))
        return tuple(out)


def plan_sequence_shards(cu_seqlens: torch.Tensor | list[int], *, world: int, rank: int) -> SequenceShards:
    """Plan the load-balanced split of a packed row over ``world`` context-parallel ranks.

    Args:
      cu_seqlens: ``[B + 1]`` boundaries of the packed sequences, from 0 to ``N``
        (a tensor is read on the host: this is planning, once per batch).
      world: the context-parallel size ``cp`` (>= 1).
      rank: this rank's index in ``[0, world)``.

    Returns:
      A :class:`SequenceShards`.

    >>> s = plan_sequence_shards([0, 5, 7], world=2, rank=0)
    >>> s.chunk, s.bounds, s.positions_of(0), s.positions_of(1)
    (2, (0, 5, 7, 8), [0, 1, 6, 7], [2, 3, 4, 5])
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world: got {world!r}, expected a positive int (the context-parallel size)")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank: got {rank!r}, expected an int in [0, {world})")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise ValueError(
                f"cu_seqlens: got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}, expected [B + 1] ints"
            )
        bounds = [int(b) for b in cu_seqlens.tolist()]  # sync-ok: planning on host ints
    else:
        odd = next((b for b in cu_seqlens if isinstance(b, bool) or not isinstance(b, numbers.Integral)), None)
        if odd is not None:
            raise ValueError(f"cu_seqlens: got {odd!r} among the boundaries, expected ints")
        bounds = [int(b) for b in cu_seqlens]
    if len(bounds) < 2 or bounds[0] != 0 or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: got {bounds[:8]}, expected non-decreasing boundaries from 0, at least two")
    n = bounds[-1]
    if n == 0:
        raise ValueError(
            f"cu_seqlens: got a packed row of 0 tokens, expected at least 1: each of the {world} context-parallel "
            "ranks would hold a shard of zero length"
        )
    chunk = -(-n // (2 * world))
    padded = 2 * world * chunk
    if padded > n:
        bounds.append(padded)
    return SequenceShards(bounds=tuple(bounds), num_tokens=n, world=world, rank=rank, chunk=chunk)
