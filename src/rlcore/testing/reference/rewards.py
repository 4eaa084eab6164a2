"""Loop references for the rule rewards and their weighted composition."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["length_reward_ref", "weighted_ref"]


def length_reward_ref(
    responses: Sequence[str], *, min_length: int = 0, max_length: int | None = None, slack: int = 0
) -> list[float]:
    """Score each response's character count against the window, one at a time."""
    out: list[float] = []
    for r in responses:
        n = len(r)
        if n < min_length:
            d = min_length - n
        elif max_length is not None and n > max_length:
            d = n - max_length
        else:
            d = 0
        if d == 0:
            out.append(1.0)
        elif slack == 0:
            out.append(0.0)
        else:
            out.append(max(0.0, 1.0 - d / slack))
    return out


def weighted_ref(component_scores: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """``sum_k w_k s_k[i]`` for each sample ``i``, as nested loops over plain lists."""
    n = len(component_scores[0])
    return [sum(w * s[i] for w, s in zip(weights, component_scores)) for i in range(n)]
