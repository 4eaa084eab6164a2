"""A pass-rate curriculum: prompts drawn by difficulty band, the bands set by each prompt's running pass rate.

Each prompt of a set carries a running pass rate (the share of its samples whose score
reaches a threshold, smoothed over the steps it was drawn in: :func:`pass_rate_update`).
The rates cut the prompts into difficulty bands (:func:`difficulty_bands`: band 0 the
hardest, below the first edge); a step draws its prompts band by band in proportion to
the bands' weights, uniformly within a band (:func:`curriculum_probs`), so a prompt moves
between bands as its rate changes. Curricula of this kind: e.g. the online difficulty
filtering of Bae et al., "Online Difficulty Filtering for Reasoning Oriented Reinforcement
Learning", arXiv 2504.03380; Shi et al., "Efficient Reinforcement Finetuning via Adaptive
Curriculum Learning" (AdaRFT), arXiv 2504.05520. The maths is sync-free; the draw itself
(:func:`curriculum_draw`) is host-side data loading.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from rlcore._checks import check_floating, check_integer, check_ndim, check_same_shape

__all__ = [
    "CurriculumConfig",
    "curriculum_draw",
    "curriculum_probs",
    "difficulty_bands",
    "parse_curriculum",
    "pass_rate_update",
]


class CurriculumConfig(NamedTuple):
    """``data.curriculum``.

    Fields:
      edges: increasing pass rates in (0, 1) cutting the bands (band ``i``: ``edges[i-1] <= rate < edges[i]``).
      weights: one sampling weight (>= 0, not all 0) per band, hardest first (``len(edges) + 1``).
      decay: the running rate's memory: ``rate <- decay * rate + (1 - decay) * step's pass rate``.
      initial: the rate of a prompt never drawn.
      threshold: a sample passes when its score is at least this.
    """

    edges: tuple[float, ...] = (0.2, 0.8)
    weights: tuple[float, ...] = (0.25, 0.5, 0.25)
    decay: float = 0.5
    initial: float = 0.5
    threshold: float = 0.5


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_curriculum(raw: Mapping[str, Any], *, key: str = "data.curriculum") -> CurriculumConfig:
    """Validate the ``data.curriculum`` mapping; ``ValueError`` naming the key otherwise.

    >>> parse_curriculum({"edges": [0.5], "weights": [1, 3]}).weights
    (1.0, 3.0)
    >>> parse_curriculum({"edges": [0.5], "weights": [1]})
    Traceback (most recent call last):
    ...
    ValueError: config key 'data.curriculum.weights': got [1], expected 2 weights >= 0, not all 0 (one per band)
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"config key {key!r}: got {type(raw).__name__}, expected a mapping of keys")
    for name in raw:
        if name not in CurriculumConfig._fields:
            raise ValueError(
                f"config key '{key}.{name}': unknown, expected one of {', '.join(CurriculumConfig._fields)}"
            )
    cfg = CurriculumConfig()._replace(**raw)
    edges = cfg.edges
    if (
        not isinstance(edges, Sequence)
        or not all(_number(e) and 0 < e < 1 for e in edges)
        or any(a >= b for a, b in zip(edges, edges[1:]))
    ):
        raise ValueError(f"config key '{key}.edges': got {edges!r}, expected increasing pass rates in (0, 1)")
    weights = cfg.weights
    if (
        not isinstance(weights, Sequence)
        or len(weights) != len(edges) + 1
        or not all(_number(w) and w >= 0 for w in weights)
        or not any(w > 0 for w in weights)
    ):
        raise ValueError(
            f"config key '{key}.weights': got {weights!r}, expected {len(edges) + 1} weights >= 0, not all 0 "
            "(one per band)"
        )
    for name, low, high in (("decay", 0.0, 1.0), ("initial", 0.0, 1.0)):
        value = getattr(cfg, name)
        if not _number(value) or not low <= value <= high:
            raise ValueError(f"config key '{key}.{name}': got {value!r}, expected a number in [{low}, {high}]")
    if not _number(cfg.threshold):
        raise ValueError(f"config key '{key}.threshold': got {cfg.threshold!r}, expected a finite number")
    return CurriculumConfig(
        tuple(float(e) for e in edges),
        tuple(float(w) for w in weights),
        float(cfg.decay),
        float(cfg.initial),
        float(cfg.threshold),
    )


def pass_rate_update(
    rates: torch.Tensor, index: torch.Tensor, scores: torch.Tensor, *, decay: float = 0.5, threshold: float = 0.5
) -> torch.Tensor:
    """The prompts' running pass rates after one step's samples.

    Formula, for each prompt ``p`` drawn in the step with samples ``S_p``::

        rate_p <- decay * rate_p + (1 - decay) * |{i in S_p : score_i >= threshold}| / |S_p|

    A prompt not drawn keeps its rate; a non-finite score counts as a fail.

    Args:
      rates: ``[P]`` float running rates of the prompt set.
      index: ``[N]`` integer prompt of each sample (in ``[0, P)``).
      scores: ``[N]`` sample scores.
      decay: memory in ``[0, 1]`` (0: the last step's rate).
      threshold: a sample passes when its score is at least this.

    Returns:
      ``[P]`` rates in ``rates.dtype``.

    >>> pass_rate_update(torch.tensor([0.5, 0.5]), torch.tensor([1, 1]), torch.tensor([1.0, 0.0]), decay=0.0)
    tensor([0.5000, 0.5000])
    >>> pass_rate_update(torch.tensor([0.5, 0.5]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
    tensor([0.7500, 0.5000])
    """
    check_ndim("rates", rates, 1)
    check_floating("rates", rates)
    check_ndim("index", index, 1)
    check_integer("index", index)
    check_floating("scores", scores)
    check_same_shape("scores", scores, "index", index)
    if not 0 <= decay <= 1:
        raise ValueError(f"decay: got {decay!r}, expected a number in [0, 1]")
    n = rates.shape[0]
    idx = index.long()
    passed = (torch.isfinite(scores) & (scores >= threshold)).to(torch.float64)
    hits = torch.zeros(n, dtype=torch.float64, device=rates.device).index_add(0, idx, passed)
    seen = torch.zeros(n, dtype=torch.float64, device=rates.device).index_add(0, idx, torch.ones_like(passed))
    step_rate = hits / seen.clamp(min=1)
    new = decay * rates.double() + (1 - decay) * step_rate
    return torch.where(seen > 0, new, rates.double()).to(rates.dtype)


def difficulty_bands(rates: torch.Tensor, edges: Sequence[float]) -> torch.Tensor:
    """Each prompt's band: ``i`` with ``edges[i-1] <= rate < edges[i]`` (0: the hardest, ``len(edges)``: the easiest).

    >>> difficulty_bands(torch.tensor([0.0, 0.2, 0.5, 0.9]), [0.2, 0.8])
    tensor([0, 1, 1, 2])
    """
    check_ndim("rates", rates, 1)
    check_floating("rates", rates)
    bounds = torch.tensor(list(edges), dtype=rates.dtype, device=rates.device)
    return torch.bucketize(rates, bounds, right=True)


def curriculum_probs(bands: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """The probability of drawing each prompt: its band's weight share, split evenly within the band.

    Formula, with ``n_b`` prompts in band ``b`` and weights renormalised over the bands
    that hold a prompt::

        p_i = (w_{b(i)} / sum_{b : n_b > 0} w_b) / n_{b(i)}

    If no band with a positive weight holds a prompt, every prompt is equally likely.

    Args:
      bands: ``[P]`` integer band of each prompt (:func:`difficulty_bands`).
      weights: one weight per band.

    Returns:
      ``[P]`` float64 probabilities summing to 1.

    >>> curriculum_probs(torch.tensor([0, 1, 1, 1]), [1.0, 3.0])
    tensor([0.2500, 0.2500, 0.2500, 0.2500], dtype=torch.float64)
    >>> curriculum_probs(torch.tensor([2, 2, 0]), [1.0, 5.0, 1.0])
    tensor([0.2500, 0.2500, 0.5000], dtype=torch.float64)
    """
    check_ndim("bands", bands, 1)
    check_integer("bands", bands)
    w = torch.tensor(list(weights), dtype=torch.float64, device=bands.device)
    idx = bands.long()
    sizes = torch.zeros_like(w).index_add(0, idx, torch.ones(idx.shape[0], dtype=torch.float64, device=idx.device))
    live = torch.where(sizes > 0, w, 0.0)
    total = live.sum()
    share = live / torch.where(total > 0, total, torch.ones_like(total))
    per_prompt = share[idx] / sizes[idx].clamp(min=1)
    uniform = torch.full_like(per_prompt, 1.0 / max(idx.shape[0], 1))
    return torch.where(total > 0, per_prompt, uniform)


def curriculum_draw(probs: torch.Tensor, count: int, generator: torch.Generator) -> list[int]:
    """``count`` prompts drawn by ``probs``, distinct while the prompts with a positive probability last.

    Beyond them (``count`` larger than their number) each further pass draws them again,
    so a step never repeats a prompt it need not.

    Args:
      probs: ``[P]`` probabilities (:func:`curriculum_probs`).
      count: prompts to draw (>= 0).
      generator: the step's random stream.

    Returns:
      ``count`` prompt indices.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count: got {count!r}, expected an int >= 0")
    live = int((probs > 0).sum())  # sync-ok: host-side data loading
    out: list[int] = []
    while len(out) < count:
        take = min(count - len(out), live)
        out += torch.multinomial(probs.float(), take, replacement=False, generator=generator).tolist()
    return out
