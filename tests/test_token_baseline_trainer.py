"""rl.advantage: optimal_token_baseline from the config, and the log-prob ops' sum_pi_squared output it reads.

The ops give ``sum_v pi(v)^2`` only when asked (the loop reference agrees; logp, entropy
and their gradients are unchanged; no host sync); the old-policy stage writes it; the
trainer's advantages are the pure function of the same inputs; a short run trains, and so
does a multi-turn agent run, whose advantages are the multi-turn variant's (observation
tokens left out)."""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.ops import linear_logprobs, logprobs_from_logits
from rlcore.testing import assert_no_host_sync
from rlcore.testing.reference import sum_pi_squared_ref
from rlcore.testing.token_strategies import chunk_sizes, hidden_weight_labels, lm_logits_and_labels
from rlcore.train import (
    advantages_stage,
    build_algorithm,
    load_config,
    logprob_stage,
    parse_config,
    scoring_plan,
    train,
)
from tiny_runs import TINY, tiny_lm

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
temperatures = st.sampled_from([1.0, 0.6, 1.7])


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=hidden_weight_labels(), chunk=chunk_sizes(), vchunk=chunk_sizes(48), temperature=temperatures)
@settings(max_examples=25, deadline=None)
def test_linear_logprobs_sum_pi_squared_matches_the_loop_reference(dtype, data, chunk, vchunk, temperature):
    hidden, weight, labels = (t.to(dtype) if t.is_floating_point() else t for t in data)
    opts = {"temperature": temperature, "chunk_size": chunk, "vocab_chunk_size": vchunk}
    logp, ent, sps = linear_logprobs(hidden, weight, labels, with_entropy=True, with_sum_pi_squared=True, **opts)
    only_logp, only_sps = linear_logprobs(hidden, weight, labels, with_sum_pi_squared=True, **opts)
    want = sum_pi_squared_ref(hidden.double() @ weight.double().T, temperature=temperature)
    assert sps.dtype == dtype and sps.shape == labels.shape
    _close(sps, want, dtype)
    # Asking for it changes nothing else, and it is a probability's squared norm: in (0, 1].
    plain_logp, plain_ent = linear_logprobs(hidden, weight, labels, with_entropy=True, **opts)
    assert torch.equal(logp, plain_logp) and torch.equal(ent, plain_ent) and torch.equal(only_logp, plain_logp)
    assert torch.equal(only_sps, sps)
    assert bool((sps.float() > 0).all()) and bool((sps.float() <= 1 + TOL[dtype]).all())


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=lm_logits_and_labels(), chunk=chunk_sizes(), temperature=temperatures)
@settings(max_examples=25, deadline=None)
def test_logprobs_from_logits_sum_pi_squared_matches_the_loop_reference(dtype, data, chunk, temperature):
    logits, labels = data
    logits = logits.to(dtype)
    logp, sps = logprobs_from_logits(
        logits, labels, temperature=temperature, chunk_size=chunk, with_sum_pi_squared=True
    )
    _close(sps, sum_pi_squared_ref(logits, temperature=temperature), dtype)
    assert torch.equal(logp, logprobs_from_logits(logits, labels, temperature=temperature, chunk_size=chunk))
    three = logprobs_from_logits(logits, labels, temperature=temperature, chunk_size=chunk, with_entropy=True,
                                 with_sum_pi_squared=True)  # fmt: skip
    assert len(three) == 3 and torch.equal(three[2], sps)


@pytest.mark.parametrize("fused", [True, False])
def test_gradients_are_unchanged_and_sum_pi_squared_has_none(fused):
    torch.manual_seed(0)
    h, w = torch.randn(9, 6, dtype=torch.float64), torch.randn(13, 6, dtype=torch.float64)
    labels = torch.randint(0, 13, (9,))

    def grads(with_sps):
        hh = h.clone().requires_grad_()
        if fused:
            out = linear_logprobs(hh, w, labels, chunk_size=4, vocab_chunk_size=5, with_entropy=True,
                                  with_sum_pi_squared=with_sps)  # fmt: skip
        else:
            out = logprobs_from_logits(hh @ w.T, labels, chunk_size=4, with_entropy=True, with_sum_pi_squared=with_sps)
        (out[0].sum() + 0.3 * out[1].sum()).backward()
        if with_sps:
            assert not out[2].requires_grad
        return hh.grad

    assert torch.equal(grads(True), grads(False))


@pytest.mark.parametrize("fused", [True, False])
def test_no_host_sync(fused):
    torch.manual_seed(5)
    h, w = torch.randn(10, 6), torch.randn(17, 6)
    labels = torch.randint(0, 17, (10,))

    def fn(a, b, y):
        if fused:
            return linear_logprobs(a, b, y, chunk_size=4, vocab_chunk_size=5, with_sum_pi_squared=True)
        return logprobs_from_logits(a @ b.T, y, chunk_size=4, with_sum_pi_squared=True)

    assert_no_host_sync(fn, h, w, labels)


def _rows(vocab=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (3, 3), generator=g).repeat_interleave(2, 0)  # groups of 2 rows share a prompt
    mask = torch.ones(6, 4)
    mask[1, 3:] = 0
    mask[4, 2:] = 0
    return {
        "prompts": prompts,
        "prompt_mask": torch.ones_like(prompts),
        "responses": torch.randint(1, vocab, (6, 4), generator=g) * (mask != 0),
        "mask": mask,
    }


def test_the_old_policy_stage_writes_sum_pi_squared_of_the_models_distribution():
    model, b = tiny_lm(), _rows()
    out = logprob_stage(model, outputs=("old_logp", "entropy", "sum_pi_squared"), temperature=0.8).fn(b)
    two = logprob_stage(model, temperature=0.8).fn(b)
    assert torch.equal(out["old_logp"], two["old_logp"]) and torch.equal(out["entropy"], two["entropy"])
    with torch.no_grad():
        logits = model(input_ids=torch.cat([b["prompts"], b["responses"]], 1)).logits.double() / 0.8
    want = torch.softmax(logits, -1).square().sum(-1)[:, 2:-1]  # position t predicts response token t
    torch.testing.assert_close(out["sum_pi_squared"].double() * b["mask"], want * b["mask"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="outputs: got"):
        logprob_stage(model, outputs=("a", "b", "c", "d"))


def _cfg(out, *extra):
    return load_config(ROOT / "configs" / "grpo_tiny.yaml", [*TINY, f"trainer.output_dir={out}", "trainer.plot=false",
                                                             "rl.advantage=optimal_token_baseline", *extra])  # fmt: skip


def test_the_trainers_advantages_are_the_pure_function_of_the_same_inputs(tmp_path):
    cfg = _cfg(tmp_path, "rl.algo=dapo")
    algo = build_algorithm(cfg)
    needs = algos.scoring_needs(algo)
    assert needs.old_logp and needs.sum_pi_squared and scoring_plan(cfg, algo).old_logp
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(8, 5, generator=g) < 0.8).float()
    mask[:, 0] = 1
    rows = {
        "scores": torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
        "mask": mask,
        "group": torch.tensor([3, 3, 3, 3, 8, 8, 8, 8]),
        "old_logp": -torch.rand(8, 5, generator=g) * 2,
        "sum_pi_squared": torch.rand(8, 5, generator=g) * 0.5 + 0.1,
    }
    stage = advantages_stage(algo, inputs=tuple(rows))
    got = stage.fn(rows)
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # DAPO's shaping first (its overlong penalty, its dynamic-sampling filter), then the estimator.
    shaped = algo.shaping({**rows, "group_ids": group_ids})
    want, _ = algos.optimal_token_baseline_advantages(
        algos.scores_to_token_rewards(shaped["scores"], shaped["mask"]),
        rows["old_logp"],
        rows["sum_pi_squared"],
        shaped["mask"],
        group_ids,
    )
    assert torch.equal(got["advantages"], want) and torch.equal(got["loss_mask"], shaped["mask"])


def test_optimal_token_baseline_runs_from_the_config(tmp_path):
    records = train(_cfg(tmp_path, "trainer.steps=2")).records
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)


@pytest.mark.parametrize(
    ("rl", "key"),
    [
        ({"algo": "ppo"}, "rl.algo"),
        ({"algo": "gdpo"}, "rl.algo"),
        ({"advantage": "otb"}, "rl.advantage"),
    ],
)
def test_bad_combinations_name_their_key(rl, key):
    raw = {
        "model": {"model_name_or_path": {"model_type": "qwen2"}},
        "rl": {"advantage": "optimal_token_baseline", **rl},
    }
    with pytest.raises(ValueError, match=f"config key '{key}'"):
        parse_config(raw)


AGENT = ROOT / "configs" / "agent_calc_tiny.yaml"
AGENT_TINY = [
    "model.model_name_or_path.hidden_size=32",
    "model.model_name_or_path.intermediate_size=64",
    "model.model_name_or_path.num_hidden_layers=1",
    "rl.batch_size=2",
    "rl.mini_batch_size=2",
    "rl.num_rollouts=4",
    "data.digits=2",
    "rl.multi_turn.max_new_tokens=12",
    "rl.multi_turn.max_total_tokens=32",
    "rl.multi_turn.eval_every=0",
    "trainer.warmup_steps=4",
    "trainer.warmup_batch_size=8",
    "trainer.progress=false",
    "trainer.plot=false",
    "trainer.steps=2",
    "rl.advantage=optimal_token_baseline",
]


def _trajectories(seed=0):
    """Two groups of three trajectories: policy turns (mask 1) with tool outputs between them (mask 0),
    each turn's reward on its last policy token; junk (nan) at the observation tokens' rewards."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(
        [
            [1, 1, 0, 0, 1, 1, 1, 0],
            [1, 1, 1, 0, 0, 0, 1, 1],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 0, 0, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 0, 0],
            [1, 1, 0, 1, 0, 1, 0, 1],
        ],
        dtype=torch.float32,
    )
    rewards = torch.zeros(6, 8)
    rewards[torch.arange(6), (mask * torch.arange(1, 9)).argmax(1)] = torch.rand(6, generator=g).round()
    rewards[0, 1], rewards[3, 0] = 0.5, -0.25  # a reward at the end of an earlier turn
    return {
        "scores": rewards.sum(1),
        "rewards": torch.where(mask != 0, rewards, torch.nan),
        "mask": mask,
        "group": torch.tensor([5, 5, 5, 2, 2, 2]),
        "old_logp": -torch.rand(6, 8, generator=g) * 2,
        "sum_pi_squared": torch.rand(6, 8, generator=g) * 0.5 + 0.1,
    }


def test_multi_turn_advantages_are_the_multi_turn_pure_function(tmp_path):
    cfg = load_config(AGENT, [*AGENT_TINY, f"trainer.output_dir={tmp_path}"])
    algo = build_algorithm(cfg)
    assert algos.scoring_needs(algo).sum_pi_squared and scoring_plan(cfg, algo).old_logp
    rows = _trajectories()
    got = advantages_stage(algo, inputs=tuple(rows)).fn(rows)
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    args = (rows["rewards"], rows["old_logp"], rows["sum_pi_squared"], rows["mask"], group_ids)
    want, _ = algos.optimal_token_baseline_advantages(*args, multi_turn=True)
    assert torch.equal(got["advantages"], want) and torch.equal(got["loss_mask"], rows["mask"])
    single, _ = algos.optimal_token_baseline_advantages(*args)
    assert not torch.allclose(want, single)  # the trajectories are lined up by policy token, not by position
    # The observation tokens' values take no part: any old_logp / sum_pi_squared there gives the same advantages.
    holes = rows["mask"] == 0
    junk = {
        **rows,
        "old_logp": rows["old_logp"].masked_fill(holes, -9.0),
        "sum_pi_squared": rows["sum_pi_squared"].masked_fill(holes, 0.9),
    }
    assert torch.equal(advantages_stage(algo, inputs=tuple(junk)).fn(junk)["advantages"], want)


ENVS = """
from rlcore.agent import ToolEnv


def make(tools, **options):
    # Rewards that differ between a prompt's trajectories (the answer's length), so advantages are not all 0.
    return ToolEnv(tools, reward=lambda sample, text: len(text) % 3 / 2, **options)
"""


def test_optimal_token_baseline_trains_a_multi_turn_run(tmp_path):
    (tmp_path / "envs.py").write_text(ENVS)
    overrides = [
        f"rl.multi_turn.env={tmp_path / 'envs.py'}:make",
        "trainer.log_ref_kl_every=1",  # the logged KL to the start (the warmed-up policy) shows the update moved it
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    records = train(load_config(AGENT, [*AGENT_TINY, *overrides])).records
    assert len(records) == 2
    for r in records:
        assert all(torch.isfinite(torch.tensor(r[k])) for k in ("loss", "reward", "kl")), r
        assert r["observation_tokens"] >= 0 and r["policy_tokens"] > 0
    # Step 0 samples from the warmed-up weights (KL 0); its update moved them, so step 1's KL is not 0.
    assert records[0]["kl"] == pytest.approx(0, abs=1e-9) and records[1]["kl"] > 1e-7
