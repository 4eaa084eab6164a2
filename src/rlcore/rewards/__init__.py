"""Rewards: the ``(prompts, responses, **columns) -> tensor [B]`` protocol, rule rewards, composition, a process pool."""

from rlcore.rewards.compose import Weighted
from rlcore.rewards.pool import RewardPool
from rlcore.rewards.protocol import Reward, RewardError, evaluate, reward_name
from rlcore.rewards.rules import AnswerMatch, FormatMatch, LengthReward, extract_answer

__all__ = [
    "AnswerMatch",
    "FormatMatch",
    "LengthReward",
    "Reward",
    "RewardError",
    "RewardPool",
    "Weighted",
    "evaluate",
    "extract_answer",
    "reward_name",
]
