"""The one seeding rule: every random stream is keyed by ``(seed, purpose, step, global row index)``.

Two forms of the same rule:

* host draws (the task's prompts, the data order, DPO's perturbations) take a
  ``torch.Generator`` from :func:`generator`, seeded by :func:`mix` of the key;
* the token sampler takes uniforms from a counter-based hash of
  ``(key, row, position, draw)`` (:func:`row_uniforms`), computed in int64 tensors
  on the rows' device: no generator state, no host sync, and a row's draws do not
  depend on which other rows share its batch, in what order, or on which rank.

:class:`RowStream` carries a key and the global indices of a call's rows. It *is* a
``torch.Generator`` (seeded from the key and the first row), so an inference engine
written against ``generate(..., generator=torch.Generator)`` keeps working; rlcore's
own samplers read its keys instead.

The 32-bit mixing function is the MurmurHash3 finaliser (Appleby, 2008), applied as a
chain over the 32-bit words of the counter; products are taken 16 bits at a time so
that no int64 product overflows on any backend.
"""

from __future__ import annotations

import enum
import hashlib
import numbers
from typing import Any

import torch

__all__ = [
    "Purpose",
    "RowStream",
    "generator",
    "hash32",
    "mix",
    "row_keys",
    "row_uniforms",
]

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_FMIX = (0x85EBCA6B, 0xC2B2AE35)


class Purpose(enum.IntEnum):
    """What a stream is for: each use of randomness in a run has its own, so no two uses share draws."""

    DATA = 0  # the task's prompts of a step
    WARMUP = 1  # the supervised warm-up's samples
    SAMPLING = 2  # the rollout's token draws (single- and multi-turn)
    PERTURB = 3  # DPO's perturbed answers
    VALIDATION = 4  # the validator's sampled responses
    EVAL_PROMPTS = 5  # the multi-turn greedy evaluation's fixed prompts
    EPOCH_ORDER = 6  # a prompt set's permutation of one epoch
    REFILL = 7  # filter-and-refill's redrawn prompts (rl.max_refill_draws)
    CURRICULUM = 8  # the pass-rate curriculum's prompts of a step (data.curriculum)


def _word(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: got {value!r} ({type(value).__name__}), expected an int")
    return int(value)


def mix(seed: int, purpose: int, step: int, *more: int) -> int:
    """The 64-bit key of ``(seed, purpose, step, *more)``: a BLAKE2b digest of the integers (any size, any sign).

    >>> mix(0, Purpose.DATA, 3) == mix(0, 0, 3) != mix(0, 0, 4)
    True
    >>> 0 <= mix(10**30, 1, -5) < 2**64
    True
    """
    words = [_word("seed", seed), _word("purpose", purpose), _word("step", step)]
    words += [_word(f"more[{i}]", w) for i, w in enumerate(more)]
    digest = hashlib.blake2b(",".join(map(str, words)).encode(), digest_size=8, person=b"rlcore").digest()
    return int.from_bytes(digest, "little")


def generator(seed: int, purpose: int, step: int, *more: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by :func:`mix` of the key: the host-side form of the rule.

    >>> a = torch.rand(2, generator=generator(0, Purpose.DATA, 1))
    >>> torch.equal(a, torch.rand(2, generator=generator(0, Purpose.DATA, 1)))
    True
    """
    return torch.Generator().manual_seed(mix(seed, purpose, step, *more))


def _mul32(x: Any, c: int) -> Any:
    """``x * c mod 2**32`` for ``x`` in ``[0, 2**32)``, 16 bits of ``c`` at a time (no int64 product overflows)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: Any) -> Any:
    """MurmurHash3's finaliser: each input bit flips each output bit with probability about 1/2."""
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX[0])
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX[1])
    return h ^ (h >> 16)


def hash32(state: Any, word: Any) -> Any:
    """One link of the chain: ``fmix32((state ^ word) + golden)``; Python ints or int64 tensors holding 32-bit values.

    >>> hash32(0, 1) == hash32(torch.tensor([0]), torch.tensor([1])).item()
    True
    """
    return _fmix32(((state ^ (word & _M32)) + _GOLDEN) & _M32)


def row_keys(key: int, rows: torch.Tensor) -> torch.Tensor:
    """Each row's 32-bit state after ``(key, row)``: ``[N]`` int64, on ``rows``' device.

    Args:
      key: a 64-bit key from :func:`mix`.
      rows: ``[N]`` integer global row indices (``>= 0``).

    Returns:
      ``[N]`` int64 states in ``[0, 2**32)`` for :func:`row_uniforms`.
    """
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.is_floating_point() or rows.dtype == torch.bool:
        got = f"{rows.dtype} tensor of shape {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else repr(rows)
        raise ValueError(f"rows: got {got}, expected a 1-D integer tensor of row indices")
    state = hash32(hash32(0, key & _M32), key >> 32)  # a host int: the same for every row
    rows = rows.to(torch.int64)
    return hash32(hash32(torch.full_like(rows, state), rows), rows >> 32)


def row_uniforms(keys: torch.Tensor, position: int | torch.Tensor, draw: int = 0) -> torch.Tensor:
    """Uniforms in ``[0, 1)`` (24 bits, float32) of each row at a token ``position``: sync-free, batch-independent.

    ``u = (h >> 8) / 2**24`` with ``h`` the chain of :func:`hash32` over the row's state
    (:func:`row_keys`), the position and the draw counter.

    Args:
      keys: ``[N]`` row states from :func:`row_keys` (or any shape that broadcasts with ``position``).
      position: the token position: an int, or integer positions that broadcast with
        ``keys`` (``[N]`` per row; ``keys[:, None]`` with ``[S]`` or ``[N, S]``: a table).
      draw: a counter for more than one draw at a position.

    Returns:
      float32 of the broadcast shape.

    >>> u = row_uniforms(row_keys(mix(0, Purpose.SAMPLING, 0), torch.arange(3)), 0)
    >>> u.shape, bool(((u >= 0) & (u < 1)).all())
    (torch.Size([3]), True)
    """
    h = hash32(hash32(keys, position), draw)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


class RowStream(torch.Generator):
    """The sampling stream of one call: the key ``(seed, purpose, step)`` and the global index of each row.

    A ``torch.Generator`` (CPU, seeded by :func:`mix` of the key and the first row) for
    engines that take one; rlcore's samplers draw row ``rows[i]``'s token at a position
    from :func:`row_uniforms` instead, so its response does not depend on the batch.

    Args:
      seed, purpose, step: the key.
      rows: ``[N]`` global row indices of the call's output rows, on the host; None:
        row ``i`` of the output is global row ``i``.

    >>> s = RowStream(0, Purpose.SAMPLING, 4, torch.tensor([6, 7]))
    >>> isinstance(s, torch.Generator), s.row_ids(2).tolist()
    (True, [6, 7])
    """

    base_seed: int  # not ``seed``: torch.Generator.seed() is a method
    purpose: int
    step: int
    rows: torch.Tensor | None
    key: int

    def __new__(cls, seed: int, purpose: int, step: int, rows: torch.Tensor | None = None) -> RowStream:
        key = mix(seed, purpose, step)
        if rows is not None:
            if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.is_floating_point():
                got = f"shape {tuple(rows.shape)} {rows.dtype}" if isinstance(rows, torch.Tensor) else repr(rows)
                raise ValueError(f"rows: got {got}, expected a 1-D integer tensor of global row indices")
            rows = rows.to(torch.int64)
        first = int(rows[0]) if rows is not None and rows.numel() else 0  # sync-ok: the rows live on the host
        self = super().__new__(cls)
        self.manual_seed(mix(seed, purpose, step, first))
        self.base_seed, self.purpose, self.step, self.rows, self.key = seed, int(purpose), step, rows, key
        return self

    def row_ids(self, count: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The ``[count]`` global row indices of a call with ``count`` output rows, on ``device``."""
        if self.rows is None:
            return torch.arange(count, device=device)
        if self.rows.numel() != count:
            raise ValueError(f"rows: got {self.rows.numel()} row indices, expected {count} (one per output row)")
        return self.rows.to(device)

    def select(self, index: torch.Tensor | list[int]) -> RowStream:
        """The stream of a subset of the rows (``index`` into this call's rows), same key."""
        index = torch.as_tensor(index, dtype=torch.int64)
        rows = index if self.rows is None else self.rows[index]
        return RowStream(self.base_seed, self.purpose, self.step, rows)

    def __repr__(self) -> str:
        rows = "all" if self.rows is None else f"{self.rows.numel()} rows"
        return f"RowStream(seed={self.base_seed}, purpose={self.purpose}, step={self.step}, {rows})"
