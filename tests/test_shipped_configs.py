"""The shipped configs learn: each runs through the CLI, progress bar and plots on, on a shortened schedule, and the
metric that says it learned must rise.

A green unit suite does not prove a run learns: an agent config whose reward stayed at 0.0 and an offline DPO run
that crashed in its final summary both passed it. These runs use the shipped files unchanged except for the number
of steps (and one torch thread, as every test process has); the bounds sit well inside what the first steps of the
full runs reach (the README's figures come from the full runs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.train import read_metrics
from rlcore.train.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run_shipped(name: str, tmp_path: Path, *overrides: str) -> list[dict]:
    """Run ``configs/<name>.yaml`` through ``rlcore train``; assert exit 0 and return its step records."""
    out = tmp_path / name
    argv = ["train", "--config", str(ROOT / "configs" / f"{name}.yaml"), f"trainer.output_dir={out}"]
    assert main([*argv, "trainer.threads=1", *overrides]) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert (out / "curves.png").stat().st_size > 1000
    return records


def head_tail(records: list[dict], key: str, k: int) -> tuple[float, float]:
    """Mean of ``key`` over the first and the last ``k`` step records."""
    values = [float(r[key]) for r in records]
    assert len(values) >= 2 * k, (key, len(values))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def test_main_job_reward_rises(tmp_path, capsys):
    # The full run (400 steps): about 0.26-0.29 over the first 10% of steps, 0.92 over the last 10% (by machine).
    records = run_shipped("grpo_tiny", tmp_path, "trainer.steps=60")
    first, last = head_tail(records, "reward", 10)
    assert first < 0.35 and last > first + 0.1, (first, last)
    assert "mean reward of steps 0-5" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "steps", "gain"),
    [("dapo_tiny", 60, 0.1), ("ppo_tiny", 60, 0.1), ("dpo_tiny", 60, 0.1)],
)
def test_shipped_rl_configs_learn(name, steps, gain, tmp_path):
    records = run_shipped(name, tmp_path, f"trainer.steps={steps}")
    first, last = head_tail(records, "reward", 10)
    assert last > first + gain, (name, first, last)


def test_opd_student_closes_in_on_its_teacher(tmp_path):
    """The teacher config (warm-up shortened) makes the teacher directory; the shipped student config then distils
    it over the full vocabulary (rl.opd_loss jsd): the student's KL to the teacher falls and its sampled reward
    rises without any task reward in the loss."""
    run_shipped("opd_teacher_tiny", tmp_path, "trainer.warmup_steps=150", "trainer.steps=1")
    teacher = tmp_path / "opd_teacher_tiny" / "hf"
    records = run_shipped("opd_tiny", tmp_path, "trainer.steps=30", f"model.teacher={teacher}")
    assert all("kl" in r and "distill" in r for r in records)  # the teacher's KL and the loss term, every step
    first, last = head_tail(records, "kl", 5)
    assert last < 0.95 * first, (first, last)
    first, last = head_tail(records, "reward", 5)
    assert last > first, (first, last)
