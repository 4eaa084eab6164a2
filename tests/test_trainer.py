"""rlcore.train.trainer: shipped configs run, resume is exact, DP keeps ranks identical, faults stop cleanly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcore import algos
from rlcore.rewards import RewardError
from rlcore.train import (
    TorchEngine,
    build_model,
    load_checkpoint,
    load_config,
    make_task,
    read_metrics,
    save_checkpoint,
    train,
)
from rlcore.train.checkpoint import CHECKPOINT_NAME
from tiny_runs import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    *TINY_MODEL,
    "rl.batch_size=4",
    "rl.mini_batch_size=2",
    "rl.num_rollouts=4",
    "rl.max_new_tokens=6",
    "trainer.warmup_steps=2",
    "trainer.warmup_batch_size=8",
    "trainer.progress=false",
    "trainer.threads=1",
    "deploy.async_infer=false",
    "trainer.reward_workers=0",
]
TIME_KEYS = {"step_time_s", "tokens_per_s_device", "checkpoint_stall_s"}


def tiny(name: str, out: Path, *extra: str):
    overrides = list(TINY) + [f"trainer.output_dir={out}", *extra]
    if name == "dpo_tiny":
        overrides = [o for o in overrides if not o.startswith("rl.num_rollouts")]
    return load_config(ROOT / "configs" / f"{name}.yaml", overrides)


def _timing(key):
    return key in TIME_KEYS or key.startswith(("busy_s/", "bubble/", "sync_s"))


def _curve(records):
    return [{k: v for k, v in r.items() if not _timing(k)} for r in records]


@pytest.mark.parametrize("name", ["grpo_tiny", "ppo_tiny", "dapo_tiny", "dpo_tiny"])
def test_shipped_config_runs_a_few_steps(name, tmp_path):
    run = train(tiny(name, tmp_path, "trainer.steps=2", "trainer.save_every=1"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and _curve(records) == _curve(run.records)
    for r in records:
        for key in ("reward", "entropy", "response_length", "tokens_per_s_device", "loss"):
            assert torch.isfinite(torch.tensor(r[key])), (key, r)
        assert 0 <= r["reward"] <= 1 and 1 <= r["response_length"] <= 6
    assert records[0]["kl"] == pytest.approx(0, abs=1e-6)  # the first rollout is the reference policy
    # Without a KL term (beta 0, DAPO) the reference forward runs every trainer.log_ref_kl_every (10) steps.
    assert ("kl" in records[1]) == (name == "dpo_tiny")
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    state = load_checkpoint(tmp_path)
    assert state["step"] == 1
    assert ("critic" in state) == (name == "ppo_tiny")
    assert state["policy"]["optim"]["state"]  # the optimiser's moments are saved beside the weights
    assert all(torch.equal(v, run.policy.state_dict()[k]) for k, v in state["policy"]["model"].items())


def test_rewards_in_a_worker_process(tmp_path):
    run = train(tiny("grpo_tiny", tmp_path, "trainer.steps=1", "trainer.reward_workers=1", "trainer.plot=false"))
    assert len(run.records) == 1 and 0 <= run.records[0]["reward"] <= 1


def test_resume_equals_an_uninterrupted_run(tmp_path):
    whole = train(tiny("grpo_tiny", tmp_path / "a", "trainer.steps=4", "trainer.plot=false"))
    train(tiny("grpo_tiny", tmp_path / "b", "trainer.steps=2", "trainer.plot=false"))
    resumed = train(tiny("grpo_tiny", tmp_path / "b", "trainer.steps=4", "trainer.plot=false"), resume=True)
    assert [r["step"] for r in resumed.records] == [2, 3]
    assert _curve(read_metrics(tmp_path / "b" / "metrics.jsonl")) == _curve(whole.records)
    for (k, a), b in zip(whole.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), k


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="resume: no checkpoint at"):
        train(tiny("grpo_tiny", tmp_path, "trainer.steps=1"), resume=True)


def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(tmp_path):
    base = algos.grpo()
    calls = []

    def poisoned(logp, old_logp, advantages, mask):
        calls.append(1)
        loss_t, metrics = base.policy_loss(logp, old_logp, advantages, mask)
        return (loss_t * float("nan") if len(calls) > 4 else loss_t), metrics

    cfg = tiny("grpo_tiny", tmp_path, "trainer.steps=5", "trainer.save_every=1", "trainer.plot=false")
    # 2 updates per step: updates 5+ are poisoned, i.e. step 2 fails and steps 0-1 are saved.
    with pytest.raises(FloatingPointError, match=r"step 2: the loss is not finite \(nan\)"):
        train(cfg, algo=base._replace(policy_loss=poisoned))
    state = load_checkpoint(tmp_path)
    assert state["step"] == 1
    assert all(torch.isfinite(v).all() for v in state["policy"]["model"].values())
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]


def test_interrupted_save_leaves_the_last_checkpoint_loadable(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"step": 3, "w": torch.ones(2)})

    def interrupted(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"step": 4})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path)["step"] == 3
    assert (tmp_path / CHECKPOINT_NAME).is_dir()


class Explodes:
    name = "explodes"

    def __call__(self, prompts, responses, **columns):
        raise RuntimeError("verifier crashed")


class BaseReward:
    def forward(self, prompts, responses, **kwargs):
        raise NotImplementedError


class NonEmpty(BaseReward):
    """The seed's style: a forward returning booleans."""

    def forward(self, prompts, responses, **kwargs):
        return [len(r) > 0 for r in responses]


def test_failing_reward_names_the_reward_and_the_step(tmp_path):
    with pytest.raises(
        RewardError, match=r"reward 'explodes' on batch 0 of 16 responses raised RuntimeError: verifier crashed"
    ):
        train(tiny("grpo_tiny", tmp_path, "trainer.steps=1"), reward=Explodes())


class Sleeps:
    name = "sleeps"

    def __call__(self, prompts, responses, **columns):
        import time

        time.sleep(30)
        return [0.0] * len(responses)


def test_reward_timeout_from_the_config_stops_the_run(tmp_path):
    cfg = tiny(
        "grpo_tiny",
        tmp_path,
        "trainer.steps=1",
        "trainer.reward_timeout=0.5",
        "trainer.plot=false",
        "trainer.warmup_steps=0",
    )
    with pytest.raises(
        RewardError, match=r"reward 'sleeps' on batch 0 did not finish within 0.5 s \(the reward timeout\)"
    ):
        train(cfg, reward=Sleeps())


def test_seed_style_reward_and_external_engine(tmp_path):
    class CountingEngine(TorchEngine):
        loads = 0

        def load_weights(self, params):
            CountingEngine.loads += 1

    cfg = tiny("grpo_tiny", tmp_path, "trainer.steps=2", "deploy.mode=disaggregated", "trainer.plot=false")
    probe = train(
        tiny("grpo_tiny", tmp_path / "probe", "trainer.steps=0", "trainer.plot=false", "trainer.warmup_steps=0")
    )
    engine = CountingEngine(probe.policy, eos_token_id=1, max_new_tokens=6)
    run = train(cfg, reward=NonEmpty(), engine=engine)
    assert CountingEngine.loads == 3  # the warmed-up weights, then after each of the 2 updates
    assert all(0 <= r["reward"] <= 1 for r in run.records)


def test_world_size_mismatch_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"'parallel.data_parallel': got 2, expected the launched world size 1"):
        train(tiny("grpo_tiny", tmp_path, "parallel.data_parallel=2"))


WORKER = """
import os, sys, torch
import torch.distributed as dist
from rlcore.train import load_config, train
cfg = load_config(sys.argv[1], sys.argv[3:])
run = train(cfg)
assert not dist.is_initialized()  # the trainer destroyed the group it started
rank = int(os.environ["RANK"])
# FSDP2 shards the policy over the two ranks: each holds half of every parameter's rows.
shards = {k: (v.to_local().shape[0], v.shape[0]) for k, v in run.policy.state_dict().items() if v.dim()}
torch.save({"rank": rank, "shards": shards, "records": run.records}, f"{sys.argv[2]}/rank{rank}.pt")
"""


def test_torchrun_two_ranks_train_one_sharded_model(tmp_path):
    """torchrun: the trainer starts and destroys the group, shards the policy, and saves one full checkpoint."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    overrides = list(TINY) + [
        f"trainer.output_dir={tmp_path / 'out'}",
        "trainer.steps=2",
        "parallel.data_parallel=2",
        "trainer.plot=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(ROOT / "configs" / "grpo_tiny.yaml"),
        str(tmp_path),
        *overrides,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert (r0["rank"], r1["rank"]) == (0, 1)
    for k, (local, full) in r0["shards"].items():
        assert local + r1["shards"][k][0] == full and local < full, k
    assert _curve(r0["records"]) == _curve(r1["records"])  # metrics are reduced over the ranks
    saved = load_checkpoint(tmp_path / "out")["policy"]["model"]  # the DCP shards of both ranks, whole
    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", TINY)
    torch.manual_seed(cfg.trainer.seed)
    init = build_model(
        cfg,
        make_task(
            cfg.data.task, length=cfg.data.length, min_length=cfg.data.min_length, letters=cfg.data.letters
        ).tokenizer.vocab_size,
    )
    moved = [not torch.equal(v, saved[k]) for k, v in init.state_dict().items()]
    assert all(moved) and saved.keys() >= init.state_dict().keys()


def test_bfloat16_model_trains(tmp_path):
    run = train(
        tiny(
            "grpo_tiny",
            tmp_path,
            "trainer.steps=2",
            "model.torch_dtype=bf16",
            "trainer.plot=false",
            "trainer.log_ref_kl_every=1",
        )
    )
    assert next(run.policy.parameters()).dtype == torch.bfloat16
    assert all(torch.isfinite(torch.tensor([r["loss"], r["kl"], r["entropy"]])).all() for r in run.records)


def test_reprobe_reversal_with_no_letters_is_refused_naming_letters():
    # data.letters='' passed the config and failed in the data loader with torch's "random_ expects ...".
    from rlcore.train.tasks import make_task

    with pytest.raises(ValueError, match="letters: got '', expected at least one letter"):
        make_task("reversal", letters="")
