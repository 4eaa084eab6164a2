"""Run directories that are safe to reuse: a new run never overwrites an old one by accident, a resume checks its config.

:func:`prepare_run_dir` refuses to start a new run in an output directory that holds
one (its metrics or checkpoint), naming ``--resume`` and ``--overwrite``; with
``overwrite`` it removes the old run's files first. :func:`config_changes` compares the
config a checkpoint recorded with the current one: model keys (shapes, adapters) may
never change on resume, other hyper-parameters only with ``--allow-config-change``;
run-length and bookkeeping keys (``trainer.steps``, ``trainer.output_dir``, ...) are free.
:func:`check_resume_shapes` compares the model's tensor shapes a checkpoint recorded with
those of the model the config builds now (the same directory may hold other weights);
:func:`check_resume_steps` refuses a resume to fewer steps than the checkpoint holds.
:func:`inexact_resume` names the options whose state the checkpoint does not hold: with
none of them on, a resume in the blocking pipeline equals the uninterrupted run bit for bit,
whatever ``trainer.steps`` and ``trainer.save_every`` each part ran with.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "FREE_KEYS",
    "RUN_FILES",
    "check_resume_config",
    "check_resume_shapes",
    "check_resume_steps",
    "config_changes",
    "inexact_resume",
    "prepare_run_dir",
]

# What a run writes into its output directory.
RUN_FILES = ("metrics.jsonl", "checkpoint", "hf", "curves.png", "timeline.png")
# Keys a resumed run may change freely: how long, where, how it reports, how it checkpoints.
FREE_KEYS = frozenset(
    {
        "trainer.steps",
        "trainer.output_dir",
        "trainer.progress",
        "trainer.plot",
        "trainer.threads",
        "trainer.save_every",
        "trainer.reward_workers",
        "trainer.reward_timeout",
        "trainer.timeline_iterations",
        "trainer.eval_every",
        "trainer.export",
        "trainer.stop_signals",
        "trainer.stop_timeout",
        "trainer.async_save",
        "trainer.max_worker_restarts",
        "deploy.rollout_timeout",
    }
)


def prepare_run_dir(output_dir: str | os.PathLike, *, resume: bool, overwrite: bool, leader: bool = True) -> None:
    """Refuse a new run into a directory holding a run, unless ``overwrite`` (then its run files are removed).

    Args:
      output_dir: ``trainer.output_dir``.
      resume: the run continues the one there (nothing to check).
      overwrite: replace the run there.
      leader: this process removes the files (rank 0); the others only check.

    Raises:
      ValueError: one line naming the directory, ``--resume`` and ``--overwrite``.

    >>> import tempfile
    >>> prepare_run_dir(tempfile.mkdtemp(), resume=False, overwrite=False)
    """
    if resume:
        return
    out = Path(output_dir)
    found = [name for name in RUN_FILES[:2] if (out / name).exists()]
    if not found:
        return
    if not overwrite:
        raise ValueError(
            f"trainer.output_dir: {str(out)!r} already holds a run ({', '.join(found)}); pass --resume to continue "
            "it or --overwrite to replace it, or choose another --output_dir"
        )
    if leader:
        for name in RUN_FILES:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


def _flatten(tree: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(tree, Mapping) and tree:
        for key, value in tree.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = tree
    return out


# Batch sizes the config gives per data-parallel rank: a resume at another world size keeps
# the global batch when these times ``parallel.data_parallel`` are unchanged.
_PER_RANK_KEYS = ("rl.batch_size", "rl.mini_batch_size", "trainer.warmup_batch_size")


def _comparable(config: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened config as a resume compares it: ``parallel.*`` left out (checkpoints load at any layout),
    per-rank batch sizes scaled to the global batch."""
    flat = _flatten(config, "", {})
    dp = flat.get("parallel.data_parallel", 1)
    for key in _PER_RANK_KEYS:
        if isinstance(flat.get(key), int) and isinstance(dp, int):
            flat[key] = flat[key] * dp
    return {k: v for k, v in flat.items() if not k.startswith("parallel.")}


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The keys that differ between a checkpoint's config and the current one, as ``(model keys, other keys)``.

    Free keys (:data:`FREE_KEYS`) and the layout (``parallel.*``) are left out; per-rank batch
    sizes (:data:`_PER_RANK_KEYS`) are compared as global batches (times ``data_parallel``).

    >>> config_changes({"model": {"path": "a"}, "rl": {"lr": 1.0}}, {"model": {"path": "b"}, "rl": {"lr": 2.0}})
    (['model.path'], ['rl.lr'])
    """
    a, b = _comparable(saved), _comparable(current)
    keys = sorted(k for k in set(a) | set(b) if k not in FREE_KEYS and a.get(k, object()) != b.get(k, object()))
    return [k for k in keys if k.startswith("model.")], [k for k in keys if not k.startswith("model.")]


def _show(flat: Mapping[str, Any], key: str) -> str:
    return repr(flat.get(key, "<unset>"))


def check_resume_config(
    saved: Mapping[str, Any] | None, current: Mapping[str, Any], *, allow_change: bool
) -> list[str]:
    """Refuse a resume whose model differs from the checkpoint's, or whose hyper-parameters do without ``allow_change``.

    Args:
      saved: the config the checkpoint recorded (``None``: an older checkpoint without one; nothing to check).
      current: the run's config as a dict.
      allow_change: hyper-parameter changes were asked for (``--allow-config-change``).

    Returns:
      The hyper-parameter keys that changed (allowed), for the log.

    Raises:
      ValueError: one line naming the differing keys with their saved and current values.
    """
    if saved is None:
        return []
    model, other = config_changes(saved, current)
    a, b = _comparable(saved), _comparable(current)
    diffs = lambda keys: ", ".join(f"{k} ({_show(a, k)} -> {_show(b, k)})" for k in keys)  # noqa: E731
    if model:
        raise ValueError(
            f"resume: the model differs from the checkpoint's: {diffs(model)}; a checkpoint resumes only the model "
            "it was saved from (use rlcore export and a new run to start from it)"
        )
    if other and not allow_change:
        raise ValueError(
            f"resume: the config differs from the checkpoint's: {diffs(other)}; pass --allow-config-change to "
            "resume with the new values"
        )
    return other


def check_resume_shapes(
    saved: Mapping[str, Sequence[int]] | None,
    current: Mapping[str, Sequence[int]],
    *,
    checkpoint: str | os.PathLike,
    model: str,
) -> None:
    """Refuse a resume whose model has other tensors or shapes than the one the checkpoint was saved from.

    Args:
      saved: tensor name -> shape, as the checkpoint recorded them (``None``: an older
        checkpoint without them; nothing to check).
      current: tensor name -> shape of the model built now.
      checkpoint: the checkpoint's path, named in the error.
      model: where the model comes from (``model.model_name_or_path``), named in the error.

    Raises:
      ValueError: one line naming the checkpoint, the first differing tensor and its saved
        and current shapes (or the side that lacks it).

    >>> check_resume_shapes({"w": [2, 4]}, {"w": (2, 8)}, checkpoint="out/checkpoint", model="m")
    Traceback (most recent call last):
    ...
    ValueError: resume: checkpoint 'out/checkpoint' was saved from another model: tensor 'w' has shape [2, 4] there, [2, 8] in the model of model.model_name_or_path 'm' (its weights changed since the save?)
    """
    if saved is None:
        return
    where = f"resume: checkpoint {str(checkpoint)!r} was saved from another model: tensor"
    now = f"the model of model.model_name_or_path {model!r}"
    hint = "(its weights changed since the save?)"
    for name, shape in saved.items():
        if name not in current:
            raise ValueError(f"{where} {name!r} of shape {list(shape)} is not in {now} {hint}")
        if list(shape) != list(current[name]):
            raise ValueError(f"{where} {name!r} has shape {list(shape)} there, {list(current[name])} in {now} {hint}")
    for name, shape in current.items():
        if name not in saved:
            raise ValueError(f"{where} {name!r} of shape {list(shape)} in {now} is not in the checkpoint {hint}")


def check_resume_steps(saved_step: Any, steps: int, *, checkpoint: str | os.PathLike) -> None:
    """Refuse a resume whose ``trainer.steps`` is below the steps the checkpoint holds (it would train nothing).

    Args:
      saved_step: the checkpoint's ``step`` entry, the index of its last step (``None``: nothing to check).
      steps: ``trainer.steps`` of the resumed run.
      checkpoint: the checkpoint's path, named in the error.

    Raises:
      ValueError: one line naming both numbers.

    >>> check_resume_steps(399, 300, checkpoint="out/checkpoint")
    Traceback (most recent call last):
    ...
    ValueError: resume: trainer.steps is 300, but checkpoint 'out/checkpoint' already holds 400 steps; set trainer.steps above 400 to train further (a resume does not go back to an earlier step)
    """
    if isinstance(saved_step, bool) or not isinstance(saved_step, int):
        return
    done = saved_step + 1
    if steps < done:
        raise ValueError(
            f"resume: trainer.steps is {steps}, but checkpoint {str(checkpoint)!r} already holds {done} steps; set "
            f"trainer.steps above {done} to train further (a resume does not go back to an earlier step)"
        )


def inexact_resume(config: Mapping[str, Any]) -> list[str]:
    """The options of ``config`` whose state a checkpoint does not hold, each with what a resume loses.

    Nothing else in a run depends on where it was cut: the learning rate is constant (no
    schedule over ``trainer.steps``), the prompts, the samples and the validation are keyed
    by the global step, the optimiser moments, the global random stream and the run's
    stateful parts (the replay buffer, the curriculum's pass rates, the entropy controller:
    :func:`rlcore.train.run_state.run_extras`) are saved with the step. So with none of
    these options on, a run resumed in parts (each with its own ``trainer.steps`` and
    ``trainer.save_every``) equals the uninterrupted run bit for bit in the blocking pipeline.

    Args:
      config: the run's config as a dict (:meth:`rlcore.train.config.Config.to_dict`).

    Returns:
      One line per option that is on (empty: the resume is exact).

    >>> inexact_resume({"rl": {"replay": {"capacity": 8}}, "deploy": {"mode": "co-located"}})
    []
    >>> inexact_resume({"deploy": {"async_infer": True, "mode": "disaggregated"}})[0].split(":")[0]
    'deploy.async_infer (disaggregated)'
    """
    deploy = dict(config.get("deploy") or {})
    reasons = []
    if deploy.get("async_infer") and deploy.get("mode") == "disaggregated":
        reasons.append(
            "deploy.async_infer (disaggregated): the rollouts running ahead of the update are not saved; "
            "after the resume the first deploy.staleness steps sample from the restored weights, where the "
            "uninterrupted run sampled them from older ones"
            + (
                " (deploy.carry_over: the rows in flight are redone from their first token, none lost)"
                if deploy.get("carry_over")
                else ""
            )
        )
    return reasons
