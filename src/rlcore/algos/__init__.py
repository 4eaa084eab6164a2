"""RL algorithm maths: advantage estimators, policy/value/KL/preference losses, aggregation, recipes.

Pure functions over tensors and pytree batches: no modules, no process groups held,
no host syncs.
"""

from rlcore.algos.advantages import (
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
from rlcore.algos.filters import dynamic_sampling_indices, dynamic_sampling_mask, rejection_mask, truncated_is_weights
from rlcore.algos.aggregate import AGGREGATION_MODES, aggregate, global_counts
from rlcore.algos.policy_losses import (
    cispo_loss,
    gmpo_loss,
    gpg_loss,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
    sapo_loss,
)
from rlcore.algos.value_loss import value_loss
from rlcore.algos.kto import kto_loss
from rlcore.algos.preference import sequence_logps
from rlcore.algos.preference_pairwise import DIVERGENCES, DPO_LOSS_TYPES, dpo_loss
from rlcore.algos.preference_reffree import cpo_loss, orpo_loss, simpo_loss
from rlcore.algos.kl import (
    KL_ESTIMATORS,
    KLController,
    KLControllerState,
    adaptive_kl_controller,
    fixed_kl_controller,
    kl_in_reward,
    kl_penalty,
)
from rlcore.algos.shaping import (
    RewardNormalizer,
    RunningMomentsState,
    clip_rewards,
    overlong_penalty,
    running_reward_normalizer,
    scores_to_token_rewards,
)

__all__: list[str] = [
    "KL_ESTIMATORS",
    "KLController",
    "KLControllerState",
    "RewardNormalizer",
    "RunningMomentsState",
    "adaptive_kl_controller",
    "clip_rewards",
    "fixed_kl_controller",
    "kl_in_reward",
    "kl_penalty",
    "overlong_penalty",
    "running_reward_normalizer",
    "scores_to_token_rewards",
    "AGGREGATION_MODES",
    "aggregate",
    "cispo_loss",
    "global_counts",
    "gmpo_loss",
    "gpg_loss",
    "gspo_loss",
    "ppo_clip_loss",
    "reinforce_loss",
    "sapo_loss",
    "value_loss",
    "batch_normalize",
    "dynamic_sampling_indices",
    "dynamic_sampling_mask",
    "gae",
    "gpg_advantages",
    "grpo_advantages",
    "opo_advantages",
    "passk_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rejection_mask",
    "remax_advantages",
    "rloo_advantages",
    "truncated_is_weights",
    "DIVERGENCES",
    "DPO_LOSS_TYPES",
    "cpo_loss",
    "dpo_loss",
    "kto_loss",
    "orpo_loss",
    "sequence_logps",
    "simpo_loss",
]
