"""A background save's copy taken from the phase switch's own host copies (SwapStaging), fenced before the state changes."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import rlcore.train.checkpoint as checkpoint_module
from kept_checkpoints import assert_kept_equals_sync
from rlcore.memory import offload, reload
from rlcore.pytree import tree_leaves
from rlcore.train import CHECKPOINT_NAME, load_checkpoint, load_config, read_metrics, train
from rlcore.train.checkpoint import save_checkpoint_async
from rlcore.train.swap_staging import SwapStaging
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]


def _trained(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(dtype)
    reference = torch.nn.Linear(8, 2).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    return model, reference, opt


def _step(model, opt):
    model(torch.randn(4, 8, dtype=next(model.parameters()).dtype)).float().square().mean().backward()
    opt.step()


def _moved(model, opt):
    """What the co-located phase switch moves: the parameters and the optimiser state (the trainer's TrainState)."""
    return {"params": dict(model.named_parameters()), "optimizer": list(opt.state.values())}


def _staging(model, opt):
    return SwapStaging(lambda: [t for t in tree_leaves(_moved(model, opt)) if isinstance(t, torch.Tensor)])


def _held_writes(monkeypatch, gate: threading.Event):
    """The background write waits for ``gate``: whatever changed the state before it would be saved, were it read."""
    write = dcp.FileSystemWriter.write_data

    def held(self, plan, planner):
        assert gate.wait(30)
        return write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held)


def _snapshot(model, reference, opt):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {k: v.clone() for k, v in reference.state_dict().items()},
        {k: v.clone() for k, v in opt.state[model[0].weight].items()},
    )


def _check_saved(out, model, reference, opt, want):
    weights, ref, moments = want
    saved = load_checkpoint(out)
    assert saved["step"] == 7
    for k, v in weights.items():
        assert torch.equal(saved["policy"]["model"][k], v), k
    for k, v in ref.items():
        assert torch.equal(saved["reference"][k], v), k
    fresh, fresh_ref, fresh_opt = _trained(next(model.parameters()).dtype)
    load_checkpoint(out, {"policy": (fresh, fresh_opt), "reference": fresh_ref, "step": None})
    for k, v in moments.items():
        assert torch.equal(fresh_opt.state[fresh[0].weight][k], v), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_copy_is_the_swaps_own_and_holds_the_state_at_the_save(tmp_path, monkeypatch, dtype):
    gate = threading.Event()
    _held_writes(monkeypatch, gate)
    model, reference, opt = _trained(dtype)
    want = _snapshot(model, reference, opt)
    staging = _staging(model, opt)
    state = {"policy": (model, opt), "reference": reference, "step": 7}
    pending = save_checkpoint_async(tmp_path, state, step=7, staging=staging)
    assert not pending.staged.done()  # the call copied nothing: it waits for the swap
    handle = offload(_moved(model, opt))  # the switch to the rollout phase: the save holds no alias on the state
    staging.offloaded([handle])
    pending.staged.result(timeout=30)
    reload(handle)  # back to training: optimiser steps change parameters, moments and step in place
    staging.fence()  # the optimiser step's pre-hook: nothing left to wait for
    for _ in range(3):
        _step(model, opt)
    with torch.no_grad():
        reference.weight.add_(1.0)  # a change nothing fenced: the reference was copied in the background already
    gate.set()
    assert pending.result(timeout=60) == tmp_path / CHECKPOINT_NAME / "step000007"
    _check_saved(tmp_path, model, reference, opt, want)


def test_without_a_swap_the_fence_takes_the_copy_before_the_state_changes(tmp_path, monkeypatch):
    gate = threading.Event()
    _held_writes(monkeypatch, gate)
    model, reference, opt = _trained()
    want = _snapshot(model, reference, opt)
    staging = _staging(model, opt)
    pending = save_checkpoint_async(
        tmp_path, {"policy": (model, opt), "reference": reference, "step": 7}, step=7, staging=staging
    )
    staging.fence()  # the next optimiser step comes before any phase switch
    pending.staged.result(timeout=30)
    for _ in range(3):
        _step(model, opt)
    gate.set()
    pending.result(timeout=60)
    _check_saved(tmp_path, model, reference, opt, want)


def test_an_offload_after_the_fence_serves_no_save_and_a_second_save_needs_the_first_fenced(tmp_path):
    model, _, opt = _trained()
    staging = _staging(model, opt)
    pending = save_checkpoint_async(tmp_path, {"policy": (model, opt), "step": 7}, step=7, staging=staging)
    with pytest.raises(ValueError, match="staging: got a save while the previous one"):
        staging({"x": {"w": torch.ones(2)}})
    staging.fence()
    handle = offload(_moved(model, opt))
    staging.offloaded([handle])  # nothing open: a no-op
    reload(handle)
    pending.result(timeout=60)


def test_staging_and_stage_in_background_are_one_choice(tmp_path):
    model, _, opt = _trained()
    with pytest.raises(ValueError, match="staging: got a staging together with stage_in_background=True"):
        save_checkpoint_async(
            tmp_path, {"policy": (model, opt)}, step=1, staging=_staging(model, opt), stage_in_background=True
        )
    assert not (tmp_path / CHECKPOINT_NAME).exists() or not any(
        p.name.startswith("step") for p in (tmp_path / CHECKPOINT_NAME).iterdir()
    )


def _cfg(out, steps, *extra):
    overrides = [
        *TINY,
        f"trainer.output_dir={out}",
        f"trainer.steps={steps}",
        "trainer.export=false",
        # The CPU swaps the state between phases only with the rollout on its own snapshot (deploy.async_infer).
        "deploy.async_infer=true",
        "deploy.staleness=0",
        "rl.behaviour_weights=none",
        *extra,
    ]
    return load_config(ROOT / "configs" / "grpo_tiny.yaml", overrides)


def test_colocated_swap_checkpoints_equal_synchronous_saves_and_resume_exactly(tmp_path, monkeypatch):
    """Every mid-run checkpoint of a co-located run whose phase switch moves the state, its copy taken from the
    swap's host copies while the write is held back, equals a synchronous save of the same step; a resume from
    one equals the whole run."""
    kept = tmp_path / "kept"
    commit = checkpoint_module._commit
    offloads = []
    offloaded = SwapStaging.offloaded

    def keep(path, *args):
        commit(path, *args)
        if path.parent.parent == tmp_path / "a":
            shutil.copytree(path, kept / path.name)

    def count(self, handles, **kwargs):
        offloads.append(self._open is not None)
        return offloaded(self, handles, **kwargs)

    monkeypatch.setattr(checkpoint_module, "_commit", keep)
    monkeypatch.setattr(SwapStaging, "offloaded", count)
    whole = train(_cfg(tmp_path / "a", 3, "trainer.save_every=1"))
    assert sorted(p.name for p in kept.iterdir()) == ["step000001", "step000002", "step000003"]
    assert offloads == [False, True, True]  # the saves after steps 0 and 1 took the swap's copies
    assert all(r["checkpoint_stall_s"] > 0 for r in whole.records)
    train(_cfg(tmp_path / "b", 2, "trainer.async_save=false"))
    ours = tmp_path / "ours"
    assert_kept_equals_sync(kept / "step000002", ours, tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / CHECKPOINT_NAME)
    shutil.copytree(ours / CHECKPOINT_NAME, tmp_path / "b" / CHECKPOINT_NAME)
    resumed = train(_cfg(tmp_path / "b", 3), resume=True)
    for (k, x), y in zip(whole.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(x, y), k
    assert [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [r["loss"] for r in whole.records]


def test_an_offload_that_misses_a_saved_tensor_fails_the_save_by_name_and_keeps_the_previous_version(tmp_path):
    model, _, opt = _trained()
    staging = _staging(model, opt)
    first = save_checkpoint_async(tmp_path, {"policy": (model, opt), "step": 7}, step=7, staging=staging)
    staging.fence()
    first.result(timeout=60)
    pending = save_checkpoint_async(tmp_path, {"policy": (model, opt), "step": 8}, step=8, staging=staging)
    handle = offload(dict(model.named_parameters()))  # the optimiser state stays: the save cannot be served
    staging.offloaded([handle])
    reload(handle)
    with pytest.raises(checkpoint_module.CheckpointError, match="on a storage the offload did not move"):
        pending.result(timeout=60)
    assert load_checkpoint(tmp_path)["step"] == 7
