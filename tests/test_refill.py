"""Filter-and-refill (DAPO's dynamic sampling with redraws): the pick, and the sampling stage over the dock."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.algos import informative_groups, refill_groups
from rlcore.dataflow import stage
from rlcore.testing import assert_no_host_sync, grouped_scores
from rlcore.testing import reference as ref
from rlcore.train import load_config, train
from rlcore.train.refill import refill_stage
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(scores_ids=grouped_scores(patterns=("binary", "constant", "normal")), wanted=st.integers(0, 10))
def test_refill_groups_matches_reference(dtype, scores_ids, wanted):
    scores, ids = scores_ids
    scores = scores.to(dtype)
    pick = refill_groups(scores, ids, wanted=wanted)
    picked, shortfall = ref.refill_groups_ref(scores, ids, wanted=wanted)
    assert pick.groups.shape == pick.valid.shape == (wanted,)
    assert pick.groups[pick.valid].tolist() == picked
    assert int(pick.shortfall) == shortfall
    assert bool((pick.groups[~pick.valid] == -1).all())
    per_sample = ref.dynamic_sampling_mask_ref(scores, ids)
    assert torch.equal(informative_groups(scores, ids)[ids], per_sample)


@given(
    scores_ids=grouped_scores(patterns=("binary", "constant", "normal")),
    wanted=st.integers(0, 10),
    spoil=st.booleans(),
)
def test_refill_never_picks_a_zero_variance_group_and_counts_the_shortfall(scores_ids, wanted, spoil):
    scores, ids = scores_ids
    if spoil:  # a failed reward (NaN) spoils its group
        scores = scores.clone()
        scores[0] = float("nan")
    pick = refill_groups(scores, ids, wanted=wanted)
    for g in pick.groups[pick.valid].tolist():
        s = scores[ids == g]
        assert bool(torch.isfinite(s).all()) and float(s.max()) != float(s.min())
    # Exactly ``wanted`` groups, or every informative group and the shortfall counted.
    available = int(informative_groups(scores, ids).sum())
    assert int(pick.valid.sum()) == min(wanted, available)
    assert int(pick.valid.sum()) + int(pick.shortfall) == wanted
    # The valid slots come first, in draw order.
    k = int(pick.valid.sum())
    assert bool(pick.valid[:k].all()) and pick.groups[:k].tolist() == sorted(pick.groups[:k].tolist())


def test_refill_groups_hand_computed_no_host_sync_and_bad_input():
    s = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    pick = refill_groups(s, ids, wanted=3, num_groups=4)
    assert pick.groups.tolist() == [1, 3, -1] and pick.valid.tolist() == [True, True, False]
    assert int(pick.shortfall) == 1
    assert refill_groups(s, ids, wanted=1).groups.tolist() == [1]
    assert informative_groups(s, ids, num_groups=5).tolist() == [False, True, False, True, False]
    assert_no_host_sync(lambda a, b: refill_groups(a, b, wanted=3, num_groups=4), s, ids)
    with pytest.raises(ValueError, match="wanted: got -1"):
        refill_groups(s, ids, wanted=-1)
    with pytest.raises(ValueError, match="group_ids"):
        refill_groups(s, ids[:3], wanted=1)


# ------------------------------------------------------------------ the sampling stage


def _fake_stages(informative):
    """A rollout that echoes the prompt, a reward that scores a prompt's group by ``informative[prompt id]``."""

    def generate(b):
        rows = b["prompts"].shape[0]
        return {
            "responses": b["prompts"][:, -1:].repeat(1, 2),
            "mask": torch.ones(rows, 2),
            "rollout_logp": torch.zeros(rows, 2),
            "version": b["policy_version"].clone(),
            "token_version": b["policy_version"][:, None].repeat(1, 2),
        }

    def score(b):
        assert b["answers"].shape == b["answers_mask"].shape  # a ragged column arrives padded, with its mask
        ids = b["responses"][:, 0].tolist()
        return {"scores": torch.tensor([float(informative(p) and r % 2) for r, p in zip(b["row"].tolist(), ids)])}

    rollout = stage(
        generate,
        inputs=["prompts", "prompt_mask", "iteration", "row"],
        outputs=["responses", "mask", "rollout_logp", "version", "token_version"],
        name="rollout",
        role="rollout",
    )
    reward = stage(score, inputs=["responses", "answers", "row"], outputs=["scores"], name="reward", resource="cpu")
    return rollout, reward


def _draw(n):
    def draw(step, count, attempt):
        ids = torch.arange(count) + 100 * attempt  # prompt id: attempt * 100 + its place in the draw
        width = 1 + attempt  # each attempt's prompts are wider: the stage pads them
        prompts = torch.cat([torch.zeros(count, width - 1, dtype=torch.long), ids[:, None]], 1)
        rows = count * n
        return {
            "prompts": prompts.repeat_interleave(n, 0),
            "prompt_mask": torch.ones(rows, width, dtype=torch.long),
            "answers": [torch.arange(1 + k % 2) for k in range(rows)],
            "group": torch.arange(count).repeat_interleave(n),
            "iteration": torch.full((rows,), step),
            "row": torch.arange(rows) + attempt * 1000,
        }

    return draw


@settings(max_examples=25, deadline=None)
@given(
    groups=st.integers(1, 4),
    max_draws=st.integers(0, 3),
    good=st.lists(st.booleans(), min_size=400, max_size=400),
)
def test_refill_stage_fills_the_slots_with_informative_groups_or_counts_the_shortfall(groups, max_draws, good):
    n = 2
    informative = lambda p: good[p % 400]  # noqa: E731
    rollout, reward = _fake_stages(informative)
    seen = {}
    s = refill_stage(
        rollout,
        reward,
        _draw(n),
        n_samples=n,
        max_draws=max_draws,
        written=["prompts", "prompt_mask", "answers"],
        on_metrics=lambda step, m: seen.update({step: m}),
    )
    rows = groups * n
    b = {"group": torch.arange(groups).repeat_interleave(n), "iteration": torch.full((rows,), 3)}
    out = s.fn({**b, "row": torch.arange(rows), "policy_version": torch.full((rows,), 7)})
    assert out["prompts"].shape[0] == out["scores"].shape[0] == len(out["answers"]) == rows
    ids = out["prompts"][:, -1].view(groups, n)
    assert bool((ids == ids[:, :1]).all())  # each slot holds one prompt's whole group
    scores = out["scores"].view(groups, n)
    ok = (scores.max(1).values != scores.min(1).values).tolist()
    shortfall = int(seen[3]["refill/shortfall"])
    # Exactly B informative groups, or the shortfall counted and its slots last.
    assert ok == [True] * (groups - shortfall) + [False] * shortfall
    # The draws go on only while groups are missing, up to the bound; attempt 0 is the loader's batch.
    pool = [p for a in range(max_draws + 1) for p in range(100 * a, 100 * a + groups)]
    wanted_draws = 0
    have = sum(informative(p) for p in range(groups))
    while have < groups and wanted_draws < max_draws:
        wanted_draws += 1
        have += sum(informative(100 * wanted_draws + k) for k in range(groups - have))
    assert seen[3]["refill/draws"] == wanted_draws
    assert shortfall == max(0, groups - have) and pool  # the pick never invents groups
    assert bool((out["version"] == 7).all()) and s.role == "rollout"
    assert s.inputs == ("group", "iteration", "row")


def test_refill_with_every_group_informative_is_the_plain_sampling():
    rollout, reward = _fake_stages(lambda p: True)
    s = refill_stage(rollout, reward, _draw(2), n_samples=2, max_draws=2, written=["prompts", "answers"])
    b = {"group": torch.arange(3).repeat_interleave(2), "iteration": torch.full((6,), 0), "row": torch.arange(6)}
    out = s.fn({**b, "policy_version": torch.zeros(6, dtype=torch.long)})
    plain = _draw(2)(0, 3, 0)
    assert torch.equal(out["prompts"], plain["prompts"])
    with pytest.raises(ValueError, match="max_draws: got -1"):
        refill_stage(rollout, reward, _draw(2), n_samples=2, max_draws=-1, written=["prompts"])


def test_dapo_trains_with_refills(tmp_path):
    overrides = [*TINY, f"trainer.output_dir={tmp_path}", "trainer.steps=2", "rl.max_refill_draws=2"]
    run = train(load_config(ROOT / "configs" / "dapo_tiny.yaml", [*overrides, "trainer.warmup_steps=0"]))
    assert len(run.records) == 2
    for r in run.records:
        assert 0 <= r["refill/draws"] <= 2 and r["refill/shortfall"] >= 0 and math.isfinite(r["loss"])
        assert r["refill/sampled_groups"] >= 4 and 0 <= r["refill/first_draw_reward"] <= 1
