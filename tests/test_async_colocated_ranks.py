"""Co-located asynchronous rollout at 2 gloo ranks: each rank samples on its own snapshot, the collectives stay in order.

The policy is sharded (FSDP2) over the two ranks; each rank's rollout runs on a thread of
its own over an unsharded snapshot that loads the version its rows are stamped with
(:class:`rlcore.train.deploy.SnapshotDeployment`), while every collective (the update's
gathers and reductions, the weight sync, the metrics) runs on the update's thread, in
iteration order. At staleness 0 the run equals the blocking one; at staleness 1 it
finishes on both ranks with every row within the bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_helpers import leave, spawn
from rlcore.train import load_config, train
from rlcore.train.config import check_launch
from tiny_runs import QUIET, TINY_MODEL, TINY_ROLLOUT

ROOT = Path(__file__).resolve().parents[1]
COLOCATED_RANKS = [
    *TINY_MODEL,
    *TINY_ROLLOUT,
    *QUIET,
    "parallel.data_parallel=2",
    "rl.batch_size=2",
    "rl.mini_batch_size=2",
    "rl.temperature=1.0",
    "trainer.warmup_batch_size=4",
    "trainer.export=false",
    "deploy.mode=co-located",
    "rl.beta=0.1",  # a KL term in the loss: the reference's forward runs inside the update
    "trainer.steps=3",
]
ZERO = ["deploy.async_infer=true", "deploy.staleness=0", "rl.behaviour_weights=none"]
ONE = ["deploy.async_infer=true", "deploy.staleness=1", "trainer.steps=4"]


def _cfg(out: Path, *extra: str):
    return load_config(ROOT / "configs" / "grpo_tiny.yaml", [*COLOCATED_RANKS, f"trainer.output_dir={out}", *extra])


def length_reward(prompts, responses, **columns):
    """Rewards that differ within a group from the first step: the weights move, the lag shows."""
    return [len(r) / 6 for r in responses]


def _ranks(rank: int, init_file: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    for name, extra in (("blocking", []), ("zero", ZERO), ("one", ONE)):
        run = train(_cfg(Path(tmp) / name, *extra), reward=length_reward)
        policy = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in run.policy.state_dict().items()}
        torch.save((run.records, policy), Path(tmp) / f"{name}{rank}.pt")
    leave()


def test_colocated_async_at_two_ranks(tmp_path):
    spawn(_ranks, (str(tmp_path / "init"), str(tmp_path)), 2, timeout=400)
    runs = {
        (name, r): torch.load(tmp_path / f"{name}{r}.pt", weights_only=False)
        for name in ("blocking", "zero", "one")
        for r in (0, 1)
    }
    (blocking, weights), (zero, zero_weights) = runs["blocking", 0], runs["zero", 0]
    # Staleness 0 equals the blocking pipeline: losses, rewards, parameters.
    assert all(r["policy_lag_max"] == 0 for r in zero)
    assert [r["reward"] for r in blocking] == [r["reward"] for r in zero]
    assert any(abs(r["loss"]) > 1e-4 for r in blocking)
    for a, b in zip(blocking, zero, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), a["step"]
    for k, x in weights.items():
        torch.testing.assert_close(x, zero_weights[k], rtol=0, atol=1e-6, msg=k)
    # Staleness 1: both ranks finish every step and agree; the bound holds; some rows overlapped an update.
    one, other = runs["one", 0][0], runs["one", 1][0]
    assert [r["step"] for r in one] == list(range(4)) == [r["step"] for r in other]
    for x, y in zip(one, other):
        for key in ("loss", "reward", "kl", "policy_lag", "token_lag_max"):
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-7), (x["step"], key)
    assert max(r["policy_lag_max"] for r in one) == 1 and max(r["token_lag_max"] for r in one) <= 1
    # Each row sampled by exactly the version it records: the sampler's log-probs are the old policy's at lag 0.
    assert all(r["mismatch/logp_abs_max"] < 1e-4 for r in one if r["policy_lag_max"] == 0)


def test_colocated_async_is_launched_at_two_ranks(tmp_path):
    check_launch(_cfg(tmp_path, *ONE), 2)
    with pytest.raises(ValueError, match="deploy.async_infer.*world size 2.*rl.algo 'ppo'"):
        check_launch(_cfg(tmp_path, *ONE, "rl.algo=ppo"), 2)
