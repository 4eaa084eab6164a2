"""The small pipeline the worker-restart tests drive: a proxy rollout stage and an update that publishes each version."""

from __future__ import annotations

import torch

from rlcore.dataflow import StageGraph, run_pipeline, stage


def restart_pipeline(worker):
    """Four iterations of 6 rows at staleness 1: the worker serves responses = prompts * w + 0.5, w += 1 per step."""
    w = torch.tensor(1.0, dtype=torch.float64)
    worker.publish(0, {"w": w})

    def step(j):
        w.add_(1.0)
        worker.publish(j + 1, {"w": w})

    graph = StageGraph(
        [
            worker.stage(inputs=["prompts"], outputs=["responses"], micro_batch=2),
            stage(
                lambda b: {"loss": b["responses"] * 2},
                inputs=["responses"],
                outputs=["loss"],
                name="update",
                role="update",
                micro_batch=2,
                resource="train",
                on_iteration_end=step,
            ),
        ]
    )
    return run_pipeline(
        graph,
        lambda j: {"prompts": torch.arange(6) + 10 * j},
        num_prompts=6,
        num_iterations=4,
        staleness=1,
        collect=["prompts", "responses"],
        join_timeout=2.0,
    )
