"""Named RL algorithms as compositions of rlcore's pure functions.

An :class:`Algorithm` is a NamedTuple of the functions it is made of; the recipes
(:func:`ppo`, :func:`grpo`, :func:`dr_grpo`, :func:`dapo`, :func:`gspo`,
:func:`reinforce_pp`, :func:`rloo`) fill it with the published defaults, and
``algo._replace(policy_loss=...)`` makes a new algorithm from an old one.
"""

from rlcore.algos.recipes.adapters import (
    dynamic_sampling_filter,
    gae_advantages,
    kl_reward_shaping,
    kl_score_shaping,
    outcome_advantages,
    overlong_shaping,
    token_advantages,
    token_rewards_shaping,
)
from rlcore.algos.recipes.algorithm import Algorithm, chain
from rlcore.algos.recipes.named import dapo, dr_grpo, grpo, gspo, ppo, reinforce_pp, rloo
from rlcore.algos.recipes.needs import ScoringNeeds, scoring_needs

__all__ = [
    "Algorithm",
    "ScoringNeeds",
    "chain",
    "dapo",
    "dr_grpo",
    "dynamic_sampling_filter",
    "gae_advantages",
    "grpo",
    "gspo",
    "kl_reward_shaping",
    "kl_score_shaping",
    "outcome_advantages",
    "overlong_shaping",
    "ppo",
    "reinforce_pp",
    "rloo",
    "scoring_needs",
    "token_advantages",
    "token_rewards_shaping",
]
