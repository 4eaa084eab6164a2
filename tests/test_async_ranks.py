"""Asynchronous rollout at 2 gloo ranks: each rank's rollout worker overlaps its update, the collectives stay in order.

Every collective of a step (FSDP2's gathers in the update's forward and backward, the
reference's forward for the loss's KL, the global counts, the metrics, the weight sync)
runs in the update stage, which takes the iterations in order; the rollouts, rewards and
advantages between them are rank-local. So both ranks finish, agree on every logged
value, and no row lags more than the staleness bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_helpers import leave, spawn
from rlcore.train import load_config, read_metrics, train
from rlcore.train.config import check_launch
from tiny_runs import QUIET, TINY_MODEL, TINY_ROLLOUT

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
ASYNC_RANKS = [
    *TINY_MODEL,
    *TINY_ROLLOUT,
    *QUIET,
    "parallel.data_parallel=2",
    "rl.batch_size=2",
    "rl.mini_batch_size=2",
    "trainer.warmup_batch_size=4",
    "deploy.mode=disaggregated",
    "deploy.async_infer=true",
    "deploy.staleness=1",
    "rl.beta=0.1",  # a KL term in the loss: the reference's forward runs inside the update
    f"trainer.steps={STEPS}",
]


# Two optimiser updates per batch on each rank: the old-policy forward runs in the update stage; each rank's
# rollout worker takes new versions mid-rollout (partial rollouts).
MINI_BATCHES = ["rl.batch_size=2", "rl.mini_batch_size=1", "deploy.partial_rollouts=true"]


def _cfg(out: Path, *extra: str):
    return load_config(ROOT / "configs" / "grpo_tiny.yaml", [*ASYNC_RANKS, f"trainer.output_dir={out}", *extra])


def length_reward(prompts, responses, **columns):
    """Rewards that differ within a group from the first step: the weights move, the lag shows."""
    return [len(r) / 6 for r in responses]


def _ranks(rank: int, init_file: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    run = train(_cfg(Path(tmp) / "run"), reward=length_reward)
    torch.save(run.records, Path(tmp) / f"records{rank}.pt")
    run = train(_cfg(Path(tmp) / "mini", *MINI_BATCHES), reward=length_reward)
    torch.save(run.records, Path(tmp) / f"mini{rank}.pt")
    leave()


def test_async_rollout_at_two_ranks(tmp_path):
    spawn(_ranks, (str(tmp_path / "init"), str(tmp_path)), 2, timeout=400)
    a, b = (torch.load(tmp_path / f"records{r}.pt", weights_only=False) for r in (0, 1))
    assert [r["step"] for r in a] == list(range(STEPS)) == [r["step"] for r in b]
    for x, y in zip(a, b):  # the metrics are the whole batch's on every rank
        for key in ("loss", "reward", "kl", "behaviour_weight", "policy_lag", "response_length"):
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-7), (x["step"], key)
    assert max(r["policy_lag_max"] for r in a) <= 1 and any(r["policy_lag"] > 0 for r in a)
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["kl"] >= 0 for r in a)
    assert "busy_s/ref_logp" not in a[-1]  # no reference stage: its forward is the update's
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == STEPS
    # Two updates per batch: the old-policy forward ran in the update (no stage of its own), ranks agree.
    c, d = (torch.load(tmp_path / f"mini{r}.pt", weights_only=False) for r in (0, 1))
    assert [r["step"] for r in c] == list(range(STEPS)) == [r["step"] for r in d]
    assert "busy_s/old_logp" not in c[-1] and "busy_s/old_logp" not in d[-1]
    for x, y in zip(c, d):
        for key in ("loss", "reward", "kl", "ratio_max", "policy_lag", "token_lag", "token_lag/1"):
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-7), (x["step"], key)
    assert max(r["policy_lag_max"] for r in c) <= 1 and max(r["token_lag_max"] for r in c + d) <= 1


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["rl.algo=ppo"], "rl.algo 'ppo'"),
        (["rl.algo=reinforce_pp"], "rl.algo 'reinforce_pp'"),
        (["rl.algo=rloo"], "rl.algo 'rloo' and rl.beta 0.1"),
    ],
)
def test_async_ranks_refuse_what_would_run_collectives_outside_the_update(tmp_path, extra, says):
    cfg = _cfg(tmp_path, *extra)
    with pytest.raises(ValueError, match="deploy.async_infer.*world size 2") as err:
        check_launch(cfg, 2)
    assert says in str(err.value)
    check_launch(_cfg(tmp_path), 2)  # the run above
    check_launch(_cfg(tmp_path, "deploy.mode=co-located"), 2)  # each rank's rollout on its own snapshot
    check_launch(_cfg(tmp_path, "rl.algo=rloo", "rl.beta=0"), 2)
    # Several updates per batch: the old-policy forward runs inside the update, before its first step.
    check_launch(_cfg(tmp_path, *MINI_BATCHES, "rl.old_logp=forward", "rl.behaviour_weights=none"), 2)
