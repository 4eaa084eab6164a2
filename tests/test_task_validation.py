"""A built-in task's validation set (``data.val_size``): with ``trainer.eval_every`` a run logs ``val/pass@1``, its
greedy accuracy on a fixed set of the task's prompts, so a single run gives a learning curve (no chunked resumes).

The set is drawn once from its own stream (the same for any batch size or run length); the logged figure equals the
greedy exact-match accuracy of the trained policy computed by hand; bad sizes are refused by their key."""

from pathlib import Path

import pytest
import torch

from rlcore import seeding
from rlcore.train import TaskPrompts, load_config, task_options, task_validation_set, train
from rlcore.train.rollout import generate, left_pad
from rlcore.train.tasks import Reversal
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]


def test_the_set_is_the_tasks_prompts_from_their_own_stream():
    task = Reversal(length=4, min_length=2, letters="abcdef")
    val = task_validation_set(task, size=64, seed=3, name="reversal")
    assert len(val) == 64 and val.prompts == val.texts
    assert all(a == p[:-1][::-1] for p, a in zip(val.prompts, val.columns["answers"]))
    assert val.prompt_ids == tuple(tuple(task.tokenizer.encode(p)) for p in val.prompts)
    again = task_validation_set(task, size=64, seed=3)
    assert again.prompts == val.prompts  # deterministic
    training = [s["prompt"] for s in task.sample(64, seeding.generator(3, seeding.Purpose.DATA, 0))]
    assert training != list(val.prompts)  # not the first step's prompts
    assert task_validation_set(task, size=64, seed=4).prompts != val.prompts


def _cfg(tmp_path, *extra):
    return load_config(
        ROOT / "configs" / "grpo_tiny.yaml", [*TINY, f"trainer.output_dir={tmp_path}", "trainer.steps=2", *extra]
    )


def test_only_a_validating_single_turn_run_builds_the_set(tmp_path):
    assert TaskPrompts(_cfg(tmp_path), task_options(_cfg(tmp_path))).val is None  # no trainer.eval_every
    cfg = _cfg(tmp_path, "trainer.eval_every=1", "data.val_size=12")
    assert len(TaskPrompts(cfg, task_options(cfg)).val) == 12


def test_a_run_logs_the_greedy_accuracy_on_the_set(tmp_path):
    cfg = _cfg(tmp_path, "trainer.eval_every=1", "data.val_size=24", "trainer.eval_samples=2")
    run = train(cfg)
    assert [("val/pass@1" in r, "val/pass@2" in r) for r in run.records] == [(True, True)] * 2
    val = TaskPrompts(cfg, task_options(cfg)).val
    tok = Reversal(length=cfg.data.length, min_length=cfg.data.min_length, letters=cfg.data.letters).tokenizer
    prompts, mask = left_pad([list(p) for p in val.prompt_ids], tok.pad_token_id)
    policy = run.policy.eval()
    with torch.no_grad():
        out = generate(
            policy,
            prompts,
            mask,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            max_new_tokens=cfg.rl.max_new_tokens,
            temperature=0.0,
        )
    texts = [tok.decode(r[m != 0].tolist()) for r, m in zip(out.responses, out.mask)]
    right = sum(t == a for t, a in zip(texts, val.columns["answers"]))
    assert run.records[-1]["val/pass@1"] == pytest.approx(right / len(val))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.val_size=0"], "config key 'data.val_size': got 0, expected > 0"),
        (
            ["data.path=prompts.jsonl", "data.val_size=8"],
            "config key 'data.val_size': got 8 with data.path .*expected it unset",
        ),
    ],
)
def test_bad_sizes_are_refused_by_their_key(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _cfg(tmp_path, *overrides)
