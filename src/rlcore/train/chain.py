"""Models made by another config first: ``model.teacher`` and ``model.init_from`` given as YAML configs, trained once.

On-policy distillation needs a teacher that already knows the task, and a reward model (or
a GRPO run) starts best from a supervised model (the InstructGPT recipe). A model directory
can come from any earlier run (``trainer.export`` writes ``output_dir/hf``); a *config*
makes the run self-contained: ``rlcore train --config configs/opd_tiny.yaml`` trains
``configs/opd_teacher_tiny.yaml`` into ``<output_dir>/teacher``, and
``configs/rm_tiny.yaml`` trains ``configs/sft_tiny.yaml`` into ``<output_dir>/init_from``,
each when its ``hf`` export is not there yet (a resumed or repeated run reuses it), then
runs with that export in the key's place: the teacher's directory, or the model the run
starts from (``model.model_name_or_path``).
"""

from __future__ import annotations

import dataclasses
import os

from rlcore.train.config import CHAINED_CONFIG_SUFFIXES, Config, load_config
from rlcore.train.rundir import prepare_run_dir

__all__ = ["made_by_configs", "trained_export"]


def trained_export(cfg: Config, config: str, key: str, *, resume: bool = False, overwrite: bool = False) -> str:
    """The export of ``config`` trained into ``<cfg.trainer.output_dir>/<key's last name>``: trained first unless there.

    Args:
      cfg: the run's config (its ``trainer.output_dir`` holds the trained model).
      config: the YAML config that trains the model.
      key: the config key that named it (``model.teacher``, ``model.init_from``): the folder's
        name and the one named in errors.
      resume, overwrite: the run's flags; its output folder is checked before anything is
        trained (a run there that would be refused is refused first).

    Returns:
      The trained model's directory, ``<folder>/hf``.

    Raises:
      ValueError: the config cannot be read or is invalid (naming ``key``), or it must be
        trained under ``torchrun`` (train it first, on one process).
    """
    folder = os.path.join(cfg.trainer.output_dir, key.rsplit(".", 1)[-1])
    export = os.path.join(folder, "hf")
    if os.path.isdir(export):
        return export
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"config key {key!r}: got the config {config!r} under torchrun, expected a model directory; "
            f"train it first on one process (rlcore train --config {config}) and give its output_dir/hf"
        )
    prepare_run_dir(cfg.trainer.output_dir, resume=resume, overwrite=overwrite)
    try:
        first = load_config(config, [f"trainer.output_dir={folder}", "trainer.export=true", "trainer.plot=false"])
    except ValueError as err:
        raise ValueError(f"config key {key!r}: the config {config!r}: {err}") from err
    print(f"{key}: training {config} into {folder} (once; later runs reuse it)", flush=True)
    from rlcore.train.trainer import train  # the trainer builds on this module's caller: imported when used

    train(first, overwrite=True)
    return export


def made_by_configs(cfg: Config, *, resume: bool = False, overwrite: bool = False) -> Config:
    """``cfg`` with each of ``model.teacher`` / ``model.init_from`` that names a YAML config replaced by its export.

    ``model.init_from``'s export becomes ``model.model_name_or_path`` (and the key is
    cleared); that config must build the same model as ``cfg`` (the model ``cfg`` was
    validated with), so its ``model.model_name_or_path`` must equal ``cfg``'s.

    Raises:
      ValueError: as :func:`trained_export`, or ``model.init_from``'s config builds another model.
    """
    model = cfg.model
    if model.teacher is not None and model.teacher.endswith(CHAINED_CONFIG_SUFFIXES):
        model = dataclasses.replace(
            model, teacher=trained_export(cfg, model.teacher, "model.teacher", resume=resume, overwrite=overwrite)
        )
    if model.init_from is not None:
        try:
            base = load_config(model.init_from).model.model_name_or_path
        except ValueError as err:
            raise ValueError(f"config key 'model.init_from': the config {model.init_from!r}: {err}") from err
        if base != model.model_name_or_path:
            raise ValueError(
                f"config key 'model.init_from': the config {model.init_from!r} builds model.model_name_or_path "
                f"{base!r}, expected this run's {model.model_name_or_path!r} (its export replaces it)"
            )
        export = trained_export(cfg, model.init_from, "model.init_from", resume=resume, overwrite=overwrite)
        model = dataclasses.replace(model, model_name_or_path=export, init_from=None)
    return cfg if model is cfg.model else dataclasses.replace(cfg, model=model)
