"""A seeded, resumable order over a prompt set: the same (seed, position) always draws the same prompts."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from rlcore.seeding import Purpose, generator

__all__ = ["PromptDraw", "epoch_permutation", "sample_indices"]


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: got {value!r}, expected an int >= {minimum}")
    return value


@functools.lru_cache(maxsize=4)
def _permutation(num_prompts: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    if not shuffle:
        return tuple(range(num_prompts))
    order = torch.randperm(num_prompts, generator=generator(seed, Purpose.EPOCH_ORDER, epoch))
    return tuple(order.tolist())


def epoch_permutation(num_prompts: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order in which epoch ``epoch`` visits the prompts: a permutation of ``range(num_prompts)``.

    Each epoch has its own permutation, a pure function of ``(seed, epoch)``
    (``shuffle=False`` gives the identity).

    Args:
      num_prompts: size of the prompt set, ``> 0``.
      seed: the data seed.
      epoch: the epoch, ``>= 0``.
      shuffle: shuffle, or keep the file's order.

    Returns:
      ``num_prompts`` distinct indices.

    >>> sorted(epoch_permutation(5, seed=0, epoch=3))
    [0, 1, 2, 3, 4]
    >>> epoch_permutation(4, seed=0, epoch=0, shuffle=False)
    [0, 1, 2, 3]
    """
    _check_int("num_prompts", num_prompts, minimum=1)
    _check_int("seed", seed, minimum=0)
    _check_int("epoch", epoch, minimum=0)
    return list(_permutation(num_prompts, seed, epoch, bool(shuffle)))


class PromptDraw(NamedTuple):
    """What :func:`sample_indices` drew: prompt indices, the epoch of each, and where the next draw starts."""

    indices: list[int]
    epochs: list[int]
    next_position: int


def sample_indices(num_prompts: int, count: int, *, seed: int, position: int, shuffle: bool = True) -> PromptDraw:
    """The ``count`` prompts at global sample positions ``position, position + 1, ...``.

    Position ``p`` is prompt ``epoch_permutation(n, seed=seed, epoch=p // n)[p % n]``:
    every epoch visits each prompt once, a draw may cross an epoch boundary, and a
    run that saves ``next_position`` resumes exactly (no state beyond one integer).

    Args:
      num_prompts: size of the prompt set ``n``.
      count: prompts to draw, ``>= 0``.
      seed: the data seed.
      position: the global sample position of the first prompt (samples drawn so far).
      shuffle: shuffle each epoch, or keep the file's order.

    Returns:
      :class:`PromptDraw` ``(indices, epochs, next_position)``; the epoch counter of a
      run is ``next_position // num_prompts``.

    >>> draw = sample_indices(3, 4, seed=0, position=2, shuffle=False)
    >>> draw.indices, draw.epochs, draw.next_position
    ([2, 0, 1, 2], [0, 1, 1, 1], 6)
    """
    _check_int("num_prompts", num_prompts, minimum=1)
    _check_int("count", count, minimum=0)
    _check_int("seed", seed, minimum=0)
    _check_int("position", position, minimum=0)
    indices, epochs = [], []
    for p in range(position, position + count):
        epoch = p // num_prompts
        indices.append(_permutation(num_prompts, seed, epoch, bool(shuffle))[p % num_prompts])
        epochs.append(epoch)
    return PromptDraw(indices, epochs, position + count)
