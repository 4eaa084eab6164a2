"""The command line: ``rlcore train`` / ``python -m rlcore.train``, exit codes and messages."""

import functools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import reward_helpers
from rlcore import seeding
from rlcore.train import read_metrics, trainer
from rlcore.train.cli import main
from tiny_runs import SMALLEST_STEP, TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
TESTS = str(Path(__file__).resolve().parent)
CONFIG = str(ROOT / "configs" / "grpo_tiny.yaml")
TINY = [
    *TINY_MODEL,
    *SMALLEST_STEP,
    "deploy.async_infer=false",
    "trainer.reward_workers=0",
]


def test_config_errors_exit_2_naming_the_key(capsys):
    assert main(["train", "--config", CONFIG, "rl.temperature=hot"]) == 2
    assert "rlcore: error: config key 'rl.temperature': got str 'hot', expected float" in capsys.readouterr().err
    assert main(["train", "--config", CONFIG, "parallel.data_parallel=4"]) == 2
    assert "expected the launched world size 1" in capsys.readouterr().err
    assert main(["train", "--config", "/nonexistent.yaml"]) == 2
    assert "cannot read '/nonexistent.yaml'" in capsys.readouterr().err


def test_bad_override_syntax_and_missing_config(capsys):
    assert main(["train", "--config", CONFIG, "temperature=0.7"]) == 2
    assert "expected section.key=value" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["train"])
    assert err.value.code == 2


def test_train_then_resume_in_process(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", CONFIG, *TINY, "trainer.steps=1", f"trainer.output_dir={out}"]) == 0
    # Issue 18, defect 7: a run killed while appending leaves a cut last line; resume drops it.
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "rew')
    with pytest.warns(RuntimeWarning, match=r"metrics file .* dropped its last line 2, cut short"):
        code = main(["train", "--config", CONFIG, "--resume", *TINY, "trainer.steps=2", f"trainer.output_dir={out}"])
    assert code == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
    captured = capsys.readouterr()
    assert "done: step 1" in captured.out
    assert "mean reward of steps 1-1" in captured.out  # the resumed run's steps, named as such
    assert "reward=" in captured.err  # the progress bar's postfix
    assert (out / "curves.png").is_file()


def test_python_dash_m_entry_point(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rlcore.train",
        "--config",
        CONFIG,
        *TINY,
        "trainer.steps=1",
        f"trainer.output_dir={out}",
        "trainer.progress=false",
        "trainer.plot=false",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(read_metrics(out / "metrics.jsonl")) == 1
    script = shutil.which("rlcore") or pytest.skip("the rlcore console script is not installed (pip install -e .)")
    bad = subprocess.run(
        [script, "train", "--config", CONFIG, "rl.algo=trpo"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "config key 'rl.algo': got str 'trpo'" in bad.stderr


@pytest.mark.parametrize("stop_signals", ["[SIGTERM]", "[]"])
def test_sigterm_stops_cleanly_and_keeps_the_checkpoint(tmp_path, stop_signals):
    import signal
    import time

    from rlcore.train import load_checkpoint, read_metrics

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rlcore.train",
        "--config",
        CONFIG,
        *TINY,
        "trainer.steps=100000",
        "trainer.save_every=1",
        f"trainer.output_dir={out}",
        "trainer.progress=false",
        "trainer.reward_workers=1",
        f"trainer.stop_signals={stop_signals}",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    metrics = out / "metrics.jsonl"
    while time.time() < deadline and (not metrics.is_file() or metrics.read_text().count("\n") < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if stop_signals == "[]":  # SIGTERM is Ctrl-C: the run stops at once, the last committed checkpoint stays
        assert proc.returncode == 130 and "interrupted; the last checkpoint is intact" in err
        assert load_checkpoint(out)["step"] >= 1
    else:  # a stop signal: the step under way finishes and is saved, the reward worker closed
        assert proc.returncode == 75 and "stopped by SIGTERM after step" in err, err[-2000:]
        assert load_checkpoint(out)["step"] == read_metrics(out / "metrics.jsonl")[-1]["step"] >= 2


def _fake_train(calls):
    def train(cfg, *, resume=False, **kwargs):
        calls.append((cfg, resume))
        return trainer.Run([], None, None)

    return train


def test_resume_placed_after_overrides_is_accepted(monkeypatch):
    # Issue 18, defect 14: `--resume` after the overrides was "unrecognized arguments".
    calls: list = []
    monkeypatch.setattr(trainer, "train", _fake_train(calls))
    assert main(["train", "--config", CONFIG, "rl.lr=0.001", "--resume", "trainer.steps=3", "rl.lr=0.002"]) == 0
    cfg, resume = calls[-1]
    assert resume and cfg.trainer.steps == 3 and cfg.rl.lr == 0.002  # later overrides win, in order
    assert main(["train", "rl.lr=0.001", "--config", CONFIG]) == 0 and not calls[-1][1]
    for bad in (["--bogus"], ["--resume", "--bogus", "rl.lr=0.1"]):
        with pytest.raises(SystemExit) as err:
            main(["train", "--config", CONFIG, "rl.lr=0.001", *bad])
        assert err.value.code == 2
    assert main(["train", "--config", CONFIG, "--resume", "rl.lr=0.001", "not-an-override"]) == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.model_name_or_path.num_attention_heads=3", "num_attention_heads=3 does not divide hidden_size=64"),
        ("rl.temperature=.inf", "config key 'rl.temperature': got float inf, expected float (finite)"),
        ("rl.max_new_tokens=100", "more than the model's max_position_embeddings=64"),
    ],
)
def test_config_gaps_exit_2_with_one_line_before_any_work(override, message, capsys, monkeypatch):
    # Issue 18, defect 14: the trainer must not start (train is never called).
    calls: list = []
    monkeypatch.setattr(trainer, "train", _fake_train(calls))
    assert main(["train", "--config", CONFIG, override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not calls


def _exits_3(prompts, responses, **columns):
    raise SystemExit(3)


def test_reprobe_reward_calling_exit_exits_2_not_with_its_status(tmp_path, capsys, monkeypatch):
    # The reward's SystemExit(3) became the CLI's exit status: 3, that of a non-finite loss.
    monkeypatch.setattr(trainer, "train", functools.partial(trainer.train, reward=_exits_3))
    args = [*TINY, "trainer.steps=1", f"trainer.output_dir={tmp_path}", "trainer.progress=false"]
    assert main(["train", "--config", CONFIG, *args]) == 2
    assert "rlcore: error: reward '_exits_3' on batch 0 of 4 responses raised SystemExit: 3" in capsys.readouterr().err


def test_dead_reward_worker_exits_2_naming_the_reward_and_the_batch(tmp_path, capsys, monkeypatch):
    # Issue 18, defect 8: a worker killed mid-batch gave a BrokenProcessPool traceback.
    monkeypatch.setattr(trainer, "train", functools.partial(trainer.train, reward=reward_helpers.DiesInWorker()))
    args = [*TINY, "trainer.reward_workers=1", "trainer.steps=1", f"trainer.output_dir={tmp_path}"]
    assert main(["train", "--config", CONFIG, *args, "trainer.progress=false"]) == 2
    err = capsys.readouterr().err
    assert "rlcore: error: reward 'dies' on batch 0: the reward's worker process died (exit code 9)" in err


_STUCK_RUN = """
import functools, sys
sys.path.insert(0, {tests!r})
import reward_helpers
from rlcore import seeding
from rlcore.train import cli, trainer
trainer.train = functools.partial(trainer.train, reward=reward_helpers.StuckInC({marker!r}))
sys.exit(cli.main({argv!r}))
"""


def test_stuck_reward_sigterm_stops_the_run_within_seconds(tmp_path):
    # Issue 18, defect 3: SIGTERM unwound into a shutdown that waited for the stuck call.
    marker = tmp_path / "pid"
    argv = ["train", "--config", CONFIG, *TINY, "trainer.reward_workers=1", "trainer.progress=false"]
    # SIGTERM asks for the stuck step to finish; trainer.stop_timeout later the step is abandoned.
    argv += ["trainer.plot=false", f"trainer.output_dir={tmp_path / 'run'}", "trainer.stop_timeout=1"]
    script = _STUCK_RUN.format(tests=TESTS, marker=str(marker), argv=argv)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        assert reward_helpers.wait_for(marker.is_file, 180), "the reward never started"
        worker = int(marker.read_text())
        proc.send_signal(signal.SIGTERM)
        # Guards against the hang; the run stops in about a second on a quiet machine.
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "interrupted; the last checkpoint is intact" in err
        assert "did not finish within 1 s of SIGTERM (trainer.stop_timeout); abandoning it" in err
        assert reward_helpers.wait_for(lambda: not reward_helpers.alive(worker), 120)
    finally:
        proc.kill()
        proc.communicate()


# Re-probe of issue 18 ---------------------------------------------------------------------


def test_reprobe_large_seed_runs(monkeypatch):
    # trainer.seed >= about 1e5 overflowed torch's seed range when the trainer made its generators mid-run.
    for seed in (123_456, 2**63, 10**30, -(2**40)):
        a = seeding.generator(seed, seeding.Purpose.WARMUP, 7)
        b = seeding.generator(seed, seeding.Purpose.WARMUP, 8)
        assert not torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
        rows = seeding.RowStream(seed, seeding.Purpose.SAMPLING, 7, torch.arange(4))
        assert torch.rand(2, generator=rows).shape == (2,)


def test_reprobe_export_of_a_missing_checkpoint_does_not_speak_of_resume(tmp_path, capsys):
    # The error said "resume: no checkpoint ...; run without --resume first".
    (tmp_path / "f").write_text("x")
    (tmp_path / "foreign" / "checkpoint").mkdir(parents=True)  # a checkpoint folder with no finished save
    (tmp_path / "foreign" / "checkpoint" / "notes.txt").write_text("x")
    for checkpoint in (tmp_path / "nope", tmp_path, tmp_path / "f", tmp_path / "foreign"):
        assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "rlcore: error: checkpoint: no training checkpoint" in err and "resume" not in err
        assert err.count("\n") == 1


def test_reprobe_export_to_an_empty_out_dir_is_refused(tmp_path, capsys):
    # `rlcore export RUN ""` wrote the model into the current directory.
    assert main(["export", str(tmp_path), ""]) == 2
    assert "rlcore: error: out_dir: got ''" in capsys.readouterr().err


def test_reprobe_output_dir_os_errors_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    def fails(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "out"))

    monkeypatch.setattr(trainer, "train", fails)
    assert main(["train", "--config", CONFIG, f"trainer.output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlcore: error: ") and "Permission denied" in err and err.count("\n") == 1


def test_reprobe30_grpo_with_the_progress_bar_exits_0_with_its_reward_and_no_library_bars(tmp_path, capsys):
    """A GRPO run with the progress bar on: the summary and the bar carry the reward; transformers' shard-writing
    bar does not cut into the training bar at each save."""
    out = tmp_path / "run"
    argv = ["train", "--config", CONFIG, *TINY, "trainer.steps=2", "trainer.save_every=1", f"trainer.output_dir={out}"]
    assert main([*argv, "trainer.progress=true"]) == 0
    captured = capsys.readouterr()
    records = read_metrics(out / "metrics.jsonl")
    done = [line for line in captured.out.splitlines() if line.startswith("done:")]
    expected = f"mean reward of steps 0-0 {records[0]['reward']:.3f}, of steps 1-1 {records[1]['reward']:.3f}"
    assert len(done) == 1 and expected in done[0], done
    assert "reward=" in captured.err and "kl=" in captured.err and "margin=" not in captured.err
    assert (out / "hf" / "config.json").is_file()  # the export ran, at every save
    assert "Writing model shards" not in captured.err, captured.err[-600:]


def test_reprobe30_export_prints_one_line_without_library_progress_bars(tmp_path, capfd):
    out = tmp_path / "run"
    flags = ["trainer.steps=1", "trainer.save_every=1", "trainer.progress=false", "trainer.plot=false"]
    assert main(["train", "--config", CONFIG, *TINY, *flags, f"trainer.output_dir={out}"]) == 0
    capfd.readouterr()
    assert main(["export", str(out), str(tmp_path / "hf")]) == 0
    printed = capfd.readouterr()
    assert "Writing model shards" not in printed.err + printed.out, printed
    assert printed.out == f"exported {out} to {tmp_path / 'hf'}\n"
