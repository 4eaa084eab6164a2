"""The reference trainer: config, rollout, tasks, the training loop, checkpoints, metrics and the CLI.

Read :mod:`rlcore.train.trainer` as the worked example of assembling your own loop
from rlcore's primitives.
"""

from rlcore.train.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from rlcore.train.config import ALGOS, Config, apply_overrides, check_launch, load_config, parse_config
from rlcore.train.metrics import MetricsLog, plot_curves, read_metrics
from rlcore.train.parallel import (
    MESH_DIMS,
    check_parallel_sizes,
    clip_grad_norm,
    device_mesh,
    full_state_dict,
    parallelize,
)
from rlcore.train.rollout import InferenceEngine, Rollout, TorchEngine, filter_logits, generate, left_pad
from rlcore.train.tasks import TASKS, Addition, CharTokenizer, Reversal, make_task
from rlcore.train.trainer import Run, build_algorithm, build_model, train

__all__ = [
    "ALGOS",
    "CHECKPOINT_NAME",
    "MESH_DIMS",
    "TASKS",
    "Addition",
    "CharTokenizer",
    "CheckpointError",
    "Config",
    "InferenceEngine",
    "MetricsLog",
    "Reversal",
    "Rollout",
    "Run",
    "TorchEngine",
    "apply_overrides",
    "build_algorithm",
    "build_model",
    "check_launch",
    "check_parallel_sizes",
    "clip_grad_norm",
    "device_mesh",
    "filter_logits",
    "full_state_dict",
    "generate",
    "left_pad",
    "load_checkpoint",
    "load_config",
    "make_task",
    "parallelize",
    "parse_config",
    "plot_curves",
    "read_metrics",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "train",
]
