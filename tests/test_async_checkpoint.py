"""Checkpoints off the critical path: DCP async_save stages, writes in the background, and counts only once committed."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.fsdp import fully_shard

import dist_helpers
import rlcore.train.checkpoint as checkpoint_module
from kept_checkpoints import assert_kept_equals_sync
from rlcore.train import CHECKPOINT_NAME, load_checkpoint, load_config, read_metrics, save_checkpoint, train
from rlcore.train.checkpoint import save_checkpoint_async
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    return model, opt


def _versions(out: Path) -> list[str]:
    return sorted(p.name for p in (out / CHECKPOINT_NAME).iterdir() if p.is_dir())


def test_the_staged_copy_is_saved_while_training_changes_the_model(tmp_path):
    model, opt = _trained()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    pending = save_checkpoint_async(tmp_path, {"policy": (model, opt), "step": 7}, step=7)
    for _ in range(3):  # training goes on at once: parameters and moments change in place
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    assert pending.result() == tmp_path / CHECKPOINT_NAME / "step000007"
    assert not pending.thread.is_alive()  # the result comes once the commit thread has ended
    saved = load_checkpoint(tmp_path)
    assert saved["step"] == 7
    for k, v in weights.items():
        assert torch.equal(saved["policy"]["model"][k], v), k
    fresh, fresh_opt = _trained()
    load_checkpoint(tmp_path, {"policy": (fresh, fresh_opt), "step": None})
    for k, v in moments.items():
        assert torch.equal(fresh_opt.state[fresh[0].weight][k], v), k


def _slow_staging(monkeypatch, seconds: float) -> None:
    """The background copy starts ``seconds`` late: anything that changed the state meanwhile would be saved."""
    stage = DefaultStager._stage

    def late(self, state_dict, **kwargs):
        time.sleep(seconds)
        return stage(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", late)


def test_a_copy_staged_in_the_background_holds_the_state_at_the_call(tmp_path, monkeypatch):
    _slow_staging(monkeypatch, 0.3)
    model, opt = _trained()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    pending = save_checkpoint_async(tmp_path, {"policy": (model, opt), "step": 7}, step=7, stage_in_background=True)
    assert not pending.staged.done()  # the call returned before the copy
    model(torch.randn(4, 8)).square().mean().backward()  # reading the state meanwhile is allowed
    pending.staged.result(timeout=30)
    opt.step()  # and changing it once staged
    assert pending.result(timeout=30) == tmp_path / CHECKPOINT_NAME / "step000007"
    saved = load_checkpoint(tmp_path)
    for k, v in weights.items():
        assert torch.equal(saved["policy"]["model"][k], v), k
    fresh, fresh_opt = _trained()
    load_checkpoint(tmp_path, {"policy": (fresh, fresh_opt), "step": None})
    for k, v in moments.items():
        assert torch.equal(fresh_opt.state[fresh[0].weight][k], v), k


def test_a_copy_staged_in_the_background_is_taken_before_the_next_optimiser_step(tmp_path, monkeypatch):
    """Mid-run checkpoints, copied late while the next step runs, equal a synchronous save of the same step."""
    _slow_staging(monkeypatch, 0.5)
    kept = tmp_path / "kept"
    commit = checkpoint_module._commit

    def keep(path, *args):
        commit(path, *args)
        if path.parent.parent == tmp_path / "a":
            shutil.copytree(path, kept / path.name)

    monkeypatch.setattr(checkpoint_module, "_commit", keep)

    def cfg(out, steps, *extra):
        overrides = [*TINY, f"trainer.output_dir={out}", f"trainer.steps={steps}", "trainer.export=false", *extra]
        return load_config(ROOT / "configs" / "grpo_tiny.yaml", overrides)

    train(cfg(tmp_path / "a", 3, "trainer.save_every=1"))
    assert sorted(p.name for p in kept.iterdir()) == ["step000001", "step000002", "step000003"]
    train(cfg(tmp_path / "b", 2, "trainer.async_save=false"))
    ours = tmp_path / "ours"
    assert_kept_equals_sync(kept / "step000002", ours, tmp_path / "b")


def _blocked_writes(monkeypatch, gate: threading.Event, fail: bool = False):
    write = dcp.FileSystemWriter.write_data

    def held(self, plan, planner):
        assert gate.wait(30)
        if fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held)


def test_a_version_counts_only_once_committed(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"step": 1, "model": torch.nn.Linear(2, 2)}, step=1)
    gate = threading.Event()
    _blocked_writes(monkeypatch, gate)
    pending = save_checkpoint_async(tmp_path, {"step": 2, "model": torch.nn.Linear(2, 2)}, step=2)
    try:
        time.sleep(0.2)
        # Mid-write: the new folder exists, but the committed version and what loads are the previous one.
        assert not pending.done() and _versions(tmp_path) == ["step000001", "step000002"]
        assert load_checkpoint(tmp_path)["step"] == 1
    finally:
        gate.set()
    pending.result(timeout=30)
    assert load_checkpoint(tmp_path)["step"] == 2 and _versions(tmp_path) == ["step000002"]


def test_a_failed_background_write_is_raised_and_the_previous_version_stays(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"step": 1, "model": torch.nn.Linear(2, 2)}, step=1)
    gate = threading.Event()
    gate.set()
    _blocked_writes(monkeypatch, gate, fail=True)
    pending = save_checkpoint_async(tmp_path, {"step": 2, "model": torch.nn.Linear(2, 2)}, step=2)
    with pytest.raises(Exception, match="No space left on device"):
        pending.result(timeout=30)
    monkeypatch.undo()
    assert load_checkpoint(tmp_path)["step"] == 1 and _versions(tmp_path) == ["step000001"]
    save_checkpoint_async(tmp_path, {"step": 3, "model": torch.nn.Linear(2, 2)}, step=3).result(timeout=30)
    assert load_checkpoint(tmp_path)["step"] == 3  # the save lock was released


_SAVER = """
import sys, torch
from rlcore.train.checkpoint import save_checkpoint_async
model = torch.nn.Linear(256, 256)
step, pending = 0, None
while True:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)
    if pending is not None:
        pending.result()
    pending = save_checkpoint_async(sys.argv[1], {"model": model, "step": step})
    if step == 1:
        print("saved", flush=True)
    step += 1
"""


def test_kill_9_during_background_saves_leaves_a_whole_committed_version(tmp_path):
    """Saves in a loop, each changing the model right after it is staged; killed at an arbitrary point."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"saved"
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    data = load_checkpoint(tmp_path)
    step = data["step"]
    assert step >= 1 and all(torch.equal(v, torch.full_like(v, step)) for v in data["model"].values())


def test_the_trainer_logs_the_stall_and_resumes_exactly_with_either_kind_of_save(tmp_path):
    def cfg(out, steps, *extra):
        overrides = [*TINY, f"trainer.output_dir={out}", f"trainer.steps={steps}", "trainer.save_every=2", *extra]
        return load_config(ROOT / "configs" / "grpo_tiny.yaml", overrides)

    whole = train(cfg(tmp_path / "a", 3))
    stalls = [r["checkpoint_stall_s"] for r in whole.records]
    assert stalls[0] == 0.0 and stalls[1] > 0 and stalls[2] > 0  # saved after steps 1 and 2 (the last)
    train(cfg(tmp_path / "b", 2, "trainer.async_save=false", "trainer.export=false"))
    resumed = train(cfg(tmp_path / "b", 3, "trainer.export=false"), resume=True)
    assert load_checkpoint(tmp_path / "b")["step"] == 2
    for (k, a), b in zip(whole.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), k
    assert [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [r["loss"] for r in whole.records]


def _rank_main(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        fully_shard(model)  # each rank owns half of every tensor
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        group = dist.new_group(backend="gloo")
        pending = save_checkpoint_async(out_dir, {"policy": (model, opt), "step": 5}, step=5, process_group=group)
        with torch.no_grad():  # training goes on while the shards are written
            for p in model.parameters():
                p.add_(1.0)
        dist.all_reduce(torch.ones(1))  # the training's own collectives meanwhile, on the default group
        pending.result(timeout=60)
        # The commit thread has ended with the result: at exit no daemon thread may drop the group (an abort).
        assert not pending.thread.is_alive()
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "full.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    dist_helpers.leave()


def test_two_gloo_ranks_save_their_shards_in_the_background():
    with tempfile.TemporaryDirectory() as tmp:
        dist_helpers.spawn(_rank_main, (2, os.path.join(tmp, "init"), tmp), nprocs=2, timeout=120)
        full = torch.load(os.path.join(tmp, "full.pt"))
        saved = load_checkpoint(tmp)  # both ranks' shards, whole, in one process
        assert saved["step"] == 5
        for k, v in full.items():
            assert torch.equal(saved["policy"]["model"][k], v), k
        assert saved["policy"]["optim"]["state"]
