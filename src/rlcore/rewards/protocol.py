"""The reward protocol: ``reward(prompts, responses, **columns) -> tensor [B]``, and how rewards are called.

A reward is any callable taking the decoded prompts and responses (lists of ``B``
strings) plus per-sample data columns (``answers=...``) and returning one score per
response. Objects in the style of MindSpeed-RL's ``BaseReward`` -- a ``forward(self,
prompts, responses, **kwargs)`` method returning a list of numbers or booleans -- are
rewards too, unchanged: :func:`evaluate` calls ``forward`` when an object has one.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Reward", "RewardError", "evaluate", "reward_name"]


@runtime_checkable
class Reward(Protocol):
    """``(prompts [B], responses [B], **columns) -> scores``: a tensor ``[B]`` or a list of numbers / booleans."""

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **columns: Any) -> Any: ...


class RewardError(ValueError):
    """A reward raised, or returned something other than one finite number per response."""


def reward_name(reward: Any) -> str:
    """The name an error message gives a reward: its ``name`` attribute, function name or class name.

    >>> reward_name(len)
    'len'
    """
    for attribute in ("name", "__name__"):
        try:
            name = getattr(reward, attribute, None)
        except Exception:  # a property that raises: the message is still made
            name = None
        if isinstance(name, str) and name:
            return name
    return type(reward).__name__


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _type_name(value: Any) -> str:
    """``float``, ``numpy.str_``, ``torch.Tensor of shape (2,)``: what an error calls a value's type."""
    cls = type(value)
    root = cls.__module__.split(".")[0]
    name = cls.__name__ if root == "builtins" else f"{root}.{cls.__name__}"
    shape = getattr(value, "shape", None)
    return f"{name} of shape {tuple(shape)}" if isinstance(shape, tuple) and shape else name


def _kind(value: Any) -> str | None:
    """The numeric kind of a torch or numpy array / scalar: ``"b"``, ``"i"``, ``"u"``, ``"f"``, ``"c"``; else None."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            return "c"
        return "b" if value.dtype == torch.bool else "f" if value.is_floating_point() else "i"
    kind = getattr(getattr(value, "dtype", None), "kind", None)  # numpy arrays and scalars
    return kind if isinstance(kind, str) and kind in "biufc" else None


def _complex(where: str, what: str) -> RewardError:
    return RewardError(f"{where}: got complex {what}, expected real numbers or booleans (scores are real)")


def _element(value: Any, index: int, where: str) -> float:
    """One score of a list: a number, a boolean, or a 0-d torch / numpy array or numpy scalar of either."""
    if isinstance(value, (bool, numbers.Real)):
        try:
            return _as_float(value)
        except Exception as err:  # a Real whose float() raises
            raise RewardError(
                f"{where}: got a score {_type_name(value)} at index {index} that cannot be read as a number "
                f"({type(err).__name__}: {err})"
            ) from err
    kind = _kind(value) if tuple(getattr(value, "shape", (0,))) == () else None
    if isinstance(value, numbers.Complex) or kind == "c":
        raise _complex(where, f"{value!r} at index {index}")
    if kind is None:
        raise RewardError(f"{where}: got {_type_name(value)} at index {index}, expected numbers or booleans")
    return _as_float(value.item())


def _as_scores(out: Any, n: int, where: str) -> torch.Tensor:
    if inspect.isawaitable(out):
        if inspect.iscoroutine(out):
            out.close()  # never awaited: no "coroutine was never awaited" warning
        raise RewardError(
            f"{where}: returned a coroutine (an async reward), expected scores; "
            "define the reward with def, not async def (it runs in a worker process or thread already)"
        )
    try:
        scores = _read_scores(out, n, where)
    except RewardError:
        raise
    except Exception as err:  # an object whose conversion raises: named, never a raw traceback
        raise RewardError(
            f"{where}: got a score of type {_type_name(out)} that cannot be read as numbers ({type(err).__name__}: {err})"
        ) from err
    if scores.shape != (n,):
        raise RewardError(f"{where}: got scores of shape {tuple(scores.shape)}, expected ({n},) -- one per response")
    if not torch.isfinite(scores).all():
        index = int(torch.nonzero(~torch.isfinite(scores))[0])
        raise RewardError(f"{where}: got a non-finite score {scores[index]} at index {index}, expected finite scores")
    return scores


def _any_masked(out: Any) -> bool:
    """Whether a numpy masked array hides some of its values (its data there is no score)."""
    mask = getattr(out, "mask", None)
    return mask is not None and hasattr(mask, "any") and bool(mask.any())


def _read_scores(out: Any, n: int, where: str) -> torch.Tensor:
    kind = _kind(out)
    if kind == "c":
        raise _complex(where, f"scores ({_type_name(out)})")
    if isinstance(out, torch.Tensor):
        scores = out.detach().to("cpu", torch.float32)
        if scores.layout != torch.strided:  # a sparse tensor: its zeros are scores too
            scores = scores.to_dense()
    elif isinstance(out, (bytearray, memoryview)):  # bytes of any kind are not scores
        raise RewardError(f"{where}: got {_type_name(out)}, expected a tensor [{n}] or a list of {n} numbers")
    elif kind is not None and hasattr(out, "astype"):  # a numpy array of numbers or booleans
        if _any_masked(out):
            raise RewardError(f"{where}: got a masked array with masked scores, expected a score for every response")
        scores = torch.as_tensor(out.astype("float64")).float()
    else:
        if hasattr(out, "tolist") and hasattr(out, "dtype"):  # a numpy array of objects
            out = out.tolist()
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
            raise RewardError(f"{where}: got {_type_name(out)}, expected a tensor [{n}] or a list of {n} numbers")
        # An int past float's range is a score of infinite size, refused below like inf.
        scores = torch.tensor([_element(v, i, where) for i, v in enumerate(out)], dtype=torch.float32)
    return scores


def evaluate(
    reward: Any, prompts: Sequence[str], responses: Sequence[str], *, batch: int | str | None = None, **columns: Any
) -> torch.Tensor:
    """Call a reward on one batch and return its scores as a float32 tensor ``[B]``.

    Objects with a ``forward`` method (the ``BaseReward`` style) are called through it.
    Tensors, numpy arrays, and lists of numbers or booleans (Python's, numpy's, or 0-d
    arrays of them) become float32 tensors (``True`` is 1.0); complex scores are refused.

    Args:
      reward: a :class:`Reward` callable or an object with ``forward``.
      prompts, responses: ``B`` strings each.
      batch: an identifier of the batch (the step), named in errors.
      **columns: per-sample data passed through, e.g. ``answers``.

    Returns:
      float32 tensor ``[B]`` on the CPU.

    Raises:
      RewardError: naming the reward and the batch, if the reward raises or returns
        anything but ``B`` finite numbers.

    >>> class LongEnough:  # the seed's BaseReward style
    ...     def forward(self, prompts, responses, **kwargs):
    ...         return [len(r) > 3 for r in responses]
    >>> evaluate(LongEnough(), ["q", "q"], ["short", "no"])
    tensor([1., 0.])
    """
    if len(prompts) != len(responses):
        raise ValueError(f"responses: got {len(responses)}, expected {len(prompts)} (one per prompt)")
    where = (
        f"reward {reward_name(reward)!r} on batch {batch!r}" if batch is not None else f"reward {reward_name(reward)!r}"
    )
    fn = reward.forward if callable(getattr(reward, "forward", None)) else reward
    try:
        out = fn(list(prompts), list(responses), **columns)
    except (Exception, SystemExit, GeneratorExit) as err:  # a reward's exit() is its failure, not the run's exit
        raise RewardError(f"{where} of {len(responses)} responses raised {type(err).__name__}: {err}") from err
    return _as_scores(out, len(responses), where)
