"""Reference answers as the rewards read them: a tensor or numpy answer of one value is that number."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def reference_answers(values: Sequence[Any], name: str = "answers") -> list[Any]:
    """``values`` with each one-element torch / numpy array (or numpy scalar) replaced by its Python number.

    A tensor answer would otherwise be read as its text ``"tensor(3.)"``. Strings,
    numbers and ``None`` pass unchanged.

    Raises:
      ValueError: naming ``name[i]``, for an array answer of more than one value, or a
        list, tuple, dict, set or bytes answer (it would be compared as its text).
    """
    out = []
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor) or (hasattr(value, "dtype") and hasattr(value, "item")):
            shape = tuple(value.shape)
            if value.numel() != 1 if isinstance(value, torch.Tensor) else value.size != 1:
                raise ValueError(
                    f"{name}[{i}]: got a {'tensor' if isinstance(value, torch.Tensor) else 'numpy array'} of shape {shape}, "
                    "expected a string, a number, or a one-element tensor"
                )
            value = value.item()
        elif isinstance(value, (list, tuple, dict, set, bytes)):
            raise ValueError(
                f"{name}[{i}]: got a {type(value).__name__}, expected a string, a number, or a one-element tensor "
                "(one reference answer per response)"
            )
        out.append(value)
    return out
