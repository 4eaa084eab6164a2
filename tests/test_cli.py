"""The command line: ``rlcore train`` / ``python -m rlcore.train``, exit codes and messages."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.train import read_metrics
from rlcore.train.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "grpo_tiny.yaml")
TINY = [
    "model.model_name_or_path.hidden_size=32",
    "model.model_name_or_path.intermediate_size=64",
    "model.model_name_or_path.num_hidden_layers=1",
    "rl.batch_size=2",
    "rl.mini_batch_size=2",
    "rl.num_rollouts=2",
    "trainer.warmup_steps=1",
    "trainer.warmup_batch_size=4",
    "trainer.threads=1",
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
    assert main(["train", "--config", CONFIG, "--resume", *TINY, "trainer.steps=2", f"trainer.output_dir={out}"]) == 0
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


def test_sigterm_stops_cleanly_and_keeps_the_checkpoint(tmp_path):
    import signal
    import time

    from rlcore.train import load_checkpoint

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
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    metrics = out / "metrics.jsonl"
    while time.time() < deadline and (not metrics.is_file() or metrics.read_text().count("\n") < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted; the last checkpoint is intact" in err
    assert load_checkpoint(out)["step"] >= 1
