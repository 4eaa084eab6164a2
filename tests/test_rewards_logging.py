"""What a run logs of its rewards: each component's mean raw score beside the weighted total, and sample rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlcore.rewards import RewardPool, build_reward, reward_log_values
from rlcore.train import load_config, read_metrics, train
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]


def _three_rewards():
    # length: 1 for responses of at most 2 characters; answer_match: exact answer; format: digits only
    return build_reward(
        [
            {"reward": "length", "weight": 0.5, "kwargs": {"max_length": 2}},
            {"reward": "answer_match", "weight": 2.0},
            {"reward": "format", "weight": 0.25, "kwargs": {"pattern": r"\d+"}, "name": "digits"},
        ]
    )


def test_reprobe30_weighted_counts_each_components_raw_scores():
    reward = _three_rewards()
    with RewardPool(reward, num_workers=0) as pool:
        assert reward_log_values(pool.pop_metrics(0)) == {}  # nothing scored yet
        total = pool.submit(["q"] * 3, ["12", "#### abc", "7"], batch=0, answers=["12", "abc", "8"]).result()
        # by hand: length [1, 0, 1], answer_match [1, 1, 0], digits [1, 0, 1]
        assert total.tolist() == [0.5 + 2.0 + 0.25, 2.0, 0.5 + 0.25]
        # a call outside the pool (a validation of the same reward object) is not counted in the step
        reward(["q"], ["12"], answers=["12"])
        third = pytest.approx(2 / 3)
        assert reward_log_values(pool.pop_metrics(0)) == {"length": third, "answer_match": third, "digits": third}
        pool.submit(["q"], ["abcd"], batch=1, answers=["x"]).result()
        assert reward_log_values(pool.pop_metrics(1)) == {"length": 0.0, "answer_match": 0.0, "digits": 0.0}


def test_reprobe30_breakdown_is_summed_over_ranks_before_the_mean():
    # Two ranks' counters are summed (as the trainer's data-parallel reduce does), then divided:
    # rank 0 scored [1, 1], rank 1 scored [0]: the mean is 2/3, not the mean of means 1/2.
    ranks = []
    for responses in (["1", "2"], ["abc"]):
        reward = build_reward([{"reward": "format", "kwargs": {"pattern": r"\d+"}, "name": "digits"}, "length"])
        with RewardPool(reward, num_workers=0) as pool:
            pool.submit(["q"] * len(responses), responses, batch=0).result()
            ranks.append(pool.pop_metrics(0))
    summed = {k: ranks[0][k] + ranks[1][k] for k in ranks[0]}
    assert reward_log_values(summed)["digits"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_reprobe30_pool_brings_the_breakdown_back_and_keeps_sample_rows(num_workers):
    with RewardPool(_three_rewards(), num_workers=num_workers, timeout=120, samples=2) as pool:
        scores = pool.submit(["p0", "p1", "p2", "p3"], ["12", "abc", "7", "x"], batch=5, answers=["12", "b", "7", "y"])
        assert scores.result().tolist() == [2.75, 0.0, 2.75, 0.5]
        got = reward_log_values(pool.pop_metrics(5))
        assert got == {"length": 0.75, "answer_match": 0.5, "digits": 0.5}
        rows = pool.pop_samples(5)
        assert [r["prompt"] for r in rows] == ["p0", "p2"]  # spread over the batch
        assert rows[0] == {"prompt": "p0", "response": "12", "score": 2.75, "answer": "12"}
        assert rows[1] == {"prompt": "p2", "response": "7", "score": 2.75, "answer": "7"}
        assert pool.pop_samples(5) == []
    with pytest.raises(ValueError, match="samples: got -1, expected an int >= 0"):
        RewardPool(_three_rewards(), num_workers=0, samples=-1)


def test_reprobe30_a_run_logs_each_reward_and_writes_sample_rows(tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "grpo_tiny.yaml").read_text())
    raw["rewards"] = [
        {"reward": "answer_match", "weight": 1.0},
        {"reward": "length", "weight": 0.5, "kwargs": {"max_length": 3}},
    ]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    cfg = load_config(
        tmp_path / "run.yaml", [*TINY, f"trainer.output_dir={out}", "trainer.steps=3", "trainer.log_samples=2"]
    )
    train(cfg)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert 0 <= r["reward/answer_match"] <= 1 and 0 <= r["reward/length"] <= 1, r
        # the total is the weighted sum of the components' means
        assert r["reward"] == pytest.approx(r["reward/answer_match"] + 0.5 * r["reward/length"], abs=1e-5), r
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [0, 2]  # every 2 steps
    for row in rows:
        assert set(row) == {"step", "prompt", "response", "score", "answer"}
        assert isinstance(row["prompt"], str) and isinstance(row["response"], str)
        length = float(len(row["response"]) <= 3)
        assert row["score"] in (pytest.approx(0.5 * length), pytest.approx(1.0 + 0.5 * length)), row


def test_reprobe30_log_samples_config_key_is_checked(tmp_path):
    with pytest.raises(ValueError, match="trainer.log_samples"):
        load_config(ROOT / "configs" / "grpo_tiny.yaml", ["trainer.log_samples=-1"])
    assert load_config(ROOT / "configs" / "grpo_tiny.yaml", []).trainer.log_samples == 0
