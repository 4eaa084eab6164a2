"""rlcore.train.deploy: the factory picks one Deployment class per mode, and each places and syncs as the trainer needs."""

from __future__ import annotations

import ast
import copy
import pathlib
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

import rlcore.train.deploy as deploy
from rlcore.dataflow import stage
from rlcore.train import (
    ColocatedDeployment,
    Deployment,
    NoRollout,
    PreferencePrompts,
    RayDeployment,
    ReplicaDeployment,
    WorkerDeployment,
    attach_lora,
    build_model,
    load_config,
    make_deployment,
    make_prompt_source,
    task_options,
)
from tiny_runs import TINY

ROOT = pathlib.Path(__file__).resolve().parents[1]
SYNC_KEYS = {"sync_s", "sync_bytes"}
PEAK_KEYS = {"memory/predicted_peak_rollout_bytes", "memory/predicted_peak_train_bytes"}


def _cfg(tmp_path, *extra):
    return load_config(ROOT / "configs" / "grpo_tiny.yaml", [*TINY, f"trainer.output_dir={tmp_path}", *extra])


class _Place:
    """The trainer's pieces a deployment reads: the models, the optimisers, this process's place."""

    def __init__(self, cfg, *, sharded=False, lora=False):
        torch.manual_seed(0)
        self.task = make_prompt_source(cfg, task_options(cfg))
        policy = build_model(cfg, self.task.tokenizer.vocab_size)
        self.replica = copy.deepcopy(policy).eval().requires_grad_(False)
        if lora:
            policy = attach_lora(policy, cfg)
        self.models = SimpleNamespace(policy=policy)
        self.opt = SimpleNamespace(opts=[torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])])
        self.world = SimpleNamespace(rank=0, sharded=sharded)

    def make(self, cfg, engine=None):
        return make_deployment(
            cfg,
            self.models,
            self.opt,
            self.world,
            self.task,
            engine,
            self.replica,
            build_model=build_model,
        )

    def weight_bytes(self):
        return sum(p.numel() * p.element_size() for p in self.replica.parameters())


class _Engine:
    """A user's engine: records the weights it is given."""

    def __init__(self):
        self.loaded = []

    def generate(self, prompts, prompt_mask, *, n, generator):
        raise AssertionError("not sampled here")

    def load_weights(self, params):
        self.loaded.append({k: v.clone() for k, v in params.items()})


class _Worker:
    """Stands in for a rollout worker process or actor: records how it was started and what it received."""

    started: ClassVar[list] = []

    def __init__(self, factory, *, args, threads, **options):
        self.factory, self.args, self.threads, self.options = factory, args, threads, options
        self.versions, self.ready, self.closed = [], None, False
        type(self).started.append(self)

    def wait_ready(self, timeout):
        self.ready = timeout

    def publish(self, version, packet):
        self.versions.append((version, packet.version, packet.nbytes))

    def stage(self, *, inputs, outputs, resource, timeout):
        return stage(lambda b: b, inputs=inputs, outputs=outputs, name="rollout", resource=resource)

    def close(self):
        self.closed = True


class _Process(_Worker):
    started: ClassVar[list] = []


class _Actor(_Worker):
    started: ClassVar[list] = []


@pytest.fixture
def fake_workers(monkeypatch):
    monkeypatch.setattr(deploy, "RolloutWorker", _Process)
    monkeypatch.setattr(deploy, "RayRolloutWorker", _Actor)
    _Process.started.clear()
    _Actor.started.clear()


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _equal_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_offline_dpo_places_nothing(tmp_path):
    place = _Place(_cfg(tmp_path))
    place.task = object.__new__(PreferencePrompts)  # only its kind matters: a preference dataset has no rollout
    dep = place.make(_cfg(tmp_path))
    assert type(dep) is NoRollout and isinstance(dep, Deployment)
    assert dep.rollout is None and dep.switch is None
    assert dep.step_metrics() == {} and dep.rollout_metrics(0) == {}


def test_colocated_on_the_cpu_blocking_shares_the_policy_storage(tmp_path):
    cfg = _cfg(tmp_path)
    place = _Place(cfg)
    dep = place.make(cfg)
    assert type(dep) is ColocatedDeployment and isinstance(dep, Deployment)
    assert dep.switch is None and dep.rollout is not None and dep.rollout.name == "rollout"
    for p, q in zip(place.models.policy.parameters(), place.replica.parameters(), strict=True):
        assert p.data_ptr() == q.data_ptr()
    assert not (SYNC_KEYS | PEAK_KEYS) & set(dep.step_metrics())  # nothing is sent or swapped


def test_colocated_async_swaps_at_each_switch_to_the_rollout(tmp_path, one_rank):
    cfg = _cfg(tmp_path, "deploy.async_infer=true")
    place = _Place(cfg)
    dep = place.make(cfg)
    assert type(dep) is ColocatedDeployment and callable(dep.switch)
    assert set(dep.step_metrics()) == PEAK_KEYS  # predicted peaks from the start; no swap has run yet
    assert all(p.numel() == 0 for p in place.replica.parameters())  # bound to the swap's buckets at each switch
    before = [p.detach().clone() for p in place.models.policy.parameters()]
    dep.switch("device", "train", "rollout")  # the training weights are offloaded, the replica's built
    assert all(torch.equal(p, q) for p, q in zip(place.replica.parameters(), before, strict=True))
    metrics = dep.step_metrics()
    assert set(metrics) == PEAK_KEYS | SYNC_KEYS and metrics["sync_bytes"] == place.weight_bytes()
    dep.switch("device", "rollout", "train")
    assert all(torch.equal(p, q) for p, q in zip(place.models.policy.parameters(), before, strict=True))


def test_a_users_engine_receives_every_version_through_the_sync(tmp_path):
    cfg = _cfg(tmp_path)
    place = _Place(cfg)
    engine = _Engine()
    dep = place.make(cfg, engine)
    assert type(dep) is ReplicaDeployment and isinstance(dep, Deployment) and dep.switch is None
    assert len(engine.loaded) == 1  # version 0 at construction
    named = dict(place.models.policy.named_parameters())
    assert all(torch.equal(v, named[k]) for k, v in engine.loaded[0].items())
    with torch.no_grad():
        next(place.models.policy.parameters()).add_(1.0)
    dep.publish(1)
    name = next(iter(named))
    assert torch.equal(engine.loaded[1][name], named[name])
    metrics = dep.step_metrics()
    assert set(metrics) == SYNC_KEYS and metrics["sync_bytes"] == place.weight_bytes()


@pytest.mark.parametrize(("sharded", "lora"), [(True, False), (False, True)])
def test_a_sharded_or_lora_policy_samples_on_the_replica_fed_by_the_sync(tmp_path, sharded, lora):
    extra = ["model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"] if lora else []
    cfg = _cfg(tmp_path, *extra)
    place = _Place(cfg, sharded=sharded, lora=lora)
    with torch.no_grad():
        for p in place.replica.parameters():
            p.zero_()
    dep = place.make(cfg)
    assert type(dep) is ReplicaDeployment and dep.switch is None and dep.rollout is not None
    policy = place.models.policy.merge_and_unload() if lora else place.models.policy
    assert _equal_weights(place.replica, policy)
    assert set(dep.step_metrics()) == SYNC_KEYS


@pytest.mark.parametrize(
    ("backend", "kind", "worker"), [("local", WorkerDeployment, _Process), ("ray", RayDeployment, _Actor)]
)
def test_disaggregated_starts_one_worker_of_the_backend(tmp_path, fake_workers, backend, kind, worker):
    cfg = _cfg(tmp_path, "deploy.mode=disaggregated", f"deploy.backend={backend}")
    place = _Place(cfg)
    dep = place.make(cfg)
    assert type(dep) is kind and isinstance(dep, Deployment) and dep.switch is None
    assert len(worker.started) == 1 and not (_Actor if worker is _Process else _Process).started
    started = worker.started[0]
    assert started.ready == max(120.0, cfg.deploy.rollout_timeout)  # start-up before the first step
    assert started.args[:2] == (cfg.to_dict(), place.task.tokenizer.vocab_size)
    assert started.versions == [(0, 0, place.weight_bytes())]
    dep.publish(1)
    assert [v[:2] for v in started.versions] == [(0, 0), (1, 1)]
    assert set(dep.step_metrics()) == SYNC_KEYS and dep.rollout.resource == "rollout"
    dep.close()
    assert started.closed


def test_the_trainer_does_not_branch_on_the_deployment_mode():
    """``cfg.deploy.mode`` and ``cfg.deploy.backend`` are read by make_deployment alone."""
    tree = ast.parse((ROOT / "src" / "rlcore" / "train" / "trainer.py").read_text())
    reads = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("mode", "backend")
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "deploy"
    ]
    assert not reads, f"trainer.py reads the deployment mode on lines {reads}"
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "make_deployment"]
    assert len(calls) == 1
