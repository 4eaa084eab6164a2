"""The chaos test of issue 29: the main job's task, disaggregated, its rollout worker SIGKILLed every few steps and
a reward worker once; the run completes, every sampled row is trained exactly once, the restarts equal the kills,
and the run equals the undisturbed one (the blocking pipeline: exactly, not only within 0.03 of reward)."""

import multiprocessing
from pathlib import Path

import pytest
import torch

from rlcore.testing.chaos import ChaosReward
from rlcore.train import load_config, make_task, train
from rlcore.train.prompts import task_options
from tiny_runs import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
# Rollout worker killed while steps 1 and 3 are scored (seen by the rollouts of steps 2 and 4), the reward worker
# while step 2 is scored.
STEPS, EVERY, REWARD_AT, BATCH, SAMPLES = 5, 2, 3, 4, 4


def chaos_config(out, *extra):
    return load_config(
        ROOT / "configs" / "grpo_tiny.yaml",
        [
            *TINY_MODEL,
            f"rl.batch_size={BATCH}",
            f"rl.mini_batch_size={BATCH}",
            f"rl.num_rollouts={SAMPLES}",
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
            f"trainer.output_dir={out}",
            *extra,
        ],
    )


@pytest.fixture
def backend(request):
    if request.param != "ray":
        yield request.param
        return
    import ray  # the test extra installs Ray: a missing Ray is a failure, not a skip

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield "ray"
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """The same run co-located (no worker to kill; the blocking disaggregated run equals it, test_ray_rollout)."""
    return train(chaos_config(tmp_path_factory.mktemp("undisturbed"), "trainer.reward_workers=0"))


def task_reward(cfg):
    return make_task(cfg.data.task, **task_options(cfg)).reward


@pytest.mark.parametrize("backend", ["local", "ray"], indirect=True)
def test_killed_workers_are_replaced_and_the_run_equals_the_undisturbed_one(tmp_path, backend, undisturbed):
    cfg = chaos_config(tmp_path / "a", "deploy.mode=disaggregated", f"deploy.backend={backend}")
    (tmp_path / "chaos").mkdir()
    chaos = ChaosReward(
        task_reward(cfg), tmp_path / "chaos", every=EVERY, reward_at=REWARD_AT, ray=backend == "ray", last=STEPS - 1
    )
    with pytest.warns(RuntimeWarning, match="restarting it"):
        disturbed = train(cfg, reward=chaos)
    assert chaos.kills() == (2, 1)
    last = disturbed.records[-1]
    assert (last["worker_restarts"], last["reward_worker_restarts"]) == (2.0, 1.0)  # restarts == kills
    for stage in ("rollout", "update"):  # the dock's row ids: every sampled row generated and trained exactly once
        for j in range(STEPS):
            rows = torch.cat([t.rows for t in disturbed.tasks if t.stage == stage and t.iteration == j])
            assert sorted(rows.tolist()) == list(range(BATCH * SAMPLES)), (stage, j)
    for a, b in zip(disturbed.records, undisturbed.records, strict=True):  # blocking: exactly the same run
        assert (a["reward"], a["loss"], a["entropy"]) == (b["reward"], b["loss"], b["entropy"]), a["step"]
    for (name, x), y in zip(disturbed.policy.state_dict().items(), undisturbed.policy.state_dict().values()):
        assert torch.equal(x, y), name
    assert multiprocessing.active_children() == []
