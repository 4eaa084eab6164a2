"""What a run's checkpoint holds, and the one place it is saved and restored.

Beside the models, their optimisers, the step and the random streams, a checkpoint holds
the state of the run's stateful parts (``extras``: :func:`run_extras`, e.g. the replay
buffer, the curriculum's pass rates, the adaptive entropy controller): each has
``checkpoint_state(step) -> data`` and ``restore_state(data)``, so a resumed run equals an
uninterrupted one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from rlcore.models import is_lora
from rlcore.train.carry import CarryBook
from rlcore.train.checkpoint import (
    PendingSave,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    save_checkpoint_async,
    set_rng_state,
)
from rlcore.train.config import Config
from rlcore.train.entropy_target import EntropyTarget, parse_entropy_target
from rlcore.train.lora import adapter_modules
from rlcore.train.optim import Models, Optimiser
from rlcore.train.replay import Replay, parse_replay
from rlcore.train.rundir import check_resume_config, check_resume_shapes, check_resume_steps, inexact_resume

__all__ = ["check_resume", "restore_run", "run_extras", "save_run", "save_run_async"]


def run_extras(cfg: Config, task: Any, *, ranks: int = 1) -> dict[str, Any]:
    """The run's stateful parts that the config asks for, by checkpoint key.

    ``replay`` (``rl.replay``: :class:`rlcore.train.replay.Replay`), ``curriculum``
    (``data.curriculum``: the prompt source itself, :class:`rlcore.train.CurriculumPrompts`),
    ``entropy_target`` (``rl.entropy_target``: :class:`rlcore.train.entropy_target.EntropyTarget`),
    ``carry`` (``deploy.carry_over``: the rows sent and not trained, :class:`rlcore.train.carry.CarryBook`,
    at data-parallel size ``ranks``). A checkpoint holds their states per rank (each rank's own rows in flight).
    """
    rl = cfg.rl
    out: dict[str, Any] = {}
    if rl.replay is not None:
        out["replay"] = Replay(parse_replay(rl.replay))
    if callable(getattr(task, "checkpoint_state", None)):  # the curriculum, under the refill wrapper or not
        out["curriculum"] = task
    if rl.entropy_target is not None:
        out["entropy_target"] = EntropyTarget(parse_entropy_target(rl.entropy_target))
    if cfg.deploy.carry_over:
        out["carry"] = CarryBook(ranks=ranks)
    return out


def _state(step: int, models: Models, opt: Optimiser, cfg: Config, extras: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds: the models with their optimisers (DCP shards), the step, the random streams, the extras."""
    lora = is_lora(models.policy)  # the adapters alone; the base (and reference) is the model directory's
    state: dict[str, Any] = {
        "step": step,
        "policy": (adapter_modules(models.policy) if lora else models.policy, opt.opts[0]),
        **({} if lora else {"reference": models.reference}),
        # The global stream: the update's dropout (critic) draws from it.
        "rng": rng_state(),
        "config": cfg.to_dict(),
    }
    if models.critic is not None:
        state["critic"] = (models.critic, opt.opts[1])
    if extras:
        state["extras"] = {key: part.checkpoint_state(step) for key, part in extras.items()}
    return state


def _saved_state(
    step: int, models: Models, opt: Optimiser, cfg: Config, shapes: dict[str, list[int]], extras: Mapping[str, Any]
) -> dict[str, Any]:
    """What :func:`save_run` and :func:`save_run_async` write: the state, with the model's tensor shapes beside it."""
    return {**_state(step, models, opt, cfg, extras), "model_shapes": shapes}


def save_run(
    out: Path,
    step: int,
    models: Models,
    opt: Optimiser,
    cfg: Config,
    shapes: dict[str, list[int]],
    extras: Mapping[str, Any] | None = None,
) -> None:
    """Every rank calls it: DCP writes each rank's shards (a run saved at 2 ranks resumes at 1).

    ``shapes`` (the model's tensor shapes, checked by a resume before anything loads) is saved beside the state;
    ``extras`` (:func:`run_extras`) each give their state after ``step`` (this rank's).
    """
    save_checkpoint(out, _saved_state(step, models, opt, cfg, shapes, extras or {}), step=step + 1)


def save_run_async(
    out: Path,
    step: int,
    models: Models,
    opt: Optimiser,
    cfg: Config,
    shapes: dict[str, list[int]],
    extras: Mapping[str, Any] | None = None,
    *,
    process_group: Any = None,
    stage_in_background: bool = False,
    staging: Callable[[dict[str, Any]], Future[dict[str, Any]]] | None = None,
) -> PendingSave:
    """:func:`save_run` in the background (:func:`rlcore.train.checkpoint.save_checkpoint_async`): returns once the
    state is copied to host memory (at once with ``stage_in_background``: then the models and optimisers must not
    change before the future's ``staged`` is done; with ``staging`` the copy is the phase switch's, as
    :func:`rlcore.train.checkpoint.save_checkpoint_async` says); the future is done when the version is committed."""
    return save_checkpoint_async(
        out,
        _saved_state(step, models, opt, cfg, shapes, extras or {}),
        step=step + 1,
        process_group=process_group,
        stage_in_background=stage_in_background,
        staging=staging,
    )


def restore_run(out: Path, models: Models, opt: Optimiser, cfg: Config, extras: Mapping[str, Any] | None = None) -> int:
    """Load the committed checkpoint into the (sharded) models and optimisers, in place; the next step.

    Each of ``extras`` continues from its saved state, this rank's (one the checkpoint does not hold, a
    part turned on by a changed config, starts afresh).
    """
    data = load_checkpoint(out, _state(0, models, opt, cfg, {}))
    saved = data.get("extras") or {}
    for key, part in (extras or {}).items():
        if key in saved:
            part.restore_state(saved[key])
    for o in opt.opts:
        # Loaded tensors may share the file's storage, which cannot be resized: the
        # co-located swap offloads the optimiser state by resizing storages to 0.
        for values in o.state.values():
            for k, v in values.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                    values[k] = v.clone()
    set_rng_state(data["rng"])
    return int(data["step"]) + 1


def check_resume(out: Path, cfg: Config, shapes: dict[str, list[int]], *, allow_change: bool = False) -> None:
    """Refuse a resume, before anything loads, whose checkpoint has another config (unless
    ``allow_change``), other tensor shapes (the model directory may hold other weights now)
    or more steps than ``trainer.steps``; warn (``RuntimeWarning``) when the config has state the
    checkpoint does not hold (:func:`rlcore.train.rundir.inexact_resume`): the run goes on, not exactly."""
    saved = load_checkpoint(out)
    check_resume_config(saved.get("config"), cfg.to_dict(), allow_change=allow_change)
    checkpoint = out / "checkpoint"
    check_resume_shapes(
        saved.get("model_shapes"), shapes, checkpoint=checkpoint, model=str(cfg.model.model_name_or_path)
    )
    check_resume_steps(saved.get("step"), cfg.trainer.steps, checkpoint=checkpoint)
    lost = inexact_resume(cfg.to_dict())
    if lost:
        warnings.warn(
            f"resume from {str(checkpoint)!r} is not exact (it will differ from an uninterrupted run): "
            + "; ".join(lost),
            RuntimeWarning,
            stacklevel=2,
        )
