"""Co-located vLLM with ``deploy.async_infer``: the rollout overlaps the update on its own thread, versions load at its start.

The trainer runs use a 1-layer model of ``configs/grpo_tiny_vllm.yaml``'s shape. The
pending-version and sleep-switch logic is also checked with stand-ins (vLLM's sleep mode
needs CUDA, ROCm or XPU, which this suite does not have).
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlcore.dataflow import WeightPacket, WeightSync
from rlcore.train import PendingVersions, VLLMDeployment, load_config, read_metrics, sleep_mode_available, train
from tiny_runs import QUIET, TINY_BATCH, TINY_ROLLOUT

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "model.model_name_or_path.intermediate_size=64",
    "model.model_name_or_path.num_hidden_layers=1",
    "deploy.vllm.kv_cache_memory_bytes=16777216",
    "deploy.vllm.max_num_seqs=16",
    "rl.temperature=1.0",
    "trainer.steps=3",
]


def vllm_cfg(out, *extra):
    return load_config(
        ROOT / "configs" / "grpo_tiny_vllm.yaml",
        [*TINY_BATCH, *TINY_ROLLOUT, *QUIET, *SMALL, f"trainer.output_dir={out}", *extra],
    )


def by_length(prompts, responses, **columns):
    """A reward with spread from the first step: the response's length."""
    return [len(r) / 6 for r in responses]


def test_colocated_vllm_async_at_staleness_zero_equals_blocking_and_staleness_one_keeps_the_bound(tmp_path):
    blocking = train(vllm_cfg(tmp_path / "b"), reward=by_length)
    # Staleness 0, the decoupled objective off: vLLM's log-probs are the trainer's to ~1e-5 only, and its
    # weights exp(old - rollout), that far from 1, would move Adam's small steps by more than the rounding.
    zero = train(
        vllm_cfg(tmp_path / "z", "deploy.async_infer=true", "deploy.staleness=0", "rl.behaviour_weights=none"),
        reward=by_length,
    )
    assert all(r["policy_lag_max"] == 0 for r in zero.records)
    assert [r["reward"] for r in blocking.records] == [r["reward"] for r in zero.records]
    for a, b in zip(blocking.records, zero.records):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert any(abs(r["loss"]) > 1e-4 for r in blocking.records)
    for (k, x), y in zip(blocking.policy.state_dict().items(), zero.policy.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=k)

    one = train(
        vllm_cfg(tmp_path / "o", "deploy.async_infer=true", "deploy.staleness=1", "trainer.steps=4"), reward=by_length
    )
    lags = [r["policy_lag_max"] for r in read_metrics(tmp_path / "o" / "metrics.jsonl")]
    assert len(lags) == 4 and min(lags) >= 0 and max(lags) <= 1
    assert max(lags) == 1  # a rollout ran on the version before the update's: it overlapped
    # Each row sampled by the version it records: vLLM's log-probs are the old policy's where the lag is 0,
    # and a step's rows sampled a version behind are off by the update between them.
    assert all(r["mismatch/logp_abs_max"] < 1e-3 for r in one.records if r["policy_lag_max"] == 0)
    lagged = [r for r in one.records if r["policy_lag"] > 0]
    assert lagged and all(r["mismatch/logp_abs_max"] > 1e-3 for r in lagged), [
        (r["policy_lag"], r["mismatch/logp_abs_max"]) for r in one.records
    ]
    assert all(r["sync_bytes"] > 0 for r in one.records)
    assert all(0 < r["behaviour_weight"] <= 2.0 for r in one.records)  # rl.behaviour_weights auto: on


def _packet(version: int, value: float) -> WeightPacket:
    return WeightPacket(version, (torch.full((3,), value),), (("w",),), (((3,),),))


def test_pending_versions_load_the_stamped_version_once_and_forget_older_ones():
    got: list[tuple[int, float]] = []
    pending = PendingVersions(lambda p: got.append((p.version, p.buffers[0][0].item())), copy=True)
    pending(_packet(0, 0.0))
    pending.load(0)
    pending.load(0)  # already in the engine: not loaded again
    pending(_packet(1, 1.0))
    pending(_packet(2, 2.0))
    pending.load(1)  # a row stamped 1 while 2 is published: version 1, not the newest
    pending.load(2)
    assert got == [(0, 0.0), (1, 1.0), (2, 2.0)] and pending.loaded == 2 and not pending.packets
    with pytest.raises(ValueError, match=r"version: got 1, expected one of the published versions \[\]"):
        pending.load(1)
    assert pending.loaded == 2  # unchanged


def test_pending_versions_copy_each_packet_the_sync_refills_its_buffers():
    w = {"w": torch.zeros(3)}
    sync = WeightSync(w)
    got: list[float] = []
    pending = PendingVersions(lambda p: got.append(p.buffers[0][0].item()), copy=True)
    sync.sync(1, pending)
    w["w"].fill_(5.0)
    sync.sync(2, pending)  # the same buffers, refilled, before version 1 is loaded
    pending.load(1)
    pending.load(2)
    assert got == [0.0, 5.0]


def test_pending_versions_are_safe_across_a_publishing_and_a_loading_thread():
    loaded: list[int] = []
    pending = PendingVersions(lambda p: loaded.append(p.version), copy=False)
    pending(_packet(0, 0.0))

    def publish() -> None:
        for v in range(1, 200):
            pending(_packet(v, float(v)))

    t = threading.Thread(target=publish)
    t.start()
    t.join(timeout=60)
    for v in range(0, 200, 7):
        pending.load(v)
    assert loaded == list(range(0, 200, 7)) and min(pending.packets) == 197


class _Engine:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self) -> None:
        self.calls.append("wake")


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_switch_sleeps_in_train_wakes_for_the_rollout_and_reloads_dropped_weights(level):
    """The deployment's switch (vLLM's sleep mode needs an accelerator: the engine here records its calls)."""
    engine, got = _Engine(), []
    pending = PendingVersions(lambda p: got.append(p.version), copy=False, keep_last=level == 2)
    policy = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1, momentum=0.9)
    deployment = SimpleNamespace(engine=engine, pending=pending)
    switch = VLLMDeployment._sleep_switch(deployment, policy, opt, level)  # type: ignore[arg-type]
    pending(_packet(0, 0.0))
    switch("device", None, "rollout")  # built awake: nothing to wake
    assert policy.weight.untyped_storage().nbytes() == 0  # the trainer's state is on the host meanwhile
    pending.load(0)
    switch("device", "rollout", "train")
    switch("device", "train", "train")  # no change of phase: still asleep, once
    policy(torch.ones(1, 3)).sum().backward()
    opt.step()
    momentum = opt.state[policy.weight]["momentum_buffer"].clone()
    switch("device", "train", "rollout")
    assert opt.state[policy.weight]["momentum_buffer"].untyped_storage().nbytes() == 0
    pending.load(0)  # no new version: level 2 dropped the weights, so they load again
    switch("device", "rollout", "train")
    assert torch.equal(opt.state[policy.weight]["momentum_buffer"], momentum)
    pending(_packet(1, 1.0))  # published while asleep: waits for the rollout
    switch("device", "train", "rollout")
    pending.load(1)
    assert engine.calls == [f"sleep {level}", "wake", f"sleep {level}", "wake"]
    assert got == ([0, 0, 1] if level == 2 else [0, 1])
    assert deployment.staging is not None  # a background save copies from the switch's offload


def test_the_cpu_platform_has_no_sleep_mode_and_the_run_says_so_once(tmp_path, capfd):
    assert not sleep_mode_available()
    from rlcore.train import deploy

    deploy._NOTED.clear()
    deploy._note_resident_engine(1, False)
    deploy._note_resident_engine(1, False)
    err = capfd.readouterr().err
    assert err.count("vLLM's platform here has no sleep mode") == 1
