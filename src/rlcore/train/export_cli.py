"""``rlcore export CHECKPOINT OUT_DIR``: a training checkpoint as a Hugging Face directory that loads anywhere.

The checkpoint records its config, so the model is rebuilt from it (the local model
directory or the inline config), its trained weights loaded, and the result written
with ``save_pretrained`` (safetensors, config, generation config, and the tokenizer of a
dataset run) through :func:`rlcore.models.export_hf`. A LoRA checkpoint holds the
adapters alone: they are put back on the base model of the recorded config (an inline
config's random weights rebuilt from the run's seed) and the merged weights written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from rlcore.models import export_hf
from rlcore.train.build import build_model
from rlcore.train.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint
from rlcore.train.config import parse_config
from rlcore.train.lora import adapter_modules, attach_lora
from rlcore.train.prompts import source_tokenizer, task_options

__all__ = ["export_checkpoint"]


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the policy of a training checkpoint to ``out_dir`` as a Hugging Face directory.

    Args:
      checkpoint: a run's output directory, or its ``checkpoint`` folder.
      out_dir: the directory to write (``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it).

    Returns:
      ``out_dir`` as a ``Path``.

    Raises:
      ValueError: one line naming the checkpoint when it is missing, damaged or records no config.
    """
    if not str(out_dir).strip():
        raise ValueError("out_dir: got '', expected a directory path to write the model to")
    run = Path(checkpoint)
    if run.name == CHECKPOINT_NAME and not (run / CHECKPOINT_NAME).exists():
        run = run.parent
    if not (run / CHECKPOINT_NAME).is_dir():
        raise ValueError(
            f"checkpoint: no training checkpoint at {str(run / CHECKPOINT_NAME)!r}, expected a run's output "
            "directory (trainer.output_dir) or its checkpoint folder"
        )
    out, folder = Path(out_dir).resolve(), (run / CHECKPOINT_NAME).resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: {str(out_dir)!r} is a file, expected a directory to write the model to")
    if out == folder or folder in out.parents:
        raise ValueError(
            f"out_dir: {str(out_dir)!r} is inside the checkpoint folder {str(run / CHECKPOINT_NAME)!r}, expected "
            "another directory (e.g. the run's hf/)"
        )
    try:
        state = load_checkpoint(run)
    except CheckpointError:
        raise
    except ValueError as err:  # the folder holds no finished save (no 'latest' marker)
        raise ValueError(
            f"checkpoint: no training checkpoint at {str(run / CHECKPOINT_NAME)!r} (the folder holds no finished save)"
        ) from err
    saved = state.get("config")
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint: {str(run)!r} records no config, so its model cannot be rebuilt")
    cfg = parse_config(saved)
    tokenizer = source_tokenizer(cfg, task_options(cfg))
    with torch.random.fork_rng(devices=[]):
        # An inline config's random weights are the run's own (the trainer seeds before it builds):
        # the base a LoRA checkpoint's adapters go back on.
        torch.manual_seed(cfg.trainer.seed)
        model: Any = build_model(cfg, tokenizer.vocab_size)
    target = model
    if cfg.model.lora is not None:  # the checkpoint holds the adapters; the base is the model directory's
        model = attach_lora(model, cfg)
        target = adapter_modules(model)
    policy = state.get("policy")
    if isinstance(policy, dict) and isinstance(policy.get("model"), dict):  # saved with its optimiser
        policy = policy["model"]
    if not isinstance(policy, dict):
        raise ValueError(f"checkpoint: {str(run)!r} holds no policy weights")
    try:
        target.load_state_dict(policy)
    except RuntimeError as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"checkpoint: the policy in {str(run)!r} does not fit its recorded model: {first}") from err
    # A dataset run's transformers tokenizer, or the built-in task's character tokenizer.
    return export_hf(model, out_dir, tokenizer=getattr(tokenizer, "hf", tokenizer))
