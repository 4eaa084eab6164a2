"""A dead rollout worker process is replaced without restarting the run: bounded, weights re-sent, rows redone."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from restart_helpers import restart_pipeline
from rlcore.dataflow import HandBack, RolloutWorker
from rlcore.train import load_config, train

ROOT = Path(__file__).resolve().parents[1]


def make_generate(marker_dir: str, deaths: int, at: int = 2):
    """Runs in the worker: responses = prompts * w + 0.5; the first ``deaths`` calls from version ``at`` on kill it."""

    def generate(batch, params):
        # From version `at` on: a call handed back may be taken again at a later version (the run goes on).
        if int(batch["policy_version"].max()) >= at:
            done = len(os.listdir(marker_dir))
            if done < deaths:
                Path(marker_dir, f"death{done}").touch()
                os._exit(9)  # mid-call, as an OOM kill or a segfault would
        return {"responses": batch["prompts"].double() * params["w"] + 0.5}

    return generate


def test_a_worker_killed_mid_call_is_replaced_and_its_rows_redone_with_their_version(tmp_path):
    with (
        RolloutWorker(make_generate, args=(str(tmp_path), 2), start_method="fork", max_restarts=2) as worker,
        pytest.warns(RuntimeWarning, match=r"stage 'rollout': the worker process exited with code 9; restarting it"),
    ):
        res = restart_pipeline(worker)
        assert worker.restarts == 2 and worker.restart_causes[0] == "the worker process exited with code 9"
    assert multiprocessing.active_children() == []
    calls = [t for t in res.tasks if t.stage == "rollout"]
    for j, b in enumerate(res.batches):
        v = b["policy_version"]
        assert b["prompts"].tolist() == [10 * j + i for i in range(6)]  # every row once, none lost
        # version v means weights w = 1 + v: the replacement got exactly the versions the rows record
        torch.testing.assert_close(b["responses"], b["prompts"].double() * (1 + v) + 0.5, rtol=0, atol=0)
        rows = torch.cat([t.rows for t in calls if t.iteration == j])
        assert sorted(rows.tolist()) == list(range(6))  # the dock delivered each row to one finished call


def test_the_replacement_gets_the_version_the_rows_record_not_the_newest(tmp_path):
    with (
        RolloutWorker(make_generate, args=(str(tmp_path), 1, 1), start_method="fork", max_restarts=1) as worker,
        pytest.warns(RuntimeWarning, match="restarting it"),
    ):
        for v in range(4):  # the trainer is ahead: versions 0-3 published
            worker.publish(v, {"w": torch.tensor(float(1 + v), dtype=torch.float64)})
        call = worker.stage(inputs=["prompts"], outputs=["responses"]).fn
        prompts = torch.arange(3)
        with pytest.raises(HandBack, match=r"stage 'rollout': the worker process exited with code 9; its rows"):
            call({"prompts": prompts, "policy_version": torch.full((3,), 1)})  # the worker dies at version 1's rows
        for v in (1, 2, 3):  # the rows handed back are redone by the replacement
            out = call({"prompts": prompts, "policy_version": torch.full((3,), v)})
            assert torch.equal(out["responses"], prompts.double() * (1 + v) + 0.5), v
        assert worker.restarts == 1


def test_past_max_restarts_the_run_stops_with_the_named_error(tmp_path):
    with (
        RolloutWorker(make_generate, args=(str(tmp_path), 2), start_method="fork", max_restarts=1) as worker,
        pytest.raises(RuntimeError, match=r"rollout worker process exited with code 9 \(after 1 restart"),
        pytest.warns(RuntimeWarning, match=r"restarting it \(1 of at most 1\)"),
    ):
        restart_pipeline(worker)
    assert worker.restarts == 1 and multiprocessing.active_children() == []


def test_max_restarts_is_checked():
    with pytest.raises(ValueError, match=r"max_restarts: got -1, expected an int >= 0"):
        RolloutWorker(make_generate, args=("", 0), max_restarts=-1)


class KillsTheWorkerOnce:
    """A rule reward that kills the rollout worker process (this process's only child) at its first call."""

    name = "kills"

    def __init__(self, kill: bool = True):
        self.calls, self.kill = 0, kill

    def __call__(self, prompts, responses, **columns):
        self.calls += 1
        if self.calls == 1 and self.kill:
            for child in multiprocessing.active_children():
                child.kill()
                child.join()
        return [float(len(r) % 2) for r in responses]


def test_the_trainer_replaces_a_killed_rollout_worker_and_trains_as_if_undisturbed(tmp_path):
    def run(out, reward, *extra):
        overrides = [
            "model.model_name_or_path.hidden_size=32",
            "model.model_name_or_path.intermediate_size=64",
            "model.model_name_or_path.num_hidden_layers=1",
            "rl.batch_size=2",
            "rl.mini_batch_size=2",
            "rl.num_rollouts=2",
            "trainer.warmup_steps=0",
            "trainer.steps=2",
            "trainer.progress=false",
            "trainer.plot=false",
            "trainer.threads=1",
            "trainer.reward_workers=0",
            "trainer.export=false",
            "deploy.async_infer=false",
            "deploy.mode=disaggregated",
            f"trainer.output_dir={out}",
            *extra,
        ]
        return train(load_config(ROOT / "configs" / "grpo_tiny.yaml", overrides), reward=reward).records

    with pytest.warns(RuntimeWarning, match=r"exited with code -9; restarting it \(1 of at most 1\)"):
        disturbed = run(tmp_path / "a", KillsTheWorkerOnce(), "trainer.max_worker_restarts=1")
    assert [r["worker_restarts"] for r in disturbed] == [0.0, 1.0]  # killed after step 0's rollout
    undisturbed = run(tmp_path / "b", KillsTheWorkerOnce(kill=False), "trainer.max_worker_restarts=1")
    assert [r["worker_restarts"] for r in undisturbed] == [0.0, 0.0]
    for a, b in zip(disturbed, undisturbed, strict=True):  # the redone rows are the ones the dead worker owed
        assert a["loss"] == b["loss"] and a["reward"] == b["reward"] and a["entropy"] == b["entropy"], a["step"]


def test_max_worker_restarts_is_validated(tmp_path):
    path = ROOT / "configs" / "grpo_tiny.yaml"
    with pytest.raises(ValueError, match=r"'trainer.max_worker_restarts': got -1, expected >= 0"):
        load_config(path, ["trainer.max_worker_restarts=-1"])
    cfg = load_config(path, ["trainer.max_worker_restarts=2", "deploy.mode=disaggregated", "deploy.backend=ray"])
    assert cfg.trainer.max_worker_restarts == 2  # a Ray actor is replaced too
