"""vLLM as the disaggregated rollout engine: in the worker process and the Ray actor, fed through the one sync path.

The worker-side tests share one engine per backend (vLLM's start-up is the slow part):
a worker whose ``generate`` is the trainer's :class:`rlcore.train.RolloutServer` and also
reads the engine's weights back, so every sync is checked bit for bit in the process
that samples. The trainer runs use a 1-layer model of ``configs/grpo_tiny_vllm.yaml``'s
shape (head_dim 32, which vLLM's CPU attention serves).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from ray import cloudpickle

from rlcore.train import (
    RayDeployment,
    RolloutServer,
    VLLMEngine,
    WorkerDeployment,
    build_model,
    left_pad,
    load_checkpoint,
    load_config,
    make_prompt_source,
    read_metrics,
    task_options,
    train,
)
from rlcore.train.cli import main
from tiny_runs import QUIET, TINY_BATCH, TINY_ROLLOUT

ROOT = Path(__file__).resolve().parents[1]

# The Ray actor cannot import this test module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SMALL = [
    "model.model_name_or_path.intermediate_size=64",
    "model.model_name_or_path.num_hidden_layers=1",
    "deploy.vllm.kv_cache_memory_bytes=16777216",
    "deploy.vllm.max_num_seqs=16",
]


def vllm_cfg(out, *extra):
    return load_config(
        ROOT / "configs" / "grpo_tiny_vllm.yaml",
        [*TINY_BATCH, *TINY_ROLLOUT, *QUIET, *SMALL, f"trainer.output_dir={out}", *extra],
    )


def read_back_server(cfg_dict, vocab_size, build):
    """In the worker: the trainer's RolloutServer, whose rows also carry the engine's weights read back after loading."""
    server = RolloutServer(cfg_dict, vocab_size, build)
    assert isinstance(server.engine, VLLMEngine)

    def generate(batch, weights):
        out = server(batch, weights)
        back = server.engine.read_weights()
        # The tied head's own kernel copy must hold the embedding too.
        head = torch.equal(back["lm_head.weight"], back["model.embed_tokens.weight"])
        flat = torch.cat([back[name].reshape(-1) for name in weights])
        rows = batch["prompts"].shape[0]
        return {**out, "weights": flat.expand(rows, -1).clone(), "head": torch.full((rows,), head)}

    return generate


class ReadBackWorker(WorkerDeployment):
    server = staticmethod(read_back_server)


class ReadBackActor(RayDeployment):
    server = staticmethod(read_back_server)


@pytest.fixture(scope="module", params=["process", "ray"])
def worker(request, tmp_path_factory):
    """A disaggregated vLLM deployment of each backend, its policy, and a call of its worker returning the weights."""
    kind = ReadBackWorker if request.param == "process" else ReadBackActor
    cfg = vllm_cfg(tmp_path_factory.mktemp("w"), "deploy.mode=disaggregated")
    task = make_prompt_source(cfg, task_options(cfg))
    torch.manual_seed(0)
    policy = build_model(cfg, task.tokenizer.vocab_size)
    replica = build_model(cfg, task.tokenizer.vocab_size).eval()
    dep = kind(cfg, policy, replica, vocab_size=task.tokenizer.vocab_size, build_model=build_model)
    call = dep.worker.stage(
        inputs=["prompts", "prompt_mask", "iteration", "row"],
        outputs=["responses", "mask", "rollout_logp", "weights", "head"],
    ).fn
    yield SimpleNamespace(dep=dep, policy=policy, call=call, kind=request.param)
    dep.close()


def _children():
    """This process's child processes (another test's module-scoped worker may be among them)."""
    return set(multiprocessing.active_children())


def _flat(policy):
    return torch.cat([p.detach().reshape(-1) for p in policy.parameters()])


def _batch(version):
    prompts, mask = left_pad([[3, 4, 5], [6, 7]], 0)
    return {
        "prompts": prompts,
        "prompt_mask": mask,
        "iteration": torch.tensor([version, version]),
        "row": torch.tensor([0, 1]),
        "policy_version": torch.tensor([version, version]),
    }


def test_worker_engine_weights_equal_the_trainers_after_every_sync(worker):
    dep, policy = worker.dep, worker.policy
    current = dep.worker.published  # 0, unless another test of the module published already
    out = worker.call(_batch(current))
    assert torch.equal(out["weights"][0], _flat(policy)) and bool(out["head"].all())
    assert out["responses"].shape[0] == 2 and out["mask"].dtype == torch.float32
    # The rollout_logp column: vLLM's log-probs of the sampled tokens, 0 off the mask.
    on = out["mask"] != 0
    assert out["rollout_logp"].dtype == torch.float32 and bool(on.any())
    assert bool((out["rollout_logp"][on] <= 0).all()) and bool((out["rollout_logp"][on] < 0).any())
    assert bool((out["rollout_logp"][~on] == 0).all())
    for version in (current + 1, current + 2):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 1e-2)  # an optimiser step, in place
        dep.publish(version)
        out = worker.call(_batch(version))
        assert torch.equal(out["weights"][0], _flat(policy)), version  # bit for bit, read back from the engine
        assert bool(out["head"].all())
        metrics = dep.step_metrics()
        assert metrics["sync_bytes"] == sum(p.numel() * 4 for p in policy.parameters()) and metrics["sync_s"] > 0


def test_a_weight_name_the_worker_engine_does_not_know_names_it_and_the_worker_goes_on(worker):
    dep, policy = worker.dep, worker.policy
    version = dep.worker.published + 1
    weights = {n: p.detach() for n, p in policy.named_parameters()}
    dep.worker.publish(version, {**weights, "model.layers.0.mlp.bogus.weight": torch.zeros(3)})
    where = "actor" if worker.kind == "ray" else "process"
    with pytest.raises(ValueError, match=r"params: got weights the engine does not know: \['model.layers.0.mlp.bogus"):
        try:
            worker.call(_batch(version))
        except ValueError as err:
            assert f"raised in the rollout worker {where} of stage 'rollout'" in "".join(err.__notes__)
            raise
    dep.publish(version + 1)  # the next good version is taken as usual
    assert torch.equal(worker.call(_batch(version + 1))["weights"][0], _flat(policy))


def test_disaggregated_vllm_async_run_keeps_the_staleness_bound(tmp_path):
    cfg = vllm_cfg(tmp_path, "trainer.steps=4", "deploy.mode=disaggregated", "deploy.async_infer=true")
    before = _children()
    run = train(cfg)
    lags = [r["policy_lag_max"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert len(lags) == 4 and max(lags) <= 1 and min(lags) >= 0
    assert max(lags) == 1  # a rollout did overlap an update
    assert all(r["sync_bytes"] > 0 for r in run.records)
    assert _children() == before  # the worker is gone


def test_disaggregated_vllm_blocking_run_equals_the_colocated_one(tmp_path):
    a = train(vllm_cfg(tmp_path / "a", "trainer.steps=2", "rl.temperature=1.0"))
    b = train(vllm_cfg(tmp_path / "b", "trainer.steps=2", "rl.temperature=1.0", "deploy.mode=disaggregated"))
    assert [r["loss"] for r in a.records] == [r["loss"] for r in b.records]
    assert [r["reward"] for r in a.records] == [r["reward"] for r in b.records]
    # vLLM's log-probs against the trainer's recomputation (float32 on both sides: rounding apart).
    assert all(r["mismatch/logp_abs_max"] < 1e-3 for r in a.records + b.records), [
        r["mismatch/logp_abs_max"] for r in a.records + b.records
    ]
    for (k, x), y in zip(a.policy.state_dict().items(), b.policy.state_dict().values()):
        assert torch.equal(x, y), k


def killed_mid_rollout_server(cfg_dict, vocab_size, build):
    """In the worker: the trainer's RolloutServer, whose process is SIGKILLed once step 2's rollout call reached it.

    Before dying it writes its own pid and every process under it, which must all be gone after.
    """
    server = RolloutServer(cfg_dict, vocab_size, build)

    def generate(batch, weights):
        if int(batch["iteration"][0]) == 2:
            pids = [os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))]
            (Path(cfg_dict["trainer"]["output_dir"]) / "worker_pids.json").write_text(json.dumps(pids))
            os.kill(os.getpid(), signal.SIGKILL)
        return server(batch, weights)

    return generate


def test_vllm_worker_killed_mid_rollout_is_one_line_of_rlcore_train(tmp_path, monkeypatch, capsys):
    """``rlcore train``'s path: the cause in one line, exit status 1, no process left, the last checkpoint kept."""
    monkeypatch.setattr(WorkerDeployment, "server", staticmethod(killed_mid_rollout_server))
    argv = ["train", "--config", str(ROOT / "configs" / "grpo_tiny_vllm.yaml"), *TINY_BATCH, *TINY_ROLLOUT, *QUIET]
    argv += [*SMALL, f"trainer.output_dir={tmp_path}", "trainer.steps=5", "trainer.save_every=1"]
    before = _children()
    assert main([*argv, "deploy.mode=disaggregated"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    ours = [line for line in err.splitlines() if line.startswith("rlcore:")]
    assert ours == [
        "rlcore: stopped: stage 'rollout': rollout worker process exited with code -9; "
        f"the last checkpoint in {tmp_path} is kept (--resume continues)"
    ], err
    pids = json.loads((tmp_path / "worker_pids.json").read_text())
    assert _children() == before  # no orphan: neither the worker nor anything it started
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert load_checkpoint(tmp_path)["step"] == 1  # steps 0 and 1 finished and were saved


def test_deploy_engine_vllm_without_vllm_is_one_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when it is not installed
    argv = [
        "train",
        "--config",
        str(ROOT / "configs" / "grpo_tiny_vllm.yaml"),
        *QUIET,
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    before = _children()
    for mode in ("co-located", "disaggregated"):
        assert main([*argv, f"deploy.mode={mode}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("rlcore: error: deploy.engine 'vllm': the vllm package is not installed") and (
            len(err.splitlines()) == 1
        ), err
        assert _children() == before
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_model_vllm_cannot_serve_is_one_line_naming_the_head_dimension(tmp_path, capsys):
    # The main job's model: four heads of 16 channels, which vLLM's CPU attention does not serve.
    argv = ["train", "--config", str(ROOT / "configs" / "grpo_tiny.yaml"), *QUIET, "trainer.warmup_steps=0"]
    argv += ["deploy.engine=vllm", "rl.temperature=1.0", f"trainer.output_dir={tmp_path / 'run'}"]
    before = _children()
    for mode in ("co-located", "disaggregated"):
        assert main([*argv, f"deploy.mode={mode}"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        ours = [line for line in err.splitlines() if line.startswith("rlcore:")]
        assert len(ours) == 1 and ours[0].startswith("rlcore: error: model: got head dimension 16"), err
        assert "expected one of [32, 64" in ours[0]
        assert _children() == before  # the worker that refused it is gone
