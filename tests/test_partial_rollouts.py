"""Interruptible (partial) rollouts: new weights taken between two tokens, each token's version recorded."""

import copy
import time

import pytest
import torch

from rlcore.dataflow import RolloutWorker
from rlcore.testing.reference import partial_greedy_ref, response_logprobs_ref
from rlcore.train import generate, left_pad, parse_config
from rlcore.train.stages import rollout_columns
from tiny_runs import tiny_lm

EOS, PAD, VOCAB = 1, 0, 12
PROMPTS = [[2, 3, 4, 5], [6, 7], [8, 9, 10]]


def tiny_model(seed, dtype=torch.float32):
    return tiny_lm(dtype, seed, VOCAB)


def scripted(engine_model, versions, switches):
    """A refresh that loads ``versions[k]``'s weights into the engine's model at response position ``switches[k-1]``."""
    calls = []

    def refresh():
        calls.append(None)
        position = len(calls)  # asked before positions 1, 2, ...
        if position in switches:
            v = switches.index(position) + 1
            engine_model.load_state_dict(versions[v].state_dict())
            return v
        return None

    return refresh


def never():
    return None


def test_never_interrupted_is_the_plain_rollout_exactly():
    model = tiny_model(0)
    ids, mask = left_pad(PROMPTS, PAD)
    kw = dict(eos_token_id=EOS, max_new_tokens=6, n=2, temperature=1.0)
    plain = generate(model, ids, mask, generator=torch.Generator().manual_seed(5), **kw)
    part = generate(model, ids, mask, generator=torch.Generator().manual_seed(5), refresh=never, version=3, **kw)
    for a, b in zip(plain[:5], part[:5]):
        assert torch.equal(a, b)
    assert plain.versions is None
    assert torch.equal(part.versions, 3 * part.mask)


def test_interruption_with_the_same_weights_keeps_the_tokens():
    """Dropping the cache and re-encoding prompt + tokens changes nothing but the rounding of the log-probs."""
    model = tiny_model(0)
    ids, mask = left_pad(PROMPTS, PAD)
    kw = dict(eos_token_id=EOS, max_new_tokens=8, n=2, temperature=1.0)
    plain = generate(model, ids, mask, generator=torch.Generator().manual_seed(1), **kw)
    same = scripted(model, [model, model, model], [2, 5])
    part = generate(model, ids, mask, generator=torch.Generator().manual_seed(1), refresh=same, **kw)
    assert torch.equal(plain.responses, part.responses) and torch.equal(plain.mask, part.mask)
    torch.testing.assert_close(plain.logp, part.logp, atol=1e-5, rtol=0)
    width = part.mask.shape[1]
    expected = torch.tensor([min(sum(1 for s in (2, 5) if s <= t), 2) for t in range(width)])
    assert torch.equal(part.versions, expected * part.mask)


@pytest.mark.parametrize("switches", [[1], [3], [2, 4]])
def test_greedy_partial_rollout_equals_the_loop_reference(switches):
    versions = [tiny_model(s) for s in range(3)]
    engine = copy.deepcopy(versions[0])
    ids, mask = left_pad(PROMPTS, PAD)
    r = generate(
        engine,
        ids,
        mask,
        eos_token_id=EOS,
        max_new_tokens=6,
        temperature=0.0,
        refresh=scripted(engine, versions, switches),
    )
    expected = partial_greedy_ref(versions, switches, PROMPTS, eos_token_id=EOS, max_new_tokens=6)
    for i, (tokens, vs) in enumerate(expected):
        on = r.mask[i] == 1
        assert r.responses[i][on].tolist() == tokens
        assert r.versions[i][on].tolist() == vs
        assert bool((r.versions[i][~on] == 0).all())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_sampled_tokens_carry_the_log_prob_of_the_version_that_drew_them(dtype, tol):
    versions = [tiny_model(s, dtype) for s in range(3)]
    engine = copy.deepcopy(versions[0])
    ids, mask = left_pad(PROMPTS, PAD)
    kw = dict(eos_token_id=EOS, max_new_tokens=7, n=2, temperature=1.0)
    plain = generate(versions[0], ids, mask, generator=torch.Generator().manual_seed(2), **kw)
    r = generate(
        engine, ids, mask, generator=torch.Generator().manual_seed(2), refresh=scripted(engine, versions, [2, 4]), **kw
    )
    # Before the first switch the rollout is the uninterrupted one's: same draws, same weights.
    assert torch.equal(r.responses[:, :2], plain.responses[:, :2])
    for i in range(r.responses.shape[0]):
        on = r.mask[i] == 1
        prompt, response = PROMPTS[i // 2], r.responses[i][on].tolist()
        for t, v in enumerate(r.versions[i][on].tolist()):
            assert v == min(sum(1 for s in (2, 4) if s <= t), 2)
            expected = response_logprobs_ref(versions[v], prompt, response)[t]
            assert abs(float(r.logp[i, t]) - expected) <= tol


def test_rollout_columns_take_the_oldest_token_as_the_rows_version():
    model = tiny_model(0)
    engine = copy.deepcopy(model)
    ids, mask = left_pad(PROMPTS, PAD)
    r = generate(
        engine,
        ids,
        mask,
        eos_token_id=EOS,
        max_new_tokens=6,
        temperature=0.0,
        refresh=scripted(engine, [model, tiny_model(1)], [3]),
        version=0,
    )
    cols = rollout_columns(r, {"policy_version": torch.zeros(3, dtype=torch.int64)})
    assert torch.equal(cols["token_version"], r.versions) and cols["token_version"].dtype == torch.int64
    assert cols["version"].tolist() == [0, 0, 0]
    # Without interruptions: the call's version on every policy token.
    plain = generate(model, ids, mask, eos_token_id=EOS, max_new_tokens=6, temperature=0.0)
    cols = rollout_columns(plain, {"policy_version": torch.tensor([4, 4, 4])})
    assert torch.equal(cols["token_version"], 4 * plain.mask) and cols["version"].tolist() == [4, 4, 4]


def seen_versions_factory(last):
    """In the worker: a generate that polls its LatestWeights until version ``last`` arrives, and returns what it saw."""

    def fn(batch, params, latest):
        seen = [latest.version]
        end = time.monotonic() + 60
        while latest.version < last and time.monotonic() < end:
            if latest():
                seen.append(latest.version)
            time.sleep(0.01)
        return {"seen": torch.tensor(seen), "w": params["w"].clone()}

    return fn


def test_an_interruptible_worker_sees_versions_published_after_its_rows_stamp():
    with RolloutWorker(seen_versions_factory, args=(2,), interruptible=True, join_timeout=5.0) as worker:
        worker.publish(0, {"w": torch.zeros(2)})
        stage = worker.stage(inputs=["x"], outputs=["seen", "w"])
        for v in (1, 2):
            worker.publish(v, {"w": torch.full((2,), float(v))})
        out = stage.fn({"x": torch.zeros(2), "policy_version": torch.zeros(2, dtype=torch.int64)})
    seen = out["seen"].tolist()
    assert seen[0] == 0 and seen[-1] == 2 and seen == sorted(seen)
    assert out["w"].tolist() == [0.0, 0.0]  # params: the stamped version's, the newer ones through latest


BASE = {"model": {"model_name_or_path": {"model_type": "qwen2"}}}


@pytest.mark.parametrize(
    "deploy, key",
    [
        ({"partial_rollouts": True}, "deploy.async_infer"),
        ({"partial_rollouts": True, "async_infer": True}, "deploy.mode"),
        ({"partial_rollouts": True, "async_infer": True, "mode": "disaggregated", "backend": "ray"}, "deploy.backend"),
    ],
)
def test_partial_rollouts_need_an_async_local_worker(deploy, key):
    with pytest.raises(ValueError, match=f"config key '{key}'.*deploy.partial_rollouts true"):
        parse_config({**BASE, "deploy": deploy})
    assert parse_config(
        {**BASE, "deploy": {"partial_rollouts": True, "async_infer": True, "mode": "disaggregated"}}
    ).deploy.partial_rollouts


def tiny(out, *extra):
    from pathlib import Path

    from rlcore.train import load_config
    from tiny_runs import TINY

    root = Path(__file__).resolve().parents[1]
    return load_config(root / "configs" / "grpo_tiny.yaml", [*TINY, f"trainer.output_dir={out}", *extra])


def by_length(prompts, responses, **columns):
    return [len(r) / 6 for r in responses]


ASYNC = ["deploy.mode=disaggregated", "deploy.async_infer=true"]


def test_partial_rollouts_at_staleness_zero_change_nothing(tmp_path):
    from rlcore.train import train

    run = ["trainer.steps=3", *ASYNC, "deploy.staleness=0"]
    whole = train(tiny(tmp_path / "w", *run), reward=by_length)
    part = train(tiny(tmp_path / "p", *run, "deploy.partial_rollouts=true"), reward=by_length)
    assert [r["loss"] for r in whole.records] == [r["loss"] for r in part.records]
    assert any(abs(r["loss"]) > 1e-4 for r in whole.records)
    for (k, x), y in zip(whole.policy.state_dict().items(), part.policy.state_dict().values()):
        assert torch.equal(x, y), k


def test_every_token_stays_within_the_staleness_bound(tmp_path):
    from rlcore.train import train

    run = train(
        tiny(tmp_path, "trainer.steps=4", *ASYNC, "deploy.staleness=2", "deploy.partial_rollouts=true"),
        reward=by_length,
    )
    assert [r["step"] for r in run.records] == [0, 1, 2, 3]
    for r in run.records:
        assert 0 <= r["token_lag"] <= r["token_lag_max"] <= 2
        assert r["token_lag_max"] <= r["policy_lag_max"]  # a row's lag is its oldest token's
        assert sum(r[f"token_lag/{k}"] for k in range(3)) == pytest.approx(1.0)
    assert any(r["token_lag_max"] > 0 for r in run.records)


# --- rl.prox_logp interpolate: the proximal log-probs from each token's version -----------------------


def test_interpolated_old_policy_follows_the_tokens_versions():
    from rlcore.algos import interpolated_prox_logp
    from rlcore.train import old_policy_interpolated

    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
    rollout = torch.tensor([[-2.0, -1.0, -0.5], [-0.9, -0.2, -1.4]])
    b = {
        "iteration": torch.tensor([12, 12]),
        "token_version": torch.tensor([[0, 1, 2], [2, 2, 2]]),  # run started at step 10: step 12 is version 2
        "rollout_logp": rollout,
    }
    forward = old_policy_interpolated(lambda rows: {"logp": logp.clone().requires_grad_()}, updates=4, start=10)
    first, second = forward(b), forward(b)
    # The first update trains the proximal weights: old_logp is its own logp wherever the token is older.
    assert torch.equal(first["old_logp"][0, :2], logp[0, :2])
    # A token of the step's own version is anchored at the sampler's log-prob.
    assert torch.equal(first["old_logp"][1], rollout[1]) and torch.equal(second["old_logp"][1], rollout[1])
    want = interpolated_prox_logp(rollout, logp, behav_version=b["token_version"], prox_version=2, version=2.25)
    assert torch.equal(second["old_logp"], want) and not second["old_logp"].requires_grad
    # A token 2 versions old after one of four updates: 2 / 2.25 of the way from the sampler to the current policy.
    assert float(second["old_logp"][0, 0]) == pytest.approx(-2.0 + (2 / 2.25) * (-1.0 + 2.0))
    # The next step starts at update 0 again: the proximal weights are the current ones.
    third = forward({**b, "iteration": torch.tensor([13, 13])})
    assert torch.equal(third["old_logp"], logp)


def test_prox_interpolate_needs_async_with_behaviour_weights():
    with pytest.raises(ValueError, match="config key 'rl.prox_logp'"):
        parse_config({**BASE, "rl": {"prox_logp": "interpolate"}})
    with pytest.raises(ValueError, match="config key 'rl.prox_logp'"):
        parse_config(
            {**BASE, "rl": {"prox_logp": "interpolate", "behaviour_weights": "none"}, "deploy": {"async_infer": True}}
        )


def test_a_run_with_interpolated_proximal_log_probs_runs_no_old_policy_forward(tmp_path):
    from rlcore.train import build_algorithm, scoring_plan, train

    extra = ["trainer.steps=3", *ASYNC, "rl.prox_logp=interpolate", "deploy.partial_rollouts=true"]
    cfg = tiny(tmp_path, *extra)  # TINY: 2 updates per batch
    plan = scoring_plan(cfg, build_algorithm(cfg))
    assert not plan.old_logp and plan.interpolate == 2 and not plan.old_in_update
    run = train(cfg, reward=by_length)
    assert [r["step"] for r in run.records] == [0, 1, 2]
    assert all(0 < r["behaviour_weight"] <= 2.0 for r in run.records)
