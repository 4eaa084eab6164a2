"""rlcore.train.checkpoint on one process: round trips, atomic commits under kill -9, one-line errors on bad checkpoints.

The 2-rank <-> 1-rank round trips run in tests/test_parallel.py (one launch for all
distributed checks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlcore.train import CHECKPOINT_NAME, CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from tiny_runs import SMALLEST_STEP, TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 40,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}


def _model(**extra):  # type: ignore[no-untyped-def]
    from rlcore.models import load_causal_lm

    return load_causal_lm({**CONFIG, **extra}, seed=extra.pop("seed", 0) if "seed" in extra else 0)


def _trained(seed: int = 0):  # type: ignore[no-untyped-def]
    """A model and its AdamW after one step, so the optimiser has state."""
    torch.manual_seed(seed)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.randint(0, 40, (2, 5))).logits.square().mean().backward()
    opt.step()
    return model, opt


def _latest(out: Path) -> Path:
    root = out / CHECKPOINT_NAME
    return root / (root / "latest").read_text().strip()


def test_round_trip_in_place_and_whole(tmp_path):
    model, opt = _trained(0)
    ref = _model()
    rng = rng_state()
    expected = torch.rand(3)  # what the saved streams draw next
    path = save_checkpoint(
        tmp_path, {"policy": (model, opt), "reference": ref, "step": 4, "config": {"rl": {"lr": 0.1}}, "rng": rng}
    )
    assert path.parent == tmp_path / CHECKPOINT_NAME

    fresh, fresh_opt = _trained(1)
    fresh_ref = _model(hidden_act="silu")
    with torch.no_grad():
        for p in fresh_ref.parameters():
            p.add_(1.0)
    data = load_checkpoint(tmp_path, {"policy": (fresh, fresh_opt), "reference": fresh_ref, "step": None, "rng": None})
    assert data["step"] == 4 and data["config"] == {"rl": {"lr": 0.1}}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(ref.state_dict().values(), fresh_ref.state_dict().values()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict(), fresh_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)
    set_rng_state(data["rng"])
    assert torch.equal(torch.rand(3), expected)

    whole = load_checkpoint(tmp_path)
    assert whole["step"] == 4
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in whole["policy"]["model"].items())
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in whole["reference"].items())
    assert whole["policy"]["optim"]["param_groups"][0]["lr"] == 1e-2


def test_a_new_save_replaces_the_old_one_and_cleans_up(tmp_path):
    save_checkpoint(tmp_path, {"step": 1, "model": torch.nn.Linear(2, 2)})
    first = _latest(tmp_path)
    (tmp_path / CHECKPOINT_NAME / "v000099").mkdir()  # the leftover of a save killed mid-way
    save_checkpoint(tmp_path, {"step": 2, "model": torch.nn.Linear(2, 2)})
    assert load_checkpoint(tmp_path)["step"] == 2
    versions = sorted(p.name for p in (tmp_path / CHECKPOINT_NAME).iterdir() if p.is_dir())
    assert versions == [_latest(tmp_path).name] and _latest(tmp_path) != first


def test_interrupted_save_leaves_the_last_checkpoint_loadable(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    save_checkpoint(tmp_path, {"step": 3, "model": torch.nn.Linear(2, 2)})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"step": 4, "model": torch.nn.Linear(2, 2)})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path)["step"] == 3


_SAVER = """
import sys, torch
from rlcore.train import save_checkpoint
model = torch.nn.Linear(64, 64)
step = 0
while True:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)
    save_checkpoint(sys.argv[1], {"model": model, "step": step})
    if step == 0:
        print("saved", flush=True)
    step += 1
"""


def test_kill_9_mid_save_never_corrupts_the_last_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"saved"
        time.sleep(0.7)  # many saves later, at an arbitrary point of one
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=120)
    data = load_checkpoint(tmp_path)
    step = data["step"]
    assert step >= 1  # a few saves were committed, and the loaded one is whole and consistent
    assert all(torch.equal(v, torch.full_like(v, step)) for v in data["model"].values())
    model = torch.nn.Linear(64, 64)
    assert load_checkpoint(tmp_path, {"model": model, "step": None})["step"] == step
    assert torch.equal(model.weight, torch.full_like(model.weight, step))


# --- damaged and incompatible checkpoints: one line naming the file and the problem -----


def _damage(out: Path, kind: str) -> str:
    """Damage the saved checkpoint in one way; returns the file the error must name."""
    root = out / CHECKPOINT_NAME
    version = _latest(out)
    rng = torch.Generator().manual_seed(0)
    noise = bytes(torch.randint(0, 256, (4096,), generator=rng, dtype=torch.uint8).tolist())
    shard = version / "__0_0.distcp"
    if kind == "empty latest":
        (root / "latest").write_bytes(b"")
        return str(root / "latest")
    if kind == "random latest":
        (root / "latest").write_bytes(noise[:64])
        return str(root / "latest")
    if kind == "latest names a missing version":
        (root / "latest").write_text("v000042\n")
        return str(root / "latest")
    if kind == "no manifest":
        (version / "manifest.json").unlink()
        return str(version / "manifest.json")
    if kind == "random manifest":
        (version / "manifest.json").write_bytes(noise)
        return str(version / "manifest.json")
    if kind == "empty data":
        (version / "data_0.pt").write_bytes(b"")
        return str(version / "data_0.pt")
    if kind == "truncated data":
        blob = (version / "data_0.pt").read_bytes()
        (version / "data_0.pt").write_bytes(blob[: len(blob) // 2])
        return str(version / "data_0.pt")
    if kind == "empty metadata":
        (version / ".metadata").write_bytes(b"")
        return str(version / ".metadata")
    if kind == "random metadata":
        (version / ".metadata").write_bytes(noise)
        return str(version / ".metadata")
    if kind == "truncated shard":
        blob = shard.read_bytes()
        shard.write_bytes(blob[: len(blob) - 100])
        return str(shard)
    if kind == "empty shard":
        shard.write_bytes(b"")
        return str(shard)
    if kind == "missing shard":
        shard.unlink()
        return str(shard)
    if kind == "random shard":
        size = shard.stat().st_size
        shard.write_bytes((noise * (size // len(noise) + 1))[:size])
        return str(shard)
    raise AssertionError(kind)


KINDS = [
    "empty latest",
    "random latest",
    "latest names a missing version",
    "no manifest",
    "random manifest",
    "empty data",
    "truncated data",
    "empty metadata",
    "random metadata",
    "truncated shard",
    "empty shard",
    "missing shard",
    "random shard",
]


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_checkpoint_is_a_one_line_error_naming_the_file(tmp_path, kind):
    model, opt = _trained(0)
    save_checkpoint(tmp_path, {"policy": (model, opt), "step": 1})
    where = _damage(tmp_path, kind)
    fresh, fresh_opt = _trained(1)
    before = [p.detach().clone() for p in fresh.parameters()]
    for state in (None, {"policy": (fresh, fresh_opt), "step": None}):
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(tmp_path, state)
        message = str(info.value)
        assert isinstance(info.value, ValueError) and "\n" not in message and where in message, message
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))  # untouched by the failed load


@pytest.mark.parametrize(
    "saved, wanted, match",
    [
        (
            {"policy": "model"},
            {"policy": "bigger"},
            r"'model\.embed_tokens\.weight' has shape \[40, 16\] .*another model size",
        ),
        (
            {"policy": "model"},
            {"policy": "deeper"},
            r"entry 'policy' has no 'model\.layers\.1\..*another model architecture",
        ),
        (
            {"policy": "model", "critic": "model"},
            {"policy": "model"},
            r"holds the models \['critic'\] that this run does not",
        ),
        ({"policy": "model"}, {"policy": "model", "critic": "model"}, r"has no entry 'critic'"),
        (
            {"policy": "model"},
            {"policy": "trainable"},
            r"entry 'policy' holds a module, this run expects a module with",
        ),
        ({"policy": "model"}, {"policy": "model", "step": None}, r"has no entry 'step'"),
    ],
)
def test_incompatible_checkpoint_is_a_one_line_error(tmp_path, saved, wanted, match):
    def build(spec):  # type: ignore[no-untyped-def]
        out = {}
        for name, what in spec.items():
            if what == "model":
                out[name] = _model()
            elif what == "bigger":
                out[name] = _model(hidden_size=32, intermediate_size=64)
            elif what == "deeper":
                out[name] = _model(num_hidden_layers=2)
            elif what == "trainable":
                out[name] = _trained(0)
            else:
                out[name] = what
        return out

    save_checkpoint(tmp_path, build(saved))
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(tmp_path, build(wanted))
    assert "\n" not in str(info.value) and str(_latest(tmp_path)) in str(info.value)


def test_no_checkpoint_and_bad_state_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="resume: no checkpoint at"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"state\['policy'\]: got \(module, str\)"):
        save_checkpoint(tmp_path, {"policy": (torch.nn.Linear(1, 1), "adam")})
    with pytest.raises(ValueError, match="state: got list"):
        save_checkpoint(tmp_path, [1])  # type: ignore[arg-type]
    assert not (tmp_path / CHECKPOINT_NAME / "latest").exists()


def test_cli_exits_with_status_2_on_a_damaged_checkpoint(tmp_path, capsys):
    from rlcore.train.cli import main

    save_checkpoint(tmp_path, {"policy": _model(), "step": 0})
    where = _damage(tmp_path, "truncated shard")
    config = str(ROOT / "configs" / "grpo_tiny.yaml")
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.progress=false", "trainer.threads=1"]
    assert main(["train", "--config", config, "--resume", *overrides]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlcore:")]
    assert len(lines) == 1 and where in lines[0] and "truncated" in lines[0], err[-2000:]
    assert "Traceback" not in err


# --- issue 30: checksums, folders named by step, hostile re-probe ---------------------------


def _flip_byte(file: Path, at: int | None = None) -> None:
    blob = bytearray(file.read_bytes())
    i = len(blob) // 2 if at is None else at
    blob[i] ^= 0x01
    file.write_bytes(bytes(blob))


@pytest.mark.parametrize("target", ["shard", "data", "metadata"])
def test_reprobe30_a_flipped_byte_is_found_by_its_checksum(tmp_path, target):
    # A byte flipped inside a DCP shard loaded silently: the tensors were the damaged ones.
    model, opt = _trained(0)
    save_checkpoint(tmp_path, {"policy": (model, opt), "step": 1})
    version = _latest(tmp_path)
    file = {"shard": version / "__0_0.distcp", "data": version / "data_0.pt", "metadata": version / ".metadata"}[target]
    size = file.stat().st_size
    _flip_byte(file, at=size - 9 if target == "shard" else None)  # inside the last tensor's bytes
    assert file.stat().st_size == size
    fresh, fresh_opt = _trained(1)
    before = [p.detach().clone() for p in fresh.parameters()]
    for state in (None, {"policy": (fresh, fresh_opt), "step": None}):
        with pytest.raises(CheckpointError, match="fails its checksum") as info:
            load_checkpoint(tmp_path, state)
        assert str(file) in str(info.value) and "\n" not in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))


def test_reprobe30_the_manifest_records_every_file_with_its_digest(tmp_path):
    import hashlib
    import json

    save_checkpoint(tmp_path, {"policy": _trained(0), "step": 1})
    version = _latest(tmp_path)
    files = json.loads((version / "manifest.json").read_bytes())["files"]
    on_disk = {p.relative_to(version).as_posix() for p in version.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(files) == on_disk and {"__0_0.distcp", ".metadata", "data_0.pt"} <= on_disk
    for rel, info in files.items():
        blob = (version / rel).read_bytes()
        assert info == {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}


def test_reprobe30_a_version_1_checkpoint_without_digests_still_loads(tmp_path):
    import json

    model = _model()
    save_checkpoint(tmp_path, {"model": model, "step": 4})
    manifest = _latest(tmp_path) / "manifest.json"
    old = json.loads(manifest.read_bytes())
    old["version"] = 1
    del old["files"]
    manifest.write_text(json.dumps(old))
    assert load_checkpoint(tmp_path)["step"] == 4


def test_reprobe30_folders_are_named_by_step_and_old_names_still_load(tmp_path):
    # Folders were numbered by save: v000020 after 400 steps.
    save_checkpoint(tmp_path, {"model": torch.nn.Linear(2, 2), "step": 19}, step=20)
    assert _latest(tmp_path).name == "step000020"
    save_checkpoint(tmp_path, {"model": torch.nn.Linear(2, 2), "step": 399}, step=400)
    assert _latest(tmp_path).name == "step000400" and load_checkpoint(tmp_path)["step"] == 399
    versions = sorted(p.name for p in (tmp_path / CHECKPOINT_NAME).iterdir() if p.is_dir())
    assert versions == ["step000400"]
    # The same step saved again goes to a folder of its own until it is committed.
    save_checkpoint(tmp_path, {"model": torch.nn.Linear(2, 2), "step": 1399}, step=400)
    assert _latest(tmp_path).name == "step000400_1" and load_checkpoint(tmp_path)["step"] == 1399
    # A run directory of the older naming resumes, and its next save is named by step.
    old = tmp_path / "old"
    save_checkpoint(old, {"model": torch.nn.Linear(2, 2), "step": 7})
    assert _latest(old).name == "v000001" and load_checkpoint(old)["step"] == 7
    save_checkpoint(old, {"model": torch.nn.Linear(2, 2), "step": 8}, step=9)
    assert _latest(old).name == "step000009"
    assert sorted(p.name for p in (old / CHECKPOINT_NAME).iterdir() if p.is_dir()) == ["step000009"]
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="step: got"):
            save_checkpoint(tmp_path, {"step": 0}, step=bad)  # type: ignore[arg-type]


def test_reprobe30_a_missing_marker_names_the_saved_versions(tmp_path):
    # Deleting `latest` made the checkpoint look absent ("run without --resume first"),
    # and a run without --resume then refused the directory.
    save_checkpoint(tmp_path, {"model": torch.nn.Linear(2, 2), "step": 5}, step=6)
    (tmp_path / CHECKPOINT_NAME / "latest").unlink()
    with pytest.raises(
        CheckpointError, match=r"is missing, though the folder holds the saved versions \['step000006'\]"
    ):
        load_checkpoint(tmp_path)
    (tmp_path / CHECKPOINT_NAME / "latest").write_text("step000006\n")  # what the message says to do
    assert load_checkpoint(tmp_path)["step"] == 5


def test_reprobe30_a_full_disk_leaves_no_partial_version_and_the_last_one_loads(tmp_path, monkeypatch):
    import errno

    import torch.distributed.checkpoint as dcp

    save_checkpoint(tmp_path, {"model": torch.nn.Linear(2, 2), "step": 3}, step=4)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, {"model": torch.nn.Linear(2, 2), "step": 4}, step=5)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / CHECKPOINT_NAME).iterdir() if p.is_dir()) == ["step000004"]
    assert load_checkpoint(tmp_path)["step"] == 3


def test_reprobe30_a_second_process_saving_into_the_same_folder_is_refused(tmp_path):
    # Two runs with one output_dir deleted each other's versions mid-save.
    import fcntl

    save_checkpoint(tmp_path, {"step": 1})
    held = os.open(tmp_path / CHECKPOINT_NAME / ".lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # another process's save in progress (flock locks are per open file)
    try:
        with pytest.raises(CheckpointError, match="another process is saving a checkpoint here now"):
            save_checkpoint(tmp_path, {"step": 2})
    finally:
        os.close(held)
    assert load_checkpoint(tmp_path)["step"] == 1
    save_checkpoint(tmp_path, {"step": 2})  # the lock went with its holder
    assert load_checkpoint(tmp_path)["step"] == 2


TINY = [
    *TINY_MODEL,
    *SMALLEST_STEP,
    "trainer.reward_workers=0",
    "trainer.progress=false",
    "trainer.plot=false",
]


def _one_error_line(capsys) -> str:  # type: ignore[no-untyped-def]
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlcore:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_reprobe30_trainer_checkpoints_by_step_refuses_a_shorter_resume_and_checks_digests(tmp_path, capsys):
    from rlcore.train.cli import main

    out = tmp_path / "run"
    config = str(ROOT / "configs" / "grpo_tiny.yaml")
    run = ["train", "--config", config, *TINY, f"trainer.output_dir={out}"]
    assert main([*run, "trainer.steps=3", "trainer.save_every=2"]) == 0
    # Numbered by step: the last save holds 3 steps (not "v000002", the second save).
    assert _latest(out).name == "step000003" and load_checkpoint(out)["step"] == 2
    capsys.readouterr()
    # A resume to fewer steps than the checkpoint holds trained nothing and said nothing.
    assert main([*run, "--resume", "trainer.steps=2"]) == 2
    line = _one_error_line(capsys)
    assert "trainer.steps is 2" in line and "already holds 3 steps" in line, line
    # A byte flipped in a shard: both the resume and the export name the checkpoint's file.
    shard = _latest(out) / "__0_0.distcp"
    _flip_byte(shard, at=shard.stat().st_size - 9)
    assert main([*run, "--resume", "trainer.steps=4"]) == 2
    line = _one_error_line(capsys)
    assert str(shard) in line and "checksum" in line, line
    assert main(["export", str(out), str(tmp_path / "hf")]) == 2
    line = _one_error_line(capsys)
    assert str(shard) in line and "checksum" in line, line
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("where", ["a file", "the checkpoint folder", "a version folder"])
def test_reprobe30_export_refuses_an_out_dir_that_is_a_file_or_inside_the_checkpoint(tmp_path, capsys, where):
    # A file gave "[Errno 17] File exists"; the checkpoint folder itself was filled with the model's files.
    from rlcore.train import load_config
    from rlcore.train.build import build_model
    from rlcore.train.cli import main

    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", TINY)
    save_checkpoint(tmp_path, {"step": 0, "config": cfg.to_dict(), "policy": build_model(cfg, 9)})
    assert main(["export", str(tmp_path), str(tmp_path / "hf")]) == 0  # a checkpoint that exports
    assert (tmp_path / "hf" / "tokenizer.json").is_file()  # the task's character tokenizer, written too
    capsys.readouterr()
    target = {
        "a file": tmp_path / "model.bin",
        "the checkpoint folder": tmp_path / CHECKPOINT_NAME,
        "a version folder": _latest(tmp_path) / "hf",
    }[where]
    if where == "a file":
        target.write_bytes(b"x")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["export", str(tmp_path), str(target)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"rlcore: error: out_dir: {str(target)!r} is ") and "expected" in line, line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_reprobe30_a_save_committed_during_a_read_is_followed(tmp_path, monkeypatch):
    # `rlcore export` of a running job: the trainer's next save removed the version being read.
    import torch.distributed.checkpoint as dcp

    save_checkpoint(tmp_path, {"model": torch.nn.Linear(2, 2), "step": 1})
    newer = torch.nn.Linear(2, 2)
    real = dcp.FileSystemReader.read_metadata
    calls = []

    def racing(self):  # type: ignore[no-untyped-def]
        if not calls:
            save_checkpoint(tmp_path, {"model": newer, "step": 2})  # commits, removes the version being read
        calls.append(1)
        return real(self)

    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", racing)
    data = load_checkpoint(tmp_path)
    assert data["step"] == 2 and torch.equal(data["model"]["weight"], newer.weight.detach())
