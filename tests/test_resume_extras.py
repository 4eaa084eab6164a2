"""The run's stateful parts in checkpoints: rl.entropy_target's controller, rl.replay's buffer, data.curriculum's rates.

A run resumed from a checkpoint with all three on equals an uninterrupted one, record for
record and weight for weight; each part's saved state restores exactly; bad config is
refused naming its key."""

import math

import pytest
import torch

from dataset_runs import reversal_run
from rlcore.data import parse_curriculum
from rlcore.train import load_checkpoint, parse_config, train
from rlcore.train.curriculum import CurriculumPrompts
from rlcore.train.entropy_target import EntropyTarget, parse_entropy_target
from rlcore.train.replay import Replay, parse_replay

TIME_KEYS = ("_s", "tokens_per_s_device", "busy", "bubble", "sync", "stall")


def _cfg(tmp_path, out, steps):
    return reversal_run(
        tmp_path,
        out,
        steps,
        [
            "rl.lr=0.001",
            "data.curriculum.edges=[0.3]",
            "data.curriculum.weights=[1.0, 1.0]",
            "data.curriculum.decay=0.5",
            "rl.replay={capacity: 4, fraction: 0.5, min_advantage: -1.0}",
            "rl.entropy_target={target: 50.0, delta: 0.01, max_coef: 0.1}",  # always below: the bonus grows each step
        ],
    )


def _curve(records):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIME_KEYS)} for r in records]


def test_a_resumed_run_with_replay_curriculum_and_entropy_target_equals_an_uninterrupted_one(tmp_path):
    whole = train(_cfg(tmp_path, tmp_path / "a", 4))
    coefs = [r["entropy/coef"] for r in whole.records]
    assert coefs == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert whole.records[0]["replay/served"] == 0 and whole.records[2]["replay/served"] > 0
    train(_cfg(tmp_path, tmp_path / "b", 2))
    saved = load_checkpoint(tmp_path / "b")["extras"]
    assert set(saved) == {"replay", "curriculum", "entropy_target"}
    assert float(saved["entropy_target"]["entropy_coef"]) == pytest.approx(0.02)
    resumed = train(_cfg(tmp_path, tmp_path / "b", 4), resume=True)
    assert [r["step"] for r in resumed.records] == [2, 3]
    assert _curve(resumed.records) == _curve(whole.records[2:])
    for (k, a), b in zip(whole.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), k


def test_each_parts_state_restores_exactly():
    target = EntropyTarget(parse_entropy_target({"target": 1.0, "delta": 0.1}))
    target.end_step(0.5)
    again = EntropyTarget(parse_entropy_target({"target": 1.0, "delta": 0.1}))
    again.restore_state(target.checkpoint_state(0))
    assert again.coef == target.coef and again.end_step(0.2) == target.end_step(0.2)

    replay = Replay(parse_replay({"capacity": 3, "min_advantage": -1.0, "fraction": 1.0}))
    rows = {"advantages": torch.tensor([[1.0, 2.0], [0.5, 0.0]]), "loss_mask": torch.ones(2, 2),
            "old_logp": torch.zeros(2, 2), "responses": torch.tensor([[3, 4], [5, 6]])}  # fmt: skip
    replay.dispatch(rows)
    copy = Replay(parse_replay({"capacity": 3, "min_advantage": -1.0, "fraction": 1.0}))
    copy.restore_state(replay.checkpoint_state(0))
    a, b = replay.dispatch(rows)[0], copy.dispatch(rows)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="rl.replay.capacity"):
        Replay(parse_replay({"capacity": 2})).restore_state(replay.checkpoint_state(0))

    class Source:  # a prompt dataset of 6 rows
        dataset, seed, batch_size = list(range(6)), 0, 2

    def scored(cur, step, index, scores):
        cur._pending.setdefault(step, []).append((torch.tensor(index), torch.tensor(scores)))
        cur._kept.setdefault(step, []).append((torch.tensor(index), torch.tensor(scores)))

    cfg = parse_curriculum({"edges": [0.5], "weights": [1.0, 1.0], "decay": 0.5})
    live, lag = CurriculumPrompts(Source(), cfg, lag=2), 2
    for step in range(4):  # draw, then score: the draw of step s reads the scores up to s - lag
        live._catch_up(step)
        scored(live, step, [step, step + 1], [1.0, 0.0])
        if step == 1:
            state = live.checkpoint_state(step)
    resumed = CurriculumPrompts(Source(), cfg, lag=lag)
    resumed.restore_state(state)
    for step in range(2, 4):
        resumed._catch_up(step)
        scored(resumed, step, [step, step + 1], [1.0, 0.0])
    live._catch_up(10), resumed._catch_up(10)
    assert torch.equal(live.rates, resumed.rates) and not math.isnan(float(live.rates.sum()))


@pytest.mark.parametrize(
    ("rl", "key"),
    [
        ({"entropy_target": {"target": 0.2, "step": 1}}, "rl.entropy_target.step"),
        ({"entropy_target": {"delta": 0.1}}, "rl.entropy_target"),
        ({"entropy_target": -1.0}, "rl.entropy_target"),
        ({"entropy_target": 0.2, "entropy_coef": 0.1}, "rl.entropy_coef"),
        ({"entropy_target": 0.2, "algo": "dpo", "num_rollouts": 1}, "rl.algo"),
    ],
)
def test_bad_entropy_target_names_its_key(rl, key):
    with pytest.raises(ValueError, match=f"config key '{key}'"):
        parse_config({"model": {"model_name_or_path": {"model_type": "qwen2"}}, "rl": rl})
