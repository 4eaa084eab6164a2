"""Hypothesis strategies for pipeline scheduling: random stage graphs, timings and their stage functions.

:func:`pipeline_specs` draws a plain description (a DAG of up to 7 stages rooted at a
rollout stage and ending in an update stage, micro-batch sizes, resources, per-call
delays, table shape, iterations, staleness); :func:`spec_stages` turns one into fresh
stages whose outputs are a deterministic function of their inputs (the update stage's
also of the order it sees rows in), so runs can be compared with
:func:`rlcore.testing.reference.synchronous_loop_ref`.

>>> from hypothesis import given
>>> @given(pipeline_specs(max_stages=3))
... def check(spec):
...     assert len(spec_stages(spec)) == len(spec["stages"])
>>> check()
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
from hypothesis import strategies as st

from rlcore.dataflow.stages import Stage, stage

__all__ = ["pipeline_specs", "spec_stages", "stage_costs"]


@st.composite
def pipeline_specs(
    draw: st.DrawFn,
    *,
    max_stages: int = 7,
    max_prompts: int = 4,
    max_samples: int = 2,
    max_iterations: int = 3,
    max_staleness: int = 2,
    resources: tuple[str, ...] = ("gen", "train", "cpu"),
    max_delay: float = 0.002,
) -> dict[str, Any]:
    """A random pipeline: keys ``num_prompts``, ``n_samples``, ``num_iterations``, ``staleness``, ``stages``.

    Each entry of ``stages`` has ``name`` (``s0`` ...), ``inputs`` (``prompts`` or
    earlier stages' ``c<i>`` columns), ``output`` (``c<i>``), ``role``, ``micro_batch``,
    ``by_group``, ``resource`` and ``delays`` (seconds, cycled over calls).
    """
    num_prompts = draw(st.integers(1, max_prompts))
    n_samples = draw(st.integers(1, max_samples))
    capacity = num_prompts * n_samples
    count = draw(st.integers(2, max_stages))
    stages = []
    for i in range(count):
        if i == 0:
            inputs = ["prompts"]
        else:
            ups = draw(st.lists(st.integers(0, i - 1), min_size=1, max_size=3, unique=True))
            inputs = [f"c{u}" for u in sorted(ups)] + (["prompts"] if draw(st.booleans()) else [])
        by_group = draw(st.booleans())
        micro_batch = draw(st.one_of(st.none(), st.integers(1, capacity)))
        if by_group and micro_batch is not None:
            micro_batch = max(1, micro_batch // n_samples) * n_samples
        stages.append(
            {
                "name": f"s{i}",
                "inputs": inputs,
                "output": f"c{i}",
                "role": "rollout" if i == 0 else "update" if i == count - 1 else "compute",
                "micro_batch": micro_batch,
                "by_group": by_group,
                "resource": draw(st.sampled_from(resources)),
                "delays": draw(st.lists(st.floats(0.0, max_delay), min_size=1, max_size=4)),
            }
        )
    return {
        "num_prompts": num_prompts,
        "n_samples": n_samples,
        "num_iterations": draw(st.integers(1, max_iterations)),
        "staleness": draw(st.integers(0, max_staleness)),
        "stages": stages,
    }


def _row_sum(batch: dict[str, torch.Tensor], column: str) -> torch.Tensor:
    x = batch[column].double()
    mask = batch.get(f"{column}_mask")
    return x if mask is None else (x * mask).sum(1)


def spec_stages(spec: dict[str, Any], *, sleep: bool = True) -> list[Stage]:
    """Fresh stages for ``spec`` (new state each call).

    * rollout ``s0``: ``c0`` rows of ``prompt % 3 + 1`` tokens ``prompt + 10 * policy_version + t``;
    * compute ``s<i>``: ``c<i> = i + sum`` of its inputs' row sums (float64);
    * update: the same plus a running total of everything it has seen (so it depends
      on the order of its calls), and a counter of finished iterations.
    """
    out = []
    for i, desc in enumerate(spec["stages"]):
        delays = itertools.cycle(desc["delays"])
        state = {"total": 0.0}

        def fn(
            batch: dict[str, torch.Tensor],
            i: int = i,
            desc: dict[str, Any] = desc,
            delays: Any = delays,
            state: dict[str, float] = state,
        ) -> dict[str, Any]:
            if sleep:
                time.sleep(next(delays))
            if desc["role"] == "rollout":
                prompts, version = batch["prompts"].tolist(), batch["policy_version"].tolist()
                rows = [torch.arange(p % 3 + 1, dtype=torch.float64) + p + 10 * v for p, v in zip(prompts, version)]
                return {desc["output"]: rows}
            value = float(i) + sum(_row_sum(batch, c) for c in desc["inputs"])
            if desc["role"] == "update":
                value = value + state["total"]
                state["total"] += float(torch.as_tensor(value).sum())
            return {desc["output"]: value}

        fn.__name__ = desc["name"]
        out.append(
            stage(
                fn,
                inputs=desc["inputs"],
                outputs=[desc["output"]],
                micro_batch=desc["micro_batch"],
                by_group=desc["by_group"],
                resource=desc["resource"],
                role=desc["role"],
            )
        )
    return out


@st.composite
def stage_costs(draw: st.DrawFn, names: list[str], *, low: float = 0.5, high: float = 5.0) -> dict[str, float]:
    """Uneven per-row costs: one float in ``[low, high]`` per stage name."""
    return {n: draw(st.floats(low, high)) for n in names}
