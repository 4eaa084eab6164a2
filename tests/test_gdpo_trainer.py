"""rl.algo gdpo from the config: the reward pool carries each component's scores to the advantages.

GDPO with one reward is GRPO through the whole trainer (exact, batch whitening off), a
run with two rewards trains, and the pool's component scores are the rewards' own."""

import dataclasses
from pathlib import Path

import pytest
import torch

from rlcore import algos
from rlcore.rewards import LengthReward, RewardPool, build_reward
from rlcore.train import advantages_stage, build_algorithm, load_config, parse_config, train
from tiny_runs import TINY, record_losses

ROOT = Path(__file__).resolve().parents[1]
INLINE = {"model_type": "qwen2"}
TWO = ["answer_match", {"reward": "length", "weight": 0.5, "kwargs": {"max_length": 3}}]


def _cfg(out, rewards, *extra):
    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", [*TINY, f"trainer.output_dir={out}", "trainer.steps=2",
                                                            "trainer.plot=false", *extra])  # fmt: skip
    return dataclasses.replace(cfg, rewards=rewards)


@pytest.mark.parametrize("workers", [0, 1])
def test_the_pool_gives_each_components_unweighted_scores(workers):
    reward = build_reward([{"reward": "length", "weight": 0.5, "kwargs": {"max_length": 2}}, "length"])
    with RewardPool(reward, num_workers=workers, timeout=60, samples=1, components=True) as pool:
        scores, parts = pool.submit(["q", "q"], ["ab", "abcdefghijk"], batch=0).result()
        assert pool.pop_samples(0)[0]["score"] == pytest.approx(float(scores[0]))
    assert torch.equal(parts[:, 0], LengthReward(max_length=2)([""] * 2, ["ab", "abcdefghijk"]))
    assert torch.equal(scores, 0.5 * parts[:, 0] + parts[:, 1])
    with RewardPool(LengthReward(max_length=2), num_workers=0, components=True) as pool:  # one component
        scores, parts = pool.submit(["q"], ["abc"]).result()
    assert parts.shape == (1, 1) and torch.equal(parts[:, 0], scores)
    with pytest.raises(ValueError, match="components: got 1, expected a bool"):
        RewardPool(reward, num_workers=0, components=1)


def test_gdpo_config_builds_the_weighted_recipe_and_refuses_what_it_cannot_run():
    cfg = parse_config({"model": {"model_name_or_path": INLINE}, "rl": {"algo": "gdpo"},
                        "rewards": [{"reward": "length", "weight": 0.5}, "answer_match"]})  # fmt: skip
    algo = build_algorithm(cfg)
    assert algos.scoring_needs(algo).score_parts and not algos.scoring_needs(algos.grpo()).score_parts
    assert algo.advantage_estimator.keywords["estimator"].keywords["weights"] == [0.5, 1.0]
    with pytest.raises(ValueError, match="'rl.multi_turn': got a section with rl.algo 'gdpo'"):
        parse_config({"model": {"model_name_or_path": INLINE}, "rl": {"algo": "gdpo", "multi_turn": {}}})


def test_gdpo_with_one_reward_is_grpo_in_the_trainer(tmp_path):
    one = ["answer_match"]
    grpo_cfg = _cfg(tmp_path / "grpo", one)
    grpo = build_algorithm(grpo_cfg)
    gdpo = algos.gdpo(batch_norm=False)._replace(agg_mode=grpo.agg_mode)  # GRPO's aggregation, no batch whitening
    a = train(grpo_cfg, algo=grpo)
    b = train(_cfg(tmp_path / "gdpo", one, "rl.algo=gdpo"), algo=gdpo)
    assert torch.equal(record_losses(a.records), record_losses(b.records))
    assert [r["reward"] for r in a.records] == [r["reward"] for r in b.records]
    for (k, x), y in zip(a.policy.state_dict().items(), b.policy.state_dict().values()):
        assert torch.equal(x, y), k


def test_gdpo_with_two_rewards_and_refills_runs_from_the_config(tmp_path):
    # With filter-and-refill: the component scores of the refills join the picked groups' rows.
    cfg = _cfg(tmp_path, TWO, "rl.algo=gdpo", "trainer.reward_workers=1", "rl.max_refill_draws=1")
    records = train(cfg).records
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert all("refill/shortfall" in r for r in records)
    assert {"reward/answer_match", "reward/length"} <= set(records[0])


def test_the_advantages_stage_gives_gdpo_the_components():
    g = torch.Generator().manual_seed(0)
    parts = torch.randint(0, 3, (8, 2), generator=g).float()
    group = torch.tensor([5, 5, 5, 5, 2, 2, 2, 2])
    algo = algos.gdpo(weights=[0.5, 2.0])
    stage = advantages_stage(algo, inputs=("scores", "score_parts", "mask", "group"))
    out = stage.fn({"scores": parts.sum(-1), "score_parts": parts, "mask": torch.ones(8, 3), "group": group})
    want = algos.gdpo_advantages(parts, torch.tensor([1, 1, 1, 1, 0, 0, 0, 0]), weights=[0.5, 2.0])
    assert torch.equal(out["advantages"], want[:, None].expand(8, 3))


def test_rl_gdpo_batch_norm_sets_the_last_whitening():
    """On by default (as verl's gdpo); off gives the weighted sum of the group z-scores; only with rl.algo gdpo."""
    raw = {"model": {"model_name_or_path": INLINE}, "rl": {"algo": "gdpo"}, "rewards": ["length", "answer_match"]}
    g = torch.Generator().manual_seed(1)
    parts = torch.randint(0, 3, (8, 2), generator=g).float()
    parts[:, 1] += 2 * torch.rand(8, generator=g)
    rows = {"scores": parts.sum(-1), "score_parts": parts, "mask": torch.ones(8, 3),
            "group": torch.tensor([5, 5, 5, 5, 2, 2, 2, 2])}  # fmt: skip
    ids = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0])
    for value, want in ((None, True), (True, True), (False, False)):
        rl = raw["rl"] if value is None else {**raw["rl"], "gdpo_batch_norm": value}
        cfg = parse_config({**raw, "rl": rl})
        assert cfg.rl.gdpo_batch_norm is want
        stage = advantages_stage(build_algorithm(cfg), inputs=tuple(rows))
        expected = algos.gdpo_advantages(parts, ids, batch_norm=want)
        assert torch.equal(stage.fn(rows)["advantages"], expected[:, None].expand(8, 3))
    whitened = algos.gdpo_advantages(parts, ids)
    assert float(whitened.mean()) == pytest.approx(0, abs=1e-6) and float(whitened.std()) == pytest.approx(1, abs=1e-4)
    assert not torch.allclose(whitened, algos.gdpo_advantages(parts, ids, batch_norm=False))
    with pytest.raises(ValueError, match="config key 'rl.gdpo_batch_norm': got False with rl.algo 'grpo'"):
        parse_config({**raw, "rl": {"algo": "grpo", "gdpo_batch_norm": False}})
    with pytest.raises(ValueError, match="config key 'rl.gdpo_batch_norm': got str 'no', expected bool"):
        parse_config({**raw, "rl": {"algo": "gdpo", "gdpo_batch_norm": "no"}})
