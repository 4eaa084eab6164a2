"""The reference trainer: config, rollout, tasks, the training loop, checkpoints, metrics and the CLI.

Read :mod:`rlcore.train.trainer` as the worked example of assembling your own loop
from rlcore's primitives.
"""

from rlcore.train.agent_stages import (
    ROLLOUT_COLUMNS,
    ROLLOUT_INPUTS,
    MultiTurnRollout,
    check_multi_turn,
    multi_turn_graph,
    multi_turn_rollout_stage,
)
from rlcore.train.build import build_algorithm, build_model
from rlcore.train.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    PendingSave,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    save_checkpoint_async,
    set_rng_state,
)
from rlcore.train.columns import COLUMNS
from rlcore.train.config import ALGOS, Config, apply_overrides, check_launch, load_config, max_positions, parse_config
from rlcore.train.context_parallel import (
    ContextParallelRecipe,
    DataParallelRecipe,
    check_context_parallel_model,
    cp_logprob_stage,
    cp_response_logprobs,
    cp_rl_forward,
    replica_groups,
    replicate_stage,
)
from rlcore.train.curriculum import CurriculumPrompts
from rlcore.train.deploy import (
    ColocatedDeployment,
    Deployment,
    NoRollout,
    PendingVersions,
    RayDeployment,
    ReplicaDeployment,
    RolloutServer,
    SnapshotDeployment,
    VLLMDeployment,
    WorkerDeployment,
    in_place_rollout,
    make_deployment,
)
from rlcore.train.export_cli import export_checkpoint
from rlcore.train.lora import LORA_KEYS, adapter_modules, attach_lora, check_lora_launch, lora_options
from rlcore.train.metrics import MetricsLog, headline, plot_curves, plot_timeline, read_metrics
from rlcore.train.parallel import (
    MESH_DIMS,
    check_parallel_sizes,
    clip_grad_norm,
    device_mesh,
    full_state_dict,
    parallelize,
    shard_mesh,
)
from rlcore.train.preemption import EXIT_PREEMPTED, STOP_SIGNALS, Preempted, StopRequest, stop_on_signals
from rlcore.train.prompts import (
    PROMPT_COLUMNS,
    DatasetPrompts,
    HFTokenizer,
    PreferencePrompts,
    SupervisedPrompts,
    TaskPrompts,
    make_prompt_source,
    source_tokenizer,
    task_options,
    task_validation_set,
)
from rlcore.train.recipe_stages import (
    PolicyGradientStages,
    PreferenceStages,
    RecipeGraph,
    RecipeStages,
    RewardModelStages,
    StepParts,
    SupervisedStages,
    stages_for,
)
from rlcore.train.refill import RefillPrompts, refill_stage
from rlcore.train.replay import Replay, ReplayBuffer, ReplayConfig, parse_replay
from rlcore.train.rollout import InferenceEngine, Rollout, TorchEngine, filter_logits, generate, left_pad
from rlcore.train.rundir import (
    FREE_KEYS,
    RUN_FILES,
    check_resume_config,
    check_resume_shapes,
    check_resume_steps,
    config_changes,
    inexact_resume,
    prepare_run_dir,
)
from rlcore.train.scoring import ScoringPlan, scoring_plan
from rlcore.train.stages import (
    PAIR_TOKEN_COLUMNS,
    advantages_stage,
    balanced_rows,
    eval_mode,
    forward_ahead,
    logprob_stage,
    old_policy_interpolated,
    old_policy_is_updated,
    pairs_stage,
    preference_forward,
    preference_logps_stage,
    response_logprobs,
    response_sequences,
    response_values,
    reward_columns,
    reward_outputs,
    reward_stage,
    rl_batch,
    rl_forward,
    rl_outputs,
    rollout_stage,
    staleness_weighted,
    update_forward,
    update_stage,
    values_stage,
    with_logged_reference,
)
from rlcore.train.supervised_stages import SFT_COLUMNS, last_token_rewards, reward_pair_forward, sft_forward
from rlcore.train.tasks import TASKS, Addition, CharTokenizer, Reversal, make_task
from rlcore.train.trainer import Run, train
from rlcore.train.validation import Validator, validation_keys
from rlcore.train.vllm_engine import (
    VLLMEngine,
    VLLMOptions,
    import_vllm,
    parse_vllm_options,
    require_vllm,
    sleep_mode_available,
)
from rlcore.train.warmup import supervised_warmup

__all__ = [
    "ALGOS",
    "CHECKPOINT_NAME",
    "COLUMNS",
    "MESH_DIMS",
    "PAIR_TOKEN_COLUMNS",
    "ROLLOUT_COLUMNS",
    "ROLLOUT_INPUTS",
    "SFT_COLUMNS",
    "TASKS",
    "Addition",
    "CharTokenizer",
    "CheckpointError",
    "Config",
    "InferenceEngine",
    "MetricsLog",
    "MultiTurnRollout",
    "Reversal",
    "RewardModelStages",
    "Rollout",
    "Run",
    "ScoringPlan",
    "SupervisedPrompts",
    "SupervisedStages",
    "TorchEngine",
    "VLLMDeployment",
    "VLLMEngine",
    "VLLMOptions",
    "advantages_stage",
    "apply_overrides",
    "balanced_rows",
    "build_algorithm",
    "build_model",
    "check_launch",
    "check_multi_turn",
    "check_parallel_sizes",
    "clip_grad_norm",
    "device_mesh",
    "eval_mode",
    "filter_logits",
    "forward_ahead",
    "full_state_dict",
    "generate",
    "headline",
    "import_vllm",
    "last_token_rewards",
    "left_pad",
    "load_checkpoint",
    "load_config",
    "logprob_stage",
    "make_task",
    "max_positions",
    "multi_turn_graph",
    "multi_turn_rollout_stage",
    "old_policy_interpolated",
    "old_policy_is_updated",
    "pairs_stage",
    "parallelize",
    "parse_config",
    "parse_vllm_options",
    "plot_curves",
    "plot_timeline",
    "preference_forward",
    "preference_logps_stage",
    "read_metrics",
    "require_vllm",
    "response_logprobs",
    "response_sequences",
    "response_values",
    "reward_columns",
    "reward_outputs",
    "reward_pair_forward",
    "reward_stage",
    "rl_batch",
    "rl_forward",
    "rl_outputs",
    "rng_state",
    "rollout_stage",
    "save_checkpoint",
    "scoring_plan",
    "set_rng_state",
    "sft_forward",
    "sleep_mode_available",
    "staleness_weighted",
    "supervised_warmup",
    "train",
    "update_forward",
    "update_stage",
    "values_stage",
    "with_logged_reference",
]
# Your own model and data: prompt sources, validation, run directories, export.
__all__ += [
    "FREE_KEYS",
    "PROMPT_COLUMNS",
    "RUN_FILES",
    "DatasetPrompts",
    "HFTokenizer",
    "PreferencePrompts",
    "TaskPrompts",
    "Validator",
    "check_resume_config",
    "check_resume_shapes",
    "check_resume_steps",
    "config_changes",
    "export_checkpoint",
    "inexact_resume",
    "make_prompt_source",
    "prepare_run_dir",
    "source_tokenizer",
    "task_options",
    "task_validation_set",
    "validation_keys",
]
# The stages each kind of recipe adds to the step, found by the recipe's type.
__all__ += ["PolicyGradientStages", "PreferenceStages", "RecipeGraph", "RecipeStages", "StepParts", "stages_for"]
# Context parallelism: sequences split over the "cp" ranks of the mesh.
__all__ += [
    "ContextParallelRecipe",
    "DataParallelRecipe",
    "check_context_parallel_model",
    "cp_logprob_stage",
    "cp_response_logprobs",
    "cp_rl_forward",
    "replica_groups",
    "replicate_stage",
    "shard_mesh",
]
# Where the rollout runs and how weights reach it: one class per deployment mode.
__all__ += [
    "ColocatedDeployment",
    "Deployment",
    "NoRollout",
    "PendingVersions",
    "RayDeployment",
    "ReplicaDeployment",
    "RolloutServer",
    "SnapshotDeployment",
    "WorkerDeployment",
    "in_place_rollout",
    "make_deployment",
]
# LoRA in the trainer.
__all__ += ["LORA_KEYS", "adapter_modules", "attach_lora", "check_lora_launch", "lora_options"]
# Stopping on a signal at a step boundary (preemption), and resuming.
__all__ += ["EXIT_PREEMPTED", "STOP_SIGNALS", "Preempted", "StopRequest", "save_checkpoint_async", "stop_on_signals"]
__all__ += [
    "CurriculumPrompts",
    "RefillPrompts",
    "Replay",
    "ReplayBuffer",
    "ReplayConfig",
    "parse_replay",
    "refill_stage",
]
# Background saves whose copy of the state is taken while the next step starts.
__all__ += ["PendingSave"]
