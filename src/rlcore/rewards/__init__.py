"""Rewards: the ``(prompts, responses, **columns) -> tensor [B]`` protocol, rule rewards, composition, a process pool."""

from rlcore.rewards.base import BaseReward
from rlcore.rewards.compose import Weighted
from rlcore.rewards.llm_judge import DEFAULT_JUDGE_TEMPLATE, LLMJudge, parse_score
from rlcore.rewards.pool import RewardPool
from rlcore.rewards.protocol import Reward, RewardError, evaluate, reward_name
from rlcore.rewards.registry import (
    REWARDS,
    ConfiguredReward,
    build_reward,
    close_reward,
    register_reward,
    reward_log_values,
    reward_metrics,
    reward_weights,
)
from rlcore.rewards.reward_model import RewardModel, ranking_accuracy
from rlcore.rewards.rules import AnswerMatch, FormatMatch, LengthReward, extract_answer
from rlcore.rewards.verified_math import VerifiedMath, extract_final_answer

__all__ = [
    "DEFAULT_JUDGE_TEMPLATE",
    "REWARDS",
    "AnswerMatch",
    "BaseReward",
    "ConfiguredReward",
    "FormatMatch",
    "LLMJudge",
    "LengthReward",
    "Reward",
    "RewardError",
    "RewardModel",
    "RewardPool",
    "VerifiedMath",
    "Weighted",
    "build_reward",
    "close_reward",
    "evaluate",
    "extract_answer",
    "extract_final_answer",
    "parse_score",
    "ranking_accuracy",
    "register_reward",
    "reward_log_values",
    "reward_metrics",
    "reward_name",
    "reward_weights",
]
