"""The adaptive entropy bonus of ``rl.entropy_target``: the controller's coefficient in the loss, its state in checkpoints.

:func:`rlcore.algos.adaptive_entropy_controller` is an ``(init, update)`` pair over an
explicit state. :class:`EntropyTarget` holds that state for a run: the update's recipe
takes the current coefficient as its ``entropy_coef`` (:meth:`EntropyTarget.recipe`);
at the end of each step the step's logged mean token entropy (the ``entropy`` metric,
the whole batch's over the data-parallel ranks, so every rank's state is the same)
updates it (:meth:`EntropyTarget.end_step`), and the coefficient of the next step is
logged as ``entropy/coef``. The state is saved with the checkpoint
(:meth:`checkpoint_state`, :meth:`restore_state`), so a resumed run continues with
the coefficient an uninterrupted one would have.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from rlcore import algos

__all__ = ["EntropyTarget", "parse_entropy_target"]

_KEYS = ("target", "delta", "init_coef", "max_coef")


def parse_entropy_target(raw: Any, *, key: str = "rl.entropy_target") -> dict[str, Any]:
    """``rl.entropy_target``: a target entropy (nats per token), or ``{target, delta, init_coef, max_coef}``.

    The keywords of :func:`rlcore.algos.adaptive_entropy_controller`, checked by it
    (published defaults for those left out); a ``ValueError`` names the key.

    >>> parse_entropy_target(0.3)
    {'target': 0.3}
    >>> parse_entropy_target({"target": 0.3, "step": 1})
    Traceback (most recent call last):
    ...
    ValueError: config key 'rl.entropy_target.step': unknown, expected one of target, delta, init_coef, max_coef
    """
    options = dict(raw) if isinstance(raw, Mapping) else {"target": raw}
    for name, value in options.items():
        if name not in _KEYS:
            raise ValueError(f"config key '{key}.{name}': unknown, expected one of {', '.join(_KEYS)}")
        nullable = name == "max_coef" and value is None
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not (nullable or number):
            raise ValueError(f"config key '{key}.{name}': got {value!r}, expected a finite number")
    if "target" not in options:
        raise ValueError(f"config key {key!r}: got {dict(options)!r}, expected a target entropy (nats per token)")
    try:
        algos.adaptive_entropy_controller(**options)
    except ValueError as err:
        raise ValueError(f"config key {key!r}: {err}") from err
    return options


class _Bonus:
    """A policy-gradient recipe whose ``entropy_coef`` is the controller's current coefficient."""

    def __init__(self, recipe: algos.Algorithm, owner: EntropyTarget):
        self.inner, self.owner = recipe, owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def loss(self, batch: dict[str, Any], **counts: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out: tuple[torch.Tensor, dict[str, torch.Tensor]] = self.inner._replace(entropy_coef=self.owner.coef).loss(
            batch, **counts
        )
        return out


class EntropyTarget:
    """The run's adaptive entropy controller and its state.

    Args:
      options: the controller's keywords (:func:`parse_entropy_target`).
    """

    def __init__(self, options: Mapping[str, Any]):
        self.controller = algos.adaptive_entropy_controller(**options)
        self.state = self.controller.init()
        self.coef = float(self.state.entropy_coef)

    def recipe(self, recipe: algos.Algorithm) -> Any:
        """``recipe`` taking the current coefficient as its entropy bonus at every update."""
        if not isinstance(recipe, algos.Algorithm):
            raise ValueError(
                f"recipe: got a {type(recipe).__name__}, expected an rlcore.algos.Algorithm (a policy-gradient recipe "
                "with an entropy bonus)"
            )
        return _Bonus(recipe, self)

    def end_step(self, entropy: float) -> dict[str, float]:
        """Update the state with the step's mean token entropy; the next step's coefficient, to log."""
        self.state = self.controller.update(torch.tensor(entropy, dtype=torch.float32), self.state)
        self.coef = float(self.state.entropy_coef)
        return {"entropy/coef": self.coef}

    def checkpoint_state(self, step: int) -> dict[str, torch.Tensor]:
        """The state after step ``step`` (copies: a background save may still read them)."""
        return {"alpha": self.state.alpha.clone(), "entropy_coef": self.state.entropy_coef.clone()}

    def restore_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from :meth:`checkpoint_state`'s state."""
        self.state = algos.EntropyControllerState(state["alpha"].clone(), state["entropy_coef"].clone())
        self.coef = float(self.state.entropy_coef)
