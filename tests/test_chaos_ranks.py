"""Issue 29 at 2 gloo ranks: a rank's killed workers are replaced on that rank while the other waits in its
collectives (no deadlock, the run equal to the undisturbed one), and a rank that dies stops the other."""

from __future__ import annotations

import datetime
import multiprocessing
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dist_helpers import leave, spawn
from rlcore.testing.chaos import ChaosReward
from rlcore.train import load_checkpoint, load_config, make_task, train
from rlcore.train.prompts import task_options
from tiny_runs import QUIET, TINY_MODEL, TINY_ROLLOUT

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
RANKS = [
    *TINY_MODEL,
    *TINY_ROLLOUT,
    *QUIET,
    "parallel.data_parallel=2",
    "rl.batch_size=2",
    "rl.mini_batch_size=2",
    "trainer.warmup_batch_size=4",
    f"trainer.steps={STEPS}",
    "trainer.export=false",
]


def _cfg(out: Path, *extra: str):
    return load_config(ROOT / "configs" / "grpo_tiny.yaml", [*RANKS, f"trainer.output_dir={out}", *extra])


def _recovering(rank: int, init_file: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    workers = ["deploy.mode=disaggregated", "trainer.reward_workers=1", "trainer.max_worker_restarts=3"]
    cfg = _cfg(Path(tmp) / "chaos", *workers)
    reward = None
    if rank == 0:  # rank 0's rollout worker killed while step 1 is scored, its reward worker while step 2 is
        marks = Path(tmp) / "marks"
        marks.mkdir()
        task_reward = make_task(cfg.data.task, **task_options(cfg)).reward
        reward = ChaosReward(task_reward, marks, every=2, reward_at=3, last=STEPS - 1)
    disturbed = train(cfg, reward=reward)
    undisturbed = train(_cfg(Path(tmp) / "quiet", *workers))
    torch.save(
        {"disturbed": disturbed.records, "undisturbed": undisturbed.records, "kills": reward and reward.kills()},
        Path(tmp) / f"records{rank}.pt",
    )
    leave()


def test_a_ranks_killed_workers_are_replaced_on_that_rank_and_the_run_is_undisturbed(tmp_path):
    spawn(_recovering, (str(tmp_path / "init"), str(tmp_path)), 2, timeout=900)
    r0, r1 = (torch.load(tmp_path / f"records{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["kills"] == (1, 1)
    restarts = [(r["worker_restarts"], r["reward_worker_restarts"]) for r in (r0["disturbed"][-1], r1["disturbed"][-1])]
    assert restarts == [(1.0, 1.0), (0.0, 0.0)]  # replaced on the rank they died on
    for rec in (r0, r1):
        assert [r["step"] for r in rec["disturbed"]] == list(range(STEPS))
        for a, b in zip(rec["disturbed"], rec["undisturbed"], strict=True):
            assert (a["loss"], a["reward"], a["entropy"]) == (b["loss"], b["reward"], b["entropy"]), a["step"]


def _dies_at_step_2(prompts, responses, **columns):
    """Rank 1's reward (in its own process): the rank dies, as a lost node would, while step 2 is scored."""
    if Path(os.environ["RLCORE_TEST_DIR"], "step1").exists():
        os._exit(9)
    steps = sorted(Path(os.environ["RLCORE_TEST_DIR"]).glob("step*"))
    Path(os.environ["RLCORE_TEST_DIR"], f"step{len(steps)}").touch()
    return [float(len(r) % 2) for r in responses]


def _dying(rank: int, init_file: str, tmp: str) -> None:
    torch.set_num_threads(1)
    os.environ["RLCORE_TEST_DIR"] = tmp
    # The bound on a collective whose peer is gone without closing its sockets.
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timeout)
    train(_cfg(Path(tmp) / "run", "trainer.save_every=1"), reward=_dies_at_step_2 if rank == 1 else None)
    os._exit(0)  # not reached on rank 0: its peer is gone


def test_a_rank_that_dies_stops_the_other_with_an_error_and_the_checkpoint_intact(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=_dying, args=(r, str(tmp_path / "init"), str(tmp_path))) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(600)  # a bound, not a timing: a rank still running then has hung
        assert [p.exitcode for p in ranks][1] == 9
        assert ranks[0].exitcode not in (None, 0)  # stopped by itself, with an error
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
            p.join()
    assert load_checkpoint(tmp_path / "run")["step"] in (0, 1)  # a committed version loads
