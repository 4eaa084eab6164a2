"""``model.teacher`` given as a config file: the teacher is trained by that config first, once, into the run's folder.

On-policy distillation needs a teacher that already knows the task. A teacher directory
can come from any earlier run (``trainer.export`` writes ``output_dir/hf``); a teacher
*config* makes the student's run self-contained: ``rlcore train --config
configs/opd_tiny.yaml`` trains ``configs/opd_teacher_tiny.yaml`` into
``<output_dir>/teacher`` when ``<output_dir>/teacher/hf`` is not there yet (a resumed or
repeated run reuses it), then distils from it.
"""

from __future__ import annotations

import dataclasses
import os

from rlcore.train.config import Config, load_config
from rlcore.train.rundir import prepare_run_dir

__all__ = ["TEACHER_CONFIG_SUFFIXES", "made_teacher"]

TEACHER_CONFIG_SUFFIXES = (".yaml", ".yml")


def made_teacher(cfg: Config, *, resume: bool = False, overwrite: bool = False) -> Config:
    """``cfg`` with ``model.teacher`` a directory: a teacher config is trained first (once) and replaced by its export.

    Args:
      cfg: the student's config; unchanged unless ``model.teacher`` names a YAML config.
      resume, overwrite: the student run's flags; its output folder is checked before the
        teacher is trained (a run there that would be refused is refused first).

    Raises:
      ValueError: the teacher config cannot be read or is invalid (naming ``model.teacher``), or
        a teacher must be trained under ``torchrun`` (train it first, on one process).
    """
    teacher = cfg.model.teacher
    if teacher is None or not teacher.endswith(TEACHER_CONFIG_SUFFIXES):
        return cfg
    folder = os.path.join(cfg.trainer.output_dir, "teacher")
    export = os.path.join(folder, "hf")
    if not os.path.isdir(export):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                f"config key 'model.teacher': got the config {teacher!r} under torchrun, expected a teacher directory; "
                f"train it first on one process (rlcore train --config {teacher}) and give its output_dir/hf"
            )
        prepare_run_dir(cfg.trainer.output_dir, resume=resume, overwrite=overwrite)
        try:
            tcfg = load_config(teacher, [f"trainer.output_dir={folder}", "trainer.export=true", "trainer.plot=false"])
        except ValueError as err:
            raise ValueError(f"config key 'model.teacher': the teacher's config {teacher!r}: {err}") from err
        print(
            f"model.teacher: training the teacher with {teacher} into {folder} (once; later runs reuse it)", flush=True
        )
        from rlcore.train.trainer import train  # the trainer builds on this module's caller: imported when used

        train(tcfg, overwrite=True)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, teacher=export))
