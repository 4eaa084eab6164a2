"""A run resumed in chunks, each with a larger trainer.steps and another trainer.save_every, equals one run.

This is how ``benchmarks/opd_vs_grpo.py`` measures a curve (a chunk per measurement): every
chunk resumes the last one's checkpoint. Nothing in the run depends on ``trainer.steps`` or
``trainer.save_every`` but when it stops and saves (the learning rate is constant, the prompts
and samples are keyed by the global step, the global random stream is saved with the step),
so in the blocking pipeline the chunked run's weights and metrics equal the unchained run's
bit for bit. An option whose state a checkpoint does not hold (rollouts running ahead of the
update in the disaggregated async pipeline) makes a resume inexact by design: the resume then
says so (``RuntimeWarning``) and goes on.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from rlcore.train import inexact_resume, load_config, read_metrics, train
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_tiny.yaml"


def _cfg(out: Path, steps: int, save_every: int, *extra: str):
    return load_config(
        CONFIG,
        [
            *TINY,
            "trainer.export=false",
            "trainer.eval_every=2",
            "trainer.eval_samples=2",
            f"trainer.output_dir={out}",
            f"trainer.steps={steps}",
            f"trainer.save_every={save_every}",
            *extra,
        ],
    )


def _chunked(out: Path, chunks: list[tuple[int, int]], *extra: str):
    """Each chunk ``(end, save_every)`` resumes the one before it, as a curve's measurements do."""
    run = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, (end, every) in enumerate(chunks):
            run = train(_cfg(out, end, every, *extra), resume=k > 0)
    assert not [w for w in caught if "not exact" in str(w.message)]  # an exact resume does not warn
    assert run is not None
    return run


def _training(records):
    """A record without its timings and without the validation (a chunk also validates after its last step)."""
    timing = ("busy_s/", "bubble/", "sync_s", "step_time_s", "tokens_per_s_device", "checkpoint_stall_s", "val/")
    return [{k: v for k, v in r.items() if not k.startswith(timing)} for r in records]


def _validations(records):
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("val/")} for r in records if "val/reward" in r}


@pytest.mark.parametrize("extra", [(), ("trainer.reward_workers=1", "deploy.mode=disaggregated")])
def test_a_run_resumed_in_chunks_equals_the_unchained_run(tmp_path, extra):
    whole = train(_cfg(tmp_path / "whole", 6, 0, *extra))
    # Chunk ends off and on the save grid, save_every changed at every chunk (3 then 1 then 2).
    chunked = _chunked(tmp_path / "chunks", [(2, 3), (3, 1), (6, 2)], *extra)
    for (k, a), b in zip(whole.policy.state_dict().items(), chunked.policy.state_dict().values()):
        assert torch.equal(a, b), k
    records = read_metrics(tmp_path / "chunks" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    assert _training(records) == _training(whole.records)
    # Validation is keyed by the step too: where both runs validated, they agree.
    whole_val, chunk_val = _validations(whole.records), _validations(records)
    assert set(whole_val) <= set(chunk_val) and all(chunk_val[s] == v for s, v in whole_val.items())


def test_the_options_a_checkpoint_does_not_hold_are_named():
    exact = _cfg(Path("out"), 4, 2).to_dict()
    assert inexact_resume(exact) == []
    assert inexact_resume({**exact, "deploy": {**exact["deploy"], "async_infer": True}}) == []  # co-located: exact
    saved = {  # a replay buffer and a curriculum's pass rates are saved with the run (run_state.run_extras)
        "rl": {**exact["rl"], "replay": {"capacity": 8}},
        "data": {**exact["data"], "curriculum": {"edges": [0.5]}},
    }
    assert inexact_resume({**exact, **saved}) == []
    ahead = {**exact["deploy"], "async_infer": True, "mode": "disaggregated"}
    (reason,) = inexact_resume({**exact, "deploy": ahead})
    assert reason.startswith("deploy.async_infer (disaggregated):") and "not saved" in reason
    (reason,) = inexact_resume({**exact, "deploy": {**ahead, "carry_over": True}})
    assert "deploy.carry_over" in reason and "none lost" in reason


def test_a_resume_that_cannot_be_exact_says_so_and_goes_on(tmp_path):
    ahead = ["deploy.mode=disaggregated", "deploy.async_infer=true", "trainer.eval_every=0"]
    train(_cfg(tmp_path, 1, 1, *ahead))
    with pytest.warns(RuntimeWarning, match=r"is not exact .*deploy\.async_infer \(disaggregated\): the rollouts"):
        run = train(_cfg(tmp_path, 2, 1, *ahead), resume=True)
    assert [r["step"] for r in run.records] == [1]
