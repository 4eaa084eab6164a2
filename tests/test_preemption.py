"""Preemption-safe stops: a signal stops the run at a step boundary with a checkpoint there; --resume is exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rlcore.train import (
    CHECKPOINT_NAME,
    EXIT_PREEMPTED,
    Preempted,
    load_checkpoint,
    load_config,
    read_metrics,
    save_checkpoint,
    stop_on_signals,
    train,
)
from rlcore.train.cli import main
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_tiny.yaml"
QUICK = [*TINY, "trainer.export=false"]


def _curve(records):
    """A record without its timings: what a resumed run must repeat exactly."""
    timing = ("busy_s/", "bubble/", "sync_s", "step_time_s", "tokens_per_s_device", "checkpoint_stall_s")
    return [{k: v for k, v in r.items() if not k.startswith(timing)} for r in records]


def _cfg(out: Path, *extra: str):
    return load_config(CONFIG, [*QUICK, f"trainer.output_dir={out}", *extra])


class SignalsAt:
    """A rule reward that sends this process ``signum`` from its ``call``-th call (one call per step)."""

    name = "signals"

    def __init__(self, call: int, signum: int = signal.SIGUSR1, times: int = 1):
        self.calls, self.call, self.signum, self.times = 0, call, signum, times

    def __call__(self, prompts, responses, **columns):
        self.calls += 1
        if self.calls == self.call:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)
                time.sleep(0.05)  # the main thread runs the handler
        return [float(len(r) % 2) for r in responses]


def _whole(out: Path, steps: int, reward=None):
    """The uninterrupted run a stopped-and-resumed one must equal: its records and weights."""
    run = train(_cfg(out, f"trainer.steps={steps}"), reward=reward)
    return _curve(run.records), {k: v.clone() for k, v in run.policy.state_dict().items()}


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return _whole(tmp_path_factory.mktemp("whole"), 4, SignalsAt(call=0))


def test_a_signal_stops_at_the_step_boundary_and_resume_is_exact(tmp_path, whole):
    cfg = _cfg(tmp_path, "trainer.steps=4", "trainer.stop_signals=[SIGUSR1]")
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(Preempted, match="stopped by SIGUSR1 after step 1") as stopped:
        train(cfg, reward=SignalsAt(call=2))  # the signal arrives during step 1, which finishes
    assert stopped.value.step == 1
    assert signal.getsignal(signal.SIGUSR1) is before  # the handler is gone with the run
    assert load_checkpoint(tmp_path)["step"] == 1  # saved at the boundary, though save_every is 0
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    # A save killed in flight left a partial version beside the committed one: the resume ignores it.
    partial = tmp_path / CHECKPOINT_NAME / "step000003"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 64)
    resumed = train(cfg, resume=True, reward=SignalsAt(call=0))
    assert [r["step"] for r in resumed.records] == [2, 3]
    assert _curve(read_metrics(tmp_path / "metrics.jsonl")) == whole[0]  # nothing lost, nothing twice
    for k, v in resumed.policy.state_dict().items():
        assert torch.equal(v, whole[1][k]), k
    assert not partial.exists()  # the next save cleared it


_KILLED_IN_SAVE = """
import os, signal, sys
from pathlib import Path
import rlcore.train.checkpoint as checkpoint
from rlcore.train import train
from test_preemption import SignalsAt, _cfg

commit, commits = checkpoint._commit, []

def commit_or_die(path, *args):
    commits.append(path)
    if len(commits) == 3:  # step 2's background save: its shards written, not committed; step 3 trains meanwhile
        os.kill(os.getpid(), signal.SIGKILL)
    commit(path, *args)

checkpoint._commit = commit_or_die
train(_cfg(Path(sys.argv[1]), "trainer.steps=4", "trainer.save_every=1"), reward=SignalsAt(call=0))
"""


def test_the_trainer_killed_during_a_background_save_resumes_exactly_from_the_previous_checkpoint(tmp_path, whole):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", _KILLED_IN_SAVE, str(tmp_path)], env=env)
    try:
        assert proc.wait(timeout=600) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert load_checkpoint(tmp_path)["step"] == 1  # the save in flight never counted; the previous one loads
    cfg = _cfg(tmp_path, "trainer.steps=4", "trainer.save_every=1")
    resumed = train(cfg, resume=True, reward=SignalsAt(call=0))
    assert [r["step"] for r in resumed.records] == [2, 3]
    assert _curve(read_metrics(tmp_path / "metrics.jsonl")) == whole[0]  # nothing lost, nothing twice
    for k, v in resumed.policy.state_dict().items():
        assert torch.equal(v, whole[1][k]), k


def test_a_second_signal_abandons_the_step_and_keeps_the_last_checkpoint(tmp_path):
    cfg = _cfg(tmp_path, "trainer.steps=4", "trainer.save_every=1", "trainer.stop_signals=[SIGUSR1]")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, reward=SignalsAt(call=3, times=2))  # two signals during step 2
    assert load_checkpoint(tmp_path)["step"] == 1  # step 2 was abandoned, step 1's checkpoint stands
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_a_signal_during_a_save_never_corrupts_the_last_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"step": 1, "w": torch.ones(3)})
    real_save = torch.save

    def signalled(times):
        def save(obj, f):
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.05)
            return real_save(obj, f)

        return save

    with stop_on_signals(["SIGUSR1"]) as stop:  # one signal: noted, the save completes
        monkeypatch.setattr(torch, "save", signalled(1))
        save_checkpoint(tmp_path, {"step": 2, "w": torch.ones(3)})
    assert stop.is_set() and load_checkpoint(tmp_path)["step"] == 2
    with stop_on_signals(["SIGUSR1"]), pytest.raises(KeyboardInterrupt):  # two: abandoned mid-save
        monkeypatch.setattr(torch, "save", signalled(2))
        save_checkpoint(tmp_path, {"step": 3, "w": torch.ones(3)})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path)["step"] == 2
    assert sorted(p.name for p in (tmp_path / CHECKPOINT_NAME).iterdir() if p.name.startswith("v")) == ["v000002"]


def test_a_step_that_does_not_finish_within_the_stop_timeout_is_abandoned(capfd):
    with stop_on_signals(["SIGUSR1"], timeout=0.2), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(30)  # a stuck step: interrupted after 0.2 s
    assert "did not finish within 0.2 s of SIGUSR1 (trainer.stop_timeout); abandoning it" in capfd.readouterr().err
    with stop_on_signals(["SIGUSR1"], timeout=0.2) as stop:  # a stop under way (saved): no interrupt
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        stop.disarm()
        time.sleep(0.4)
    with stop_on_signals(["SIGUSR1"], timeout=0.2):  # a stop that came in time: no interrupt later
        os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.4)


def test_handlers_are_installed_only_from_the_main_thread():
    seen = []

    def run():
        with stop_on_signals(["SIGUSR1"]) as stop:
            seen.append((signal.getsignal(signal.SIGUSR1), stop.is_set()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(signal.SIG_DFL, False)]


def test_stop_signals_are_validated_naming_the_key(tmp_path):
    for bad, match in (
        ("[SIGKILL]", r"'trainer.stop_signals': got 'SIGKILL' in \['SIGKILL'\], expected a list of signal names"),
        ("SIGTERM", r"'trainer.stop_signals': got str 'SIGTERM', expected list"),
        ("[SIGTERM, SIGTERM]", r"'trainer.stop_signals': got \['SIGTERM', 'SIGTERM'\], expected each signal once"),
    ):
        with pytest.raises(ValueError, match=match):
            _cfg(tmp_path, f"trainer.stop_signals={bad}")
    with pytest.raises(ValueError, match=r"'trainer.stop_timeout': got 0.0, expected > 0"):
        _cfg(tmp_path, "trainer.stop_timeout=0")


def test_sigterm_to_the_cli_saves_exits_75_and_resume_equals_the_whole_run(tmp_path):
    """The real thing: ``rlcore train`` in its own process, SIGTERM once it has logged a step."""
    out, steps = tmp_path / "run", 6
    args = ["train", "--config", str(CONFIG), *QUICK, f"trainer.output_dir={out}", f"trainer.steps={steps}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlcore.train", *args[1:]],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: nothing it starts outlives the test
    )
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no step logged in 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = load_checkpoint(out)["step"]
    assert "stopped by SIGTERM after step" in err and "--resume" in err
    assert stopped < steps - 1 and [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(stopped + 1))
    assert main([*args, "--resume"]) == 0
    assert _curve(read_metrics(out / "metrics.jsonl")) == _whole(tmp_path / "whole", steps)[0]


def _two_ranks(rank: int, init_file: str, tmp: str) -> None:
    import torch.distributed as dist

    from dist_helpers import leave

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    parallel = ["parallel.data_parallel=2", "rl.batch_size=2", "rl.mini_batch_size=2", "trainer.warmup_batch_size=4"]
    cfg = _cfg(Path(tmp) / "run", *parallel, "trainer.steps=4", "trainer.stop_signals=[SIGUSR1]")
    try:
        train(cfg, reward=SignalsAt(call=2 if rank == 1 else 0))  # only rank 1 is signalled, during step 1
        stopped: tuple = (rank, None, None)
    except Preempted as err:
        stopped = (rank, err.step, err.signal_name)
    torch.save(stopped, Path(tmp) / f"rank{rank}.pt")
    leave()


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    from dist_helpers import spawn

    spawn(_two_ranks, (str(tmp_path / "init"), str(tmp_path)), nprocs=2, timeout=240)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert got == [(0, 1, "a peer"), (1, 1, "SIGUSR1")]  # no rank went on into a collective alone
    assert load_checkpoint(tmp_path / "run")["step"] == 1
