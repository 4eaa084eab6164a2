"""The trainer as a pipeline: equal to the hand-written loop, staleness bounded, weights synced exactly, faults stop it."""

import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch

from rlcore.dataflow import RolloutWorker, StageGraph, WeightSync, run_pipeline
from rlcore.testing.reference import train_loop_ref
from rlcore.train import build_model, load_checkpoint, load_config, make_task, read_metrics, train
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]


def tiny(name, out, *extra):
    overrides = [*TINY, f"trainer.output_dir={out}", *extra]
    if name == "dpo_tiny":
        overrides = [o for o in overrides if not o.startswith("rl.num_rollouts")]
    return load_config(ROOT / "configs" / f"{name}.yaml", overrides)


def by_length(prompts, responses, **columns):
    """A reward with spread from the first step: the response's length."""
    return [len(r) / 6 for r in responses]


@pytest.mark.parametrize("name", ["grpo_tiny", "ppo_tiny"])
def test_blocking_pipeline_reproduces_the_hand_written_loop(name, tmp_path):
    cfg = tiny(name, tmp_path, "trainer.steps=5", "rl.temperature=1.0")
    loop = train_loop_ref(cfg, reward=by_length)
    run = train(cfg, reward=by_length)
    assert len(run.records) == 5
    for record, losses in zip(run.records, loop.losses):
        assert record["loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-6)
        assert record["policy_lag_max"] == 0
        # The sampler's log-probs (KV cache, one row at a time) against the trainer's packed forward, same weights.
        assert 0 <= record["mismatch/logp_abs_mean"] <= record["mismatch/logp_abs_max"] < 1e-4
        assert abs(record["mismatch/kl"]) < 1e-8
    assert any(abs(r["loss"]) > 1e-4 for r in run.records)  # the comparison is not between zeros
    # The trainer's forwards run each group's prompt once (rlcore.models.shared_prefix); the loop packs
    # every row whole: the same maths in another summation order, 2e-6 apart after 5 AdamW steps.
    for (k, a), b in zip(loop.policy.state_dict().items(), run.policy.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=k)
    if loop.critic is not None:
        for (k, a), b in zip(loop.critic.state_dict().items(), run.critic.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("mode", ["co-located", "disaggregated"])
def test_async_rollout_never_exceeds_the_staleness_bound(mode, tmp_path):
    cfg = tiny("grpo_tiny", tmp_path, "trainer.steps=4", "deploy.async_infer=true", f"deploy.mode={mode}")
    run = train(cfg, reward=by_length)  # advantages from the first step: the weights move
    lags = [r["policy_lag_max"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert len(lags) == 4 and max(lags) <= 1 and min(lags) >= 0
    assert [r["step"] for r in run.records] == [0, 1, 2, 3]
    assert all(r["sync_bytes"] > 0 and r["sync_s"] >= 0 for r in run.records)
    # rl.behaviour_weights auto: the decoupled objective weighs each token by pi_old / pi_rollout (capped at 2).
    assert all(0 < r["behaviour_weight"] <= 2.0 and r["mismatch/logp_abs_max"] >= 0 for r in run.records)
    lagged = [r for r in run.records if r["policy_lag"] > 0]
    assert lagged and all(r["mismatch/logp_abs_max"] > 1e-3 and r["behaviour_weight"] != 1.0 for r in lagged)
    assert any(k.startswith("bubble/") for k in run.records[-1]) and any(
        k.startswith("busy_s/") for k in run.records[-1]
    )


@pytest.mark.parametrize("mode", ["co-located", "disaggregated"])
def test_async_at_staleness_zero_reproduces_the_blocking_pipeline(mode, tmp_path):
    """Staleness 0: the async scheduler, the decoupled objective (weights exp(old - rollout) = 1 up to the engine's
    rounding) and the old-policy forward inside the update give the blocking pipeline's losses and parameters."""
    run = ["trainer.steps=3", f"deploy.mode={mode}"]
    blocking = train(tiny("grpo_tiny", tmp_path / "b", *run), reward=by_length)
    overlapped = train(
        tiny("grpo_tiny", tmp_path / "a", *run, "deploy.async_infer=true", "deploy.staleness=0"), reward=by_length
    )
    assert all(r["policy_lag_max"] == 0 for r in overlapped.records)
    assert all(abs(r["behaviour_weight"] - 1) < 1e-5 for r in overlapped.records)
    for a, b in zip(blocking.records, overlapped.records):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert any(abs(r["loss"]) > 1e-4 for r in blocking.records)
    for (k, x), y in zip(blocking.policy.state_dict().items(), overlapped.policy.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=k)


def test_disaggregated_blocking_run_equals_the_colocated_one(tmp_path):
    a = train(tiny("grpo_tiny", tmp_path / "a", "trainer.steps=2"))
    b = train(tiny("grpo_tiny", tmp_path / "b", "trainer.steps=2", "deploy.mode=disaggregated"))
    assert [r["loss"] for r in a.records] == [r["loss"] for r in b.records]
    for (k, x), y in zip(a.policy.state_dict().items(), b.policy.state_dict().values()):
        assert torch.equal(x, y), k


def echo_weights_factory(cfg_dict, vocab_size):
    """In the worker: a tiny model whose 'generate' returns its own parameters, flattened, for every row."""
    from rlcore.train import build_model
    from rlcore.train.config import parse_config

    model = build_model(parse_config(cfg_dict), vocab_size)
    params = dict(model.named_parameters())

    def generate(batch, weights):
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(weights[name])
        flat = torch.cat([p.detach().reshape(-1) for p in params.values()])
        return {"weights": flat.expand(batch["prompts"].shape[0], -1).clone()}

    return generate


def test_worker_weights_equal_the_trainers_after_every_sync(tmp_path):
    cfg = tiny("grpo_tiny", tmp_path)
    vocab = make_task(cfg.data.task, length=4, min_length=2, letters="abcdef").tokenizer.vocab_size
    torch.manual_seed(0)
    policy = build_model(cfg, vocab)
    sync = WeightSync(dict(policy.named_parameters()), bucket_bytes=16 << 10)
    assert len(sync.plan.buckets) > 1  # several buckets travel
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    seen = []
    with RolloutWorker(echo_weights_factory, args=(cfg.to_dict(), vocab)) as worker:
        sync.sync(0, lambda p: worker.publish(0, p))

        def update(b):
            loss = sum(p.sum() for p in policy.parameters())
            opt.zero_grad()
            loss.backward()
            opt.step()
            return {"loss": torch.zeros(b["weights"].shape[0])}

        def end(j):
            seen.append(torch.cat([p.detach().reshape(-1).clone() for p in policy.parameters()]))
            sync.sync(j + 1, lambda p: worker.publish(j + 1, p))

        from rlcore.dataflow import stage

        graph = StageGraph(
            [
                worker.stage(inputs=["prompts"], outputs=["weights"]),
                stage(update, inputs=["weights"], outputs=["loss"], role="update", on_iteration_end=end),
            ]
        )
        res = run_pipeline(
            graph, lambda j: {"prompts": torch.zeros(2)}, num_prompts=2, num_iterations=3, collect=["weights"]
        )
    start = torch.cat([p.detach().reshape(-1) for p in build_model_at_init(cfg, vocab).parameters()])
    expected = [start, *seen[:-1]]
    for j, b in enumerate(res.batches):
        assert torch.equal(b["weights"][0], expected[j]), j  # bit for bit, version j
    assert all(r.nbytes == sum(x.numel() * x.element_size() for x in sync.buffers) for r in sync.records)


def build_model_at_init(cfg, vocab):
    torch.manual_seed(0)
    return build_model(cfg, vocab)


class KillsTheWorker:
    """A reward that kills the rollout worker process while scoring step 2."""

    name = "kills"

    def __call__(self, prompts, responses, **columns):
        if self.calls == 2:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGKILL)
        self.calls += 1
        return [1.0 if r else 0.0 for r in responses]

    calls = 0


def test_killed_rollout_worker_stops_the_run_naming_the_stage(tmp_path):
    cfg = tiny(
        "grpo_tiny",
        tmp_path,
        "trainer.steps=6",
        "trainer.save_every=1",
        "deploy.mode=disaggregated",
        "deploy.rollout_timeout=600",  # far away: death is seen at once, not by timing out
    )
    with pytest.raises(RuntimeError, match=r"stage 'rollout': rollout worker process exited with code -9"):
        train(cfg, reward=KillsTheWorker())
    assert multiprocessing.active_children() == []  # no orphan
    assert load_checkpoint(tmp_path)["step"] == 2  # step 2 finished before the rollout of step 3 failed


@pytest.mark.parametrize("name", ["grpo_tiny", "ppo_tiny", "dapo_tiny", "dpo_tiny"])
def test_resume_is_bit_exact_for_every_shipped_config(name, tmp_path):
    whole = train(tiny(name, tmp_path / "a", "trainer.steps=4"))
    train(tiny(name, tmp_path / "b", "trainer.steps=2"))
    resumed = train(tiny(name, tmp_path / "b", "trainer.steps=4"), resume=True)
    timing = ("busy_s/", "bubble/", "sync_s", "step_time_s", "tokens_per_s_device")

    def keep(r):
        return {k: v for k, v in r.items() if not k.startswith(timing)}

    assert [keep(r) for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [keep(r) for r in whole.records]
    for (k, a), b in zip(whole.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), k
    if whole.critic is not None:
        for (k, a), b in zip(whole.critic.state_dict().items(), resumed.critic.state_dict().values()):
            assert torch.equal(a, b), k
