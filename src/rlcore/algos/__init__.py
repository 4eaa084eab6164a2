"""RL algorithm maths: advantage estimators, policy/value/KL/preference losses, aggregation, recipes.

Pure functions over tensors and pytree batches: no modules, no process groups held,
no host syncs.
"""

from rlcore.algos.advantages import (
    batch_moments,
    batch_normalize,
    gae,
    gpg_advantages,
    grpo_advantages,
    opo_advantages,
    passk_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from rlcore.algos.aggregate import AGGREGATION_MODES, aggregate, global_counts
from rlcore.algos.collectives import group_sum, resolve_process_group
from rlcore.algos.dpo_recipe import DPO, PAIR_COLUMNS, dpo
from rlcore.algos.evaluation import pass_at_k
from rlcore.algos.filters import dynamic_sampling_indices, dynamic_sampling_mask, rejection_mask, truncated_is_weights
from rlcore.algos.kl import (
    KL_ESTIMATORS,
    KLController,
    KLControllerState,
    adaptive_kl_controller,
    fixed_kl_controller,
    kl_in_reward,
    kl_penalty,
)
from rlcore.algos.kto import kto_loss
from rlcore.algos.metric_reduction import METRIC_REDUCTIONS, RL_METRIC_REDUCTIONS, reduce_metrics
from rlcore.algos.policy_losses import (
    cispo_loss,
    gmpo_loss,
    gpg_loss,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
    sapo_loss,
)
from rlcore.algos.preference import sequence_logps
from rlcore.algos.preference_pairwise import DIVERGENCES, DPO_LOSS_TYPES, dpo_loss
from rlcore.algos.preference_reffree import cpo_loss, orpo_loss, simpo_loss
from rlcore.algos.recipes import (
    Algorithm,
    chain,
    dapo,
    dr_grpo,
    dynamic_sampling_filter,
    gae_advantages,
    grpo,
    gspo,
    kl_reward_shaping,
    kl_score_shaping,
    outcome_advantages,
    overlong_shaping,
    ppo,
    reinforce_pp,
    rloo,
    token_advantages,
    token_rewards_shaping,
)
from rlcore.algos.shaping import (
    RewardNormalizer,
    RunningMomentsState,
    clip_rewards,
    overlong_penalty,
    running_reward_normalizer,
    scores_to_token_rewards,
)
from rlcore.algos.sharded_aggregate import sequence_sharded_aggregate, sequence_sharded_counts
from rlcore.algos.value_loss import value_loss

__all__: list[str] = [
    "AGGREGATION_MODES",
    "DIVERGENCES",
    "DPO",
    "DPO_LOSS_TYPES",
    "KL_ESTIMATORS",
    "METRIC_REDUCTIONS",
    "PAIR_COLUMNS",
    "RL_METRIC_REDUCTIONS",
    "Algorithm",
    "KLController",
    "KLControllerState",
    "RewardNormalizer",
    "RunningMomentsState",
    "adaptive_kl_controller",
    "aggregate",
    "batch_moments",
    "batch_normalize",
    "chain",
    "cispo_loss",
    "clip_rewards",
    "cpo_loss",
    "dapo",
    "dpo",
    "dpo_loss",
    "dr_grpo",
    "dynamic_sampling_filter",
    "dynamic_sampling_indices",
    "dynamic_sampling_mask",
    "fixed_kl_controller",
    "gae",
    "gae_advantages",
    "global_counts",
    "gmpo_loss",
    "gpg_advantages",
    "gpg_loss",
    "group_sum",
    "grpo",
    "grpo_advantages",
    "gspo",
    "gspo_loss",
    "kl_in_reward",
    "kl_penalty",
    "kl_reward_shaping",
    "kl_score_shaping",
    "kto_loss",
    "opo_advantages",
    "orpo_loss",
    "outcome_advantages",
    "overlong_penalty",
    "overlong_shaping",
    "pass_at_k",
    "passk_advantages",
    "ppo",
    "ppo_clip_loss",
    "reduce_metrics",
    "reinforce_loss",
    "reinforce_pp",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rejection_mask",
    "remax_advantages",
    "resolve_process_group",
    "rloo",
    "rloo_advantages",
    "running_reward_normalizer",
    "sapo_loss",
    "scores_to_token_rewards",
    "sequence_logps",
    "sequence_sharded_aggregate",
    "sequence_sharded_counts",
    "simpo_loss",
    "token_advantages",
    "token_rewards_shaping",
    "truncated_is_weights",
    "value_loss",
]
