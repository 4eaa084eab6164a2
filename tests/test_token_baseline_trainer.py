"""rl.advantage: optimal_token_baseline from the config, and the log-prob ops' sum_pi_squared output it reads.

The ops give ``sum_v pi(v)^2`` only when asked (the loop reference agrees; logp, entropy
and their gradients are unchanged; no host sync); the old-policy stage writes it; the
trainer's advantages are the pure function of the same inputs; a short run trains."""

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
        ({"multi_turn": {}}, "rl.multi_turn"),
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
