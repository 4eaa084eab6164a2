"""Prompt and preference datasets: local JSONL / Parquet / saved datasets with chat templates, and a seeded, resumable order.

``datasets`` is needed only by :func:`load_prompts` / :func:`load_preferences` / :func:`read_table` and is imported on first use.
"""

from rlcore.data.curriculum import (
    CurriculumConfig,
    curriculum_draw,
    curriculum_probs,
    difficulty_bands,
    parse_curriculum,
    pass_rate_update,
)
from rlcore.data.preferences import PreferenceSet, load_preferences
from rlcore.data.prompts import OVERLONG, RESERVED_COLUMNS, PromptSet, load_prompts, read_table
from rlcore.data.sampling import PromptDraw, epoch_permutation, sample_indices
from rlcore.data.supervised import SupervisedSet, load_supervised

__all__ = [
    "OVERLONG",
    "RESERVED_COLUMNS",
    "CurriculumConfig",
    "PreferenceSet",
    "PromptDraw",
    "PromptSet",
    "SupervisedSet",
    "curriculum_draw",
    "curriculum_probs",
    "difficulty_bands",
    "epoch_permutation",
    "load_preferences",
    "load_prompts",
    "load_supervised",
    "parse_curriculum",
    "pass_rate_update",
    "read_table",
    "sample_indices",
]
