"""The disaggregated rollout on Ray: weights synced exactly through the object store, the trainer unchanged, faults stop it."""

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from ray import cloudpickle

import rlcore.train.deploy
from restart_helpers import restart_pipeline
from rlcore.dataflow import RayRolloutWorker, StageGraph, WeightSync, run_pipeline, stage
from rlcore.train import build_model, load_checkpoint, load_config, make_task, train
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]

# The actors cannot import this test module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def ray_session():
    import ray  # the test extra installs Ray: a missing Ray is a failure, not a skip

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def tiny(out, *extra):
    return load_config(ROOT / "configs" / "grpo_tiny.yaml", [*TINY, f"trainer.output_dir={out}", *extra])


def echo_weights_factory(cfg_dict, vocab_size):
    """In the actor: a tiny model whose 'generate' returns its own parameters, flattened, for every row."""
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


def flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def test_actor_weights_equal_the_trainers_after_every_sync(ray_session, tmp_path):
    cfg = tiny(tmp_path)
    vocab = make_task(cfg.data.task, length=4, min_length=2, letters="abcdef").tokenizer.vocab_size
    torch.manual_seed(0)
    policy = build_model(cfg, vocab)
    sync = WeightSync(dict(policy.named_parameters()), bucket_bytes=16 << 10)
    assert len(sync.plan.buckets) > 1  # several buckets travel
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    at_version = {0: flat(policy)}
    with RayRolloutWorker(echo_weights_factory, args=(cfg.to_dict(), vocab)) as worker:
        worker.wait_ready(timeout=300)
        sync.sync(0, lambda p: worker.publish(0, p))

        def update(b):
            loss = sum(p.sum() for p in policy.parameters())
            opt.zero_grad()
            loss.backward()
            opt.step()
            return {"loss": torch.zeros(b["weights"].shape[0])}

        def end(j):
            at_version[j + 1] = flat(policy)
            sync.sync(j + 1, lambda p: worker.publish(j + 1, p))

        graph = StageGraph(
            [
                worker.stage(inputs=["prompts"], outputs=["weights"], micro_batch=1),
                stage(update, inputs=["weights"], outputs=["loss"], role="update", on_iteration_end=end),
            ]
        )
        # Staleness 1: versions may be published before the rows stamped with older ones are generated.
        res = run_pipeline(
            graph,
            lambda j: {"prompts": torch.zeros(2)},
            num_prompts=2,
            num_iterations=4,
            staleness=1,
            collect=["weights", "policy_version"],
        )
        # Two versions waiting when rows stamped with the first arrive: the actor applies exactly the stamped one.
        for v in (5, 6):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(1.0)
            at_version[v] = flat(policy)
            sync.sync(v, lambda p: worker.publish(v, p))
        call = worker.stage(inputs=["prompts"], outputs=["weights"]).fn
        for v in (5, 6):
            assert torch.equal(
                call({"prompts": torch.zeros(1), "policy_version": torch.tensor([v])})["weights"][0], at_version[v]
            )
        assert worker.pid is not None and worker.pid != os.getpid()
    assert len(res.batches) == 4
    for j, b in enumerate(res.batches):
        for row, version in zip(b["weights"], b["policy_version"].tolist()):
            assert j - 1 <= version <= j
            assert torch.equal(row, at_version[int(version)]), (j, version)  # bit for bit
    assert all(not torch.equal(at_version[v], at_version[v + 1]) for v in range(4))  # the weights did change
    assert [r.version for r in sync.records] == [0, 1, 2, 3, 4, 5, 6]
    assert all(r.nbytes == sum(x.numel() * x.element_size() for x in sync.buffers) for r in sync.records)


def broken_factory():
    raise OSError("no model here")


def test_actor_errors_name_the_stage_and_versions_are_checked(ray_session):
    with RayRolloutWorker(broken_factory) as worker:
        with pytest.raises(OSError, match="no model here") as info:
            worker.wait_ready(timeout=300, name="gen")
        assert "rollout worker actor of stage 'gen'" in "".join(getattr(info.value, "__notes__", []))
        with pytest.raises(ValueError, match=r"version: got 1, expected 0"):
            worker.publish(1, {"w": torch.ones(1)})
        call = worker.stage(inputs=["x"], outputs=["y"]).fn
        with pytest.raises(ValueError, match=r"stage 'rollout': rows stamped with policy version 0, but only up to -1"):
            call({"x": torch.ones(1), "policy_version": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"threads: got 0, expected a positive int"):
        RayRolloutWorker(broken_factory, threads=0)


def dying_factory(marker_dir, deaths, at):
    """In the actor: responses = prompts * w + 0.5; the first ``deaths`` calls from version ``at`` on kill the actor."""

    def generate(batch, params):
        # From version `at` on: a call handed back may be taken again at a later version (the run goes on).
        if int(batch["policy_version"].max()) >= at and len(os.listdir(marker_dir)) < deaths:
            Path(marker_dir, f"death{len(os.listdir(marker_dir))}").touch()
            os._exit(9)  # mid-call, as an OOM kill or a segfault would
        return {"responses": batch["prompts"].double() * params["w"] + 0.5}

    return generate


def test_a_dead_actor_is_replaced_and_its_rows_handed_back_and_redone_with_their_version(ray_session, tmp_path):
    with (
        RayRolloutWorker(dying_factory, args=(str(tmp_path), 2, 2), max_restarts=2) as worker,
        pytest.warns(RuntimeWarning, match=r"stage 'rollout': the rollout worker actor died \(\w+\); restarting it"),
    ):
        res = restart_pipeline(worker)
        assert worker.restarts == 2 and len(set(worker.restart_causes)) == 1
    calls = [t for t in res.tasks if t.stage == "rollout"]
    for j, b in enumerate(res.batches):
        assert b["prompts"].tolist() == [10 * j + i for i in range(6)]  # every row once, none lost
        # version v means weights w = 1 + v: the replacement got exactly the versions the rows record
        torch.testing.assert_close(b["responses"], b["prompts"].double() * (1 + b["policy_version"]) + 0.5)
        rows = torch.cat([t.rows for t in calls if t.iteration == j])
        assert sorted(rows.tolist()) == list(range(6))  # the dock delivered each row to one finished call


def test_past_max_restarts_a_dead_actor_stops_the_run_with_the_named_error(ray_session, tmp_path):
    with (
        RayRolloutWorker(dying_factory, args=(str(tmp_path), 2, 1), max_restarts=1) as worker,
        pytest.raises(RuntimeError, match=r"stage 'rollout': rollout worker actor died .*\(after 1 restart, the most"),
        pytest.warns(RuntimeWarning, match=r"restarting it \(1 of at most 1\)"),
    ):
        restart_pipeline(worker)
    with pytest.raises(ValueError, match=r"max_restarts: got -1, expected an int >= 0"):
        RayRolloutWorker(dying_factory, args=("", 0, 0), max_restarts=-1)


def test_ray_disaggregated_blocking_run_equals_the_colocated_one(ray_session, tmp_path):
    a = train(tiny(tmp_path / "a", "trainer.steps=2"))
    b = train(tiny(tmp_path / "b", "trainer.steps=2", "deploy.mode=disaggregated", "deploy.backend=ray"))
    assert [r["loss"] for r in a.records] == [r["loss"] for r in b.records]
    assert all(r["sync_bytes"] > 0 and r["sync_s"] >= 0 for r in b.records)
    for (k, x), y in zip(a.policy.state_dict().items(), b.policy.state_dict().values()):
        assert torch.equal(x, y), k


class KillsTheActor:
    """A reward that SIGKILLs the rollout actor's process while scoring step 2."""

    name = "kills"

    def __init__(self, workers):
        self.workers, self.calls = workers, 0

    def __call__(self, prompts, responses, **columns):
        if self.calls == 2:
            os.kill(self.workers[0].pid, signal.SIGKILL)
        self.calls += 1
        return [1.0 if r else 0.0 for r in responses]


def test_killed_rollout_actor_stops_the_run_naming_the_stage(ray_session, tmp_path, monkeypatch):
    workers = []

    class Recorded(RayRolloutWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            workers.append(self)

    monkeypatch.setattr(rlcore.train.deploy, "RayRolloutWorker", Recorded)
    cfg = tiny(
        tmp_path,
        "trainer.steps=6",
        "trainer.save_every=1",
        "deploy.mode=disaggregated",
        "deploy.backend=ray",
        "deploy.rollout_timeout=600",  # far away: death is seen at once, not by timing out
    )
    with pytest.raises(RuntimeError, match=r"stage 'rollout': rollout worker actor died"):
        train(cfg, reward=KillsTheActor(workers))
    assert len(workers) == 1 and workers[0]._closed
    assert load_checkpoint(tmp_path)["step"] == 2  # step 2 finished before the rollout of step 3 failed
