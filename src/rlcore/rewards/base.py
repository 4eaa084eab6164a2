"""``BaseReward``: the base class of MindSpeed-RL-style reward classes, so a seed-style reward file runs unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlcore.rewards.protocol import evaluate

__all__ = ["BaseReward"]


class BaseReward:
    """Subclass and define ``forward(self, prompts, responses, **kwargs)`` returning one value per response.

    Values may be numbers or booleans (``True`` is 1.0); ``kwargs`` holds the dataset's
    keyword columns (``answers`` and the rest). Calling the object returns the scores
    as a float32 tensor ``[B]`` through :func:`rlcore.rewards.evaluate`.

    >>> class QualityReward(BaseReward):  # the seed's section 4.3, unchanged
    ...     def __init__(self):
    ...         super().__init__()
    ...     def forward(self, prompts, responses, **kwargs):
    ...         reward = [len(r) > 100 for r in responses]
    ...         return reward
    >>> QualityReward()(["q", "q"], ["x" * 101, "short"])
    tensor([1., 0.])
    """

    def forward(self, prompts: Sequence[str], responses: Sequence[str], **kwargs: Any) -> Any:
        """One score per response: a list of numbers or booleans, or a tensor ``[B]``."""
        raise NotImplementedError(f"{type(self).__name__}.forward(prompts, responses, **kwargs) is not defined")

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **kwargs: Any) -> torch.Tensor:
        return evaluate(self, prompts, responses, **kwargs)
