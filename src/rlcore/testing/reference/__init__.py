"""Loop-based reference implementations, written for clarity, not speed.

Each mirrors one rlcore function with plain Python loops and exact or float64
arithmetic, so differential tests compare the vectorised code with an obviously
correct one.
"""

from rlcore.testing.reference.advantages import (
    batch_normalize_ref,
    gae_ref,
    gdpo_advantages_ref,
    gpg_advantages_ref,
    grpo_advantages_ref,
    opo_advantages_ref,
    optimal_token_baseline_advantages_ref,
    passk_advantages_ref,
    reinforce_pp_advantages_ref,
    reinforce_pp_baseline_advantages_ref,
    remax_advantages_ref,
    rloo_advantages_ref,
)
from rlcore.testing.reference.attention import masked_attention_ref, packed_attention_ref
from rlcore.testing.reference.curriculum import curriculum_probs_ref, difficulty_bands_ref, pass_rate_update_ref
from rlcore.testing.reference.distillation import generalized_jsd_loss_ref, reverse_kl_distill_loss_ref
from rlcore.testing.reference.dock import TransferDockRef, balanced_partition_ref
from rlcore.testing.reference.filters import (
    dynamic_sampling_mask_ref,
    refill_groups_ref,
    rejection_mask_ref,
    truncated_is_weights_ref,
)
from rlcore.testing.reference.kl import (
    adaptive_entropy_coefs_ref,
    adaptive_kl_coefs_ref,
    kl_in_reward_ref,
    kl_penalty_ref,
)
from rlcore.testing.reference.logprobs import entropy_ref, linear_logprobs_ref, logprobs_ref, sum_pi_squared_ref
from rlcore.testing.reference.losses import (
    aggregate_ref,
    cispo_loss_ref,
    clip_cov_loss_ref,
    dppo_kl_loss_ref,
    dppo_tv_loss_ref,
    dro_loss_ref,
    gmpo_loss_ref,
    gspo_loss_ref,
    kl_cov_loss_ref,
    ppo_clip_loss_ref,
    reinforce_loss_ref,
    sapo_loss_ref,
    value_loss_ref,
)
from rlcore.testing.reference.metrics import merge_metrics_ref, pass_at_k_ref
from rlcore.testing.reference.off_policy import (
    behaviour_weights_ref,
    interpolated_prox_logp_ref,
    staleness_weights_ref,
)
from rlcore.testing.reference.ops import (
    discounted_cumsum_ref,
    masked_mean_ref,
    masked_sum_ref,
    masked_var_ref,
    masked_whiten_ref,
    masked_zero_ref,
    reverse_linear_scan_ref,
    segment_mean_ref,
    segment_std_ref,
    segment_sum_ref,
)
from rlcore.testing.reference.packing import (
    first_fit_decreasing_ref,
    min_bins_ref,
    pack_ref,
    shift_labels_ref,
    unpack_ref,
)
from rlcore.testing.reference.pipeline import flow_shop_makespan_ref, synchronous_loop_ref
from rlcore.testing.reference.preference import (
    cpo_loss_ref,
    dpo_loss_ref,
    dpo_step_ref,
    kto_loss_ref,
    orpo_loss_ref,
    pair_logps_ref,
    sequence_logps_ref,
    simpo_loss_ref,
)
from rlcore.testing.reference.replay import ReplayBufferRef
from rlcore.testing.reference.resharding import (
    local_shard_ref,
    swap_roundtrip_ref,
    transition_peak_ref,
    unshard_ref,
)
from rlcore.testing.reference.reward_model import bradley_terry_loss_ref, process_reward_loss_ref
from rlcore.testing.reference.rewards import length_reward_ref, weighted_ref
from rlcore.testing.reference.rollout import (
    filter_logits_ref,
    greedy_ref,
    partial_greedy_ref,
    response_logits_ref,
    response_logprobs_ref,
)
from rlcore.testing.reference.seeding import row_uniform_ref, sample_token_ref
from rlcore.testing.reference.shaping import (
    RunningNormalizerRef,
    clip_rewards_ref,
    overlong_penalty_ref,
    scores_to_token_rewards_ref,
)
from rlcore.testing.reference.supervised import sft_loss_ref
from rlcore.testing.reference.trainer_loop import LoopRun, train_loop_ref

__all__ = [
    "LoopRun",
    "ReplayBufferRef",
    "RunningNormalizerRef",
    "TransferDockRef",
    "adaptive_entropy_coefs_ref",
    "adaptive_kl_coefs_ref",
    "aggregate_ref",
    "balanced_partition_ref",
    "batch_normalize_ref",
    "behaviour_weights_ref",
    "bradley_terry_loss_ref",
    "cispo_loss_ref",
    "clip_cov_loss_ref",
    "clip_rewards_ref",
    "cpo_loss_ref",
    "curriculum_probs_ref",
    "difficulty_bands_ref",
    "discounted_cumsum_ref",
    "dpo_loss_ref",
    "dpo_step_ref",
    "dppo_kl_loss_ref",
    "dppo_tv_loss_ref",
    "dro_loss_ref",
    "dynamic_sampling_mask_ref",
    "entropy_ref",
    "filter_logits_ref",
    "first_fit_decreasing_ref",
    "flow_shop_makespan_ref",
    "gae_ref",
    "gdpo_advantages_ref",
    "generalized_jsd_loss_ref",
    "gmpo_loss_ref",
    "gpg_advantages_ref",
    "greedy_ref",
    "grpo_advantages_ref",
    "gspo_loss_ref",
    "interpolated_prox_logp_ref",
    "kl_cov_loss_ref",
    "kl_in_reward_ref",
    "kl_penalty_ref",
    "kto_loss_ref",
    "length_reward_ref",
    "linear_logprobs_ref",
    "local_shard_ref",
    "logprobs_ref",
    "masked_attention_ref",
    "masked_mean_ref",
    "masked_sum_ref",
    "masked_var_ref",
    "masked_whiten_ref",
    "masked_zero_ref",
    "merge_metrics_ref",
    "min_bins_ref",
    "opo_advantages_ref",
    "optimal_token_baseline_advantages_ref",
    "orpo_loss_ref",
    "overlong_penalty_ref",
    "pack_ref",
    "packed_attention_ref",
    "pair_logps_ref",
    "partial_greedy_ref",
    "pass_at_k_ref",
    "pass_rate_update_ref",
    "passk_advantages_ref",
    "ppo_clip_loss_ref",
    "process_reward_loss_ref",
    "refill_groups_ref",
    "reinforce_loss_ref",
    "reinforce_pp_advantages_ref",
    "reinforce_pp_baseline_advantages_ref",
    "rejection_mask_ref",
    "remax_advantages_ref",
    "response_logits_ref",
    "response_logprobs_ref",
    "reverse_kl_distill_loss_ref",
    "reverse_linear_scan_ref",
    "rloo_advantages_ref",
    "row_uniform_ref",
    "sample_token_ref",
    "sapo_loss_ref",
    "scores_to_token_rewards_ref",
    "segment_mean_ref",
    "segment_std_ref",
    "segment_sum_ref",
    "sequence_logps_ref",
    "sft_loss_ref",
    "shift_labels_ref",
    "simpo_loss_ref",
    "staleness_weights_ref",
    "sum_pi_squared_ref",
    "swap_roundtrip_ref",
    "synchronous_loop_ref",
    "train_loop_ref",
    "transition_peak_ref",
    "truncated_is_weights_ref",
    "unpack_ref",
    "unshard_ref",
    "value_loss_ref",
    "weighted_ref",
]
