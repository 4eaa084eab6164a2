"""The chaos test of issue 29: the main job's task, disaggregated, its rollout worker SIGKILLed every few steps and
a reward worker once; the run completes, every sampled row is trained exactly once, the restarts equal the kills,
and the run equals the undisturbed one (blocking pipeline: exactly)."""

import multiprocessing
from pathlib import Path

import pytest
import torch

from rlcore.testing.chaos import Chaos
from rlcore.train import load_config, train
from tiny_runs import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, REWARD_AT = 7, 3, 4  # rollout worker killed after steps 3 and 6, a reward worker after step 4


def chaos_config(out, backend):
    return load_config(
        ROOT / "configs" / "grpo_tiny.yaml",
        [
            *TINY_MODEL,
            "rl.batch_size=4",
            "rl.mini_batch_size=4",
            "rl.num_rollouts=4",
            "trainer.warmup_steps=2",
            "trainer.warmup_batch_size=8",
            f"trainer.steps={STEPS}",
            "trainer.save_every=0",
            "trainer.progress=false",
            "trainer.plot=false",
            "trainer.export=false",
            "trainer.threads=1",
            "trainer.reward_workers=1",
            "trainer.max_worker_restarts=5",
            "deploy.mode=disaggregated",
            f"deploy.backend={backend}",
            f"trainer.output_dir={out}",
        ],
    )


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_killed_workers_are_replaced_and_the_run_equals_the_undisturbed_one(tmp_path, backend):
    with (
        Chaos(tmp_path / "a", STEPS, every=EVERY, reward_at=REWARD_AT, ray=backend == "ray") as chaos,
        pytest.warns(RuntimeWarning, match="restarting it"),
    ):
        disturbed = train(chaos_config(tmp_path / "a", backend))
    assert chaos.missed == [] and (chaos.rollout_kills, chaos.reward_kills) == (2, 1)
    last = disturbed.records[-1]
    assert (last["worker_restarts"], last["reward_worker_restarts"]) == (2.0, 1.0)  # restarts == kills
    capacity = 4 * 4
    for stage in ("rollout", "update"):  # the dock's row ids: every sampled row generated and trained exactly once
        for j in range(STEPS):
            rows = torch.cat([t.rows for t in disturbed.tasks if t.stage == stage and t.iteration == j])
            assert sorted(rows.tolist()) == list(range(capacity)), (stage, j)
    undisturbed = train(chaos_config(tmp_path / "b", backend))
    for a, b in zip(disturbed.records, undisturbed.records, strict=True):  # blocking: exactly the same run
        assert (a["reward"], a["loss"], a["entropy"]) == (b["reward"], b["loss"], b["entropy"]), a["step"]
    for (name, x), y in zip(disturbed.policy.state_dict().items(), undisturbed.policy.state_dict().values()):
        assert torch.equal(x, y), name
    assert multiprocessing.active_children() == []
