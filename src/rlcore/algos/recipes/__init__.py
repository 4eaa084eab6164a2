"""Recipes: named RL algorithms and preference recipes as compositions of rlcore's pure functions.

An :class:`Algorithm` is a NamedTuple of the functions it is made of; the recipes
(:func:`ppo`, :func:`grpo`, :func:`dr_grpo`, :func:`dapo`, :func:`gspo`, :func:`gdpo`,
:func:`reinforce_pp`, :func:`rloo`, :func:`on_policy_distillation`) fill it with the
published defaults, and ``algo._replace(policy_loss=...)`` makes a new algorithm from
an old one. :class:`DPO`
(:func:`dpo`) is the preference recipe of the same shape; both are a :class:`Recipe`.
"""

from rlcore.algos.recipes.adapters import (
    dynamic_sampling_filter,
    gae_advantages,
    kl_reward_shaping,
    kl_score_shaping,
    outcome_advantages,
    overlong_shaping,
    score_scaling,
    token_advantages,
    token_baseline_advantages,
    token_rewards_shaping,
)
from rlcore.algos.recipes.algorithm import Algorithm, chain
from rlcore.algos.recipes.named import (
    dapo,
    dr_grpo,
    gdpo,
    grpo,
    gspo,
    on_policy_distillation,
    ppo,
    reinforce_pp,
    rloo,
)
from rlcore.algos.recipes.needs import ScoringNeeds, scoring_needs
from rlcore.algos.recipes.preference import DPO, PAIR_LOGP_COLUMNS, dpo
from rlcore.algos.recipes.protocol import Recipe
from rlcore.algos.recipes.supervised import RM, SFT, SFT_LOSS_MODES, rm, sft

__all__ = [
    "DPO",
    "PAIR_LOGP_COLUMNS",
    "RM",
    "SFT",
    "SFT_LOSS_MODES",
    "Algorithm",
    "Recipe",
    "ScoringNeeds",
    "chain",
    "dapo",
    "dpo",
    "dr_grpo",
    "dynamic_sampling_filter",
    "gae_advantages",
    "gdpo",
    "grpo",
    "gspo",
    "kl_reward_shaping",
    "kl_score_shaping",
    "on_policy_distillation",
    "outcome_advantages",
    "overlong_shaping",
    "ppo",
    "reinforce_pp",
    "rloo",
    "rm",
    "score_scaling",
    "scoring_needs",
    "sft",
    "token_advantages",
    "token_baseline_advantages",
    "token_rewards_shaping",
]
