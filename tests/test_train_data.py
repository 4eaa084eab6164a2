"""The trainer on a user's own model and data: a local Qwen2 directory, a JSONL dataset, a reward file, the seed's flags."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcore.testing.hf_fixtures import arithmetic_rows, build_tiny_qwen2, write_prompt_files
from rlcore.train import read_metrics
from rlcore.train.cli import main
from rlcore.train.rundir import check_resume_config, config_changes, prepare_run_dir

REWARD_FILE = """
from rlcore.rewards import BaseReward


class SumReward(BaseReward):
    def __init__(self):
        super().__init__()

    def forward(self, prompts, responses, **kwargs):
        assert isinstance(prompts[0], str) and "What is" in prompts[0]  # the prompt as written, no template
        return [r.strip() == str(a + b) for r, a, b in zip(responses, kwargs["a"], kwargs["b"])]
"""

CONFIG = """
model:
  model_name_or_path: {model}
rl:
  algo: grpo
  batch_size: 4
  mini_batch_size: 4
  num_rollouts: 4
  max_new_tokens: 3
  beta: 0.0
  lr: 0.001
rewards:
  - {{reward: rewards/sum.py:SumReward, weight: 1.0}}
  - {{reward: length, weight: 0.0, kwargs: {{max_length: 100}}}}
data:
  val_path: {val}
trainer:
  steps: 2
  warmup_steps: 3
  warmup_batch_size: 8
  eval_every: 2
  eval_samples: 2
  reward_workers: 0
  threads: 1
  progress: false
  plot: true
"""


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """What a new user has: a model directory, train / val JSONL files, a reward file beside the config."""
    root = tmp_path_factory.mktemp("user")
    model = build_tiny_qwen2(root / "model", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    train, val = write_prompt_files(root / "data", num_train=40, num_val=4)
    (root / "conf" / "rewards").mkdir(parents=True)
    (root / "conf" / "rewards" / "sum.py").write_text(REWARD_FILE)
    config = root / "conf" / "grpo.yaml"
    config.write_text(CONFIG.format(model=model, val=val))
    return {"root": root, "model": model, "train": train, "val": val, "config": config}


def _errors(capsys):
    """The trainer's own lines on stderr (progress bars of transformers and datasets left out)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlcore:")]


def _train(user, out, *extra):
    return main(
        ["train", "--config", str(user["config"]), "--dataset", str(user["train"]), "--output_dir", str(out), *extra]
    )


@pytest.fixture(scope="module")
def run(user):
    out = user["root"] / "out"
    assert _train(user, out) == 0
    return out


def test_seed_flags_train_validate_plot_and_export(run, tmp_path):
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    last = records[-1]
    for key in ("val/reward", "val/pass@1", "val/pass@2"):
        assert 0.0 <= last[key] <= 1.0, key
    assert "val/reward" not in records[0]  # eval_every 2: after step 1 only
    assert last["epoch"] == pytest.approx(2 * 4 / 40)  # two steps of four prompts from forty
    assert (run / "curves.png").stat().st_size > 0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    for exported in (run / "hf", tmp_path / "exported"):
        if exported != run / "hf":
            assert main(["export", str(run), str(exported)]) == 0
        model = AutoModelForCausalLM.from_pretrained(exported)
        tok = AutoTokenizer.from_pretrained(exported)
        text = tok.apply_chat_template(
            [{"role": "user", "content": "What is 1 + 2?"}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        out = model.generate(**ids, max_new_tokens=3, do_sample=False)
        assert out.shape[1] > ids["input_ids"].shape[1]
    # The export on save holds the trained policy: the same weights as `rlcore export`.
    a = AutoModelForCausalLM.from_pretrained(run / "hf").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_existing_run_is_refused_then_overwritten_or_resumed(user, run, capsys):
    before = (run / "metrics.jsonl").read_text()
    assert _train(user, run) == 2
    (err,) = _errors(capsys)
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert (run / "metrics.jsonl").read_text() == before  # untouched
    # resuming with a changed hyper-parameter names it, and runs with --allow-config-change
    assert _train(user, run, "--resume", "rl.lr=0.01", "trainer.steps=3") == 2
    (err,) = _errors(capsys)
    assert "rl.lr (0.001 -> 0.01)" in err and "--allow-config-change" in err
    assert _train(user, run, "--resume", "rl.lr=0.01", "trainer.steps=3", "--allow-config-change") == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]


def test_resume_with_a_changed_hidden_size_names_the_key(user, run, tmp_path, capsys):
    bigger = build_tiny_qwen2(tmp_path / "bigger", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    assert _train(user, run, "--resume", f"model.model_name_or_path={bigger}", "--allow-config-change") == 2
    (err,) = _errors(capsys)
    assert "resume: the model differs" in err and "model.model_name_or_path" in err


def test_resume_after_the_model_directory_changed_names_the_tensor(user, tmp_path, capsys):
    """Same model.model_name_or_path, other weights in it: one line naming the checkpoint, the tensor and both shapes."""
    shape = {"num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    model = build_tiny_qwen2(tmp_path / "model", hidden_size=16, **shape)
    out = tmp_path / "out"
    args = [f"model.model_name_or_path={model}", "trainer.steps=1", "trainer.eval_every=0", "trainer.plot=false"]
    assert _train(user, out, *args) == 0
    before = (out / "metrics.jsonl").read_text()
    for changed, pattern in (
        ({"hidden_size": 32}, r"tensor 'model\.embed_tokens\.weight' has shape \[\d+, 16\] there, \[\d+, 32\] in"),
        (
            {"hidden_size": 16, "num_layers": 2},
            r"tensor 'model\.layers\.1\..*' of shape \[.*\] in .* is not in the checkpoint",
        ),
    ):
        shutil.rmtree(model)
        build_tiny_qwen2(model, **{**shape, **changed})
        assert _train(user, out, *args, "--resume", "trainer.steps=2") == 2
        (err,) = _errors(capsys)
        assert re.search(pattern, err), err
        assert f"checkpoint {str(out / 'checkpoint')!r} was saved from another model" in err and str(model) in err
        assert (out / "metrics.jsonl").read_text() == before  # refused before any step


def test_overwrite_replaces_the_run(user, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 7, "reward": 1.0}) + "\n")
    assert _train(user, out, "trainer.steps=1", "trainer.eval_every=0", "trainer.plot=false", "--overwrite") == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0]


def _bad(user, tmp_path, capsys, *args, config=None):
    argv = ["train", "--config", str(config or user["config"]), "--output_dir", str(tmp_path / "o"), *args]
    assert main(argv) == 2
    (err,) = _errors(capsys)
    assert err.startswith("rlcore: error: ")
    return err


def test_bad_input_is_one_line_naming_the_thing(user, tmp_path, capsys):
    data = tmp_path / "nocol.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2", "a": 1, "b": 1}) + "\n")
    err = _bad(user, tmp_path, capsys, "--dataset", str(data))
    assert "column 'prompt'" in err and str(data) in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "is empty" in _bad(user, tmp_path, capsys, "--dataset", str(empty))
    config = tmp_path / "bad_reward.yaml"
    config.write_text(user["config"].read_text().replace("rewards/sum.py:SumReward", "missing_module_xyz:Reward"))
    err = _bad(user, tmp_path, capsys, "--dataset", str(user["train"]), config=config)
    assert "rewards[0].reward" in err and "missing_module_xyz" in err and "ModuleNotFoundError" in err
    bare = build_tiny_qwen2(
        tmp_path / "bare", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, with_tokenizer=False
    )
    err = _bad(user, tmp_path, capsys, "--dataset", str(user["train"]), f"model.model_name_or_path={bare}")
    assert "has no tokenizer" in err and str(bare) in err
    err = _bad(user, tmp_path, capsys, "--dataset", str(user["train"]), "model.lora={r: 4, rank: 4}")
    assert "model.lora: got the keys ['rank']" in err


def test_run_dir_and_config_diff_helpers(tmp_path):
    prepare_run_dir(tmp_path, resume=False, overwrite=False)  # empty: fine
    (tmp_path / "checkpoint").mkdir()
    with pytest.raises(ValueError, match="already holds a run"):
        prepare_run_dir(tmp_path, resume=False, overwrite=False)
    prepare_run_dir(tmp_path, resume=True, overwrite=False)
    prepare_run_dir(tmp_path, resume=False, overwrite=True)
    assert not (tmp_path / "checkpoint").exists()
    saved = {"model": {"model_name_or_path": {"hidden_size": 32}}, "rl": {"lr": 1.0}, "trainer": {"steps": 3}}
    grown = {"model": {"model_name_or_path": {"hidden_size": 64}}, "rl": {"lr": 1.0}, "trainer": {"steps": 9}}
    assert config_changes(saved, grown) == (["model.model_name_or_path.hidden_size"], [])
    with pytest.raises(ValueError, match=r"model.model_name_or_path.hidden_size \(32 -> 64\)"):
        check_resume_config(saved, grown, allow_change=True)
    assert check_resume_config(saved, {**saved, "rl": {"lr": 2.0}}, allow_change=True) == ["rl.lr"]
    assert check_resume_config(None, grown, allow_change=False) == []


def test_the_built_in_task_stays_the_default(tmp_path):
    from rlcore.train import load_config
    from rlcore.train.prompts import TaskPrompts, make_prompt_source, task_options

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "grpo_tiny.yaml")
    assert cfg.data.path is None and isinstance(make_prompt_source(cfg, task_options(cfg)), TaskPrompts)


RISE_CONFIG = """
model:
  model_name_or_path: {model}
rl:
  algo: grpo
  batch_size: 16
  mini_batch_size: 16
  num_rollouts: 8
  max_new_tokens: 4
  temperature: 1.0
  beta: 0.0
  lr: 0.001
rewards:
  - {{reward: rewards/sum.py:SumReward, weight: 1.0}}
trainer:
  steps: 40
  warmup_steps: 60
  warmup_batch_size: 16
  warmup_lr: 0.003
  reward_workers: 0
  threads: 1
  progress: false
  plot: false
  seed: 0
"""


def test_grpo_reward_rises_after_the_warm_up(user, tmp_path):
    """Warm-up on the dataset's answers, then GRPO: the reward of the last steps clearly above the first's.

    Single-digit sums (0..4 + 0..4) and a model of width 64: the warm-up leaves the policy
    right about a third of the time, so the groups carry signal. CPU runs are deterministic
    with a fixed seed (measured: 0.30 over steps 0-4, 0.40 over steps 35-39; 20 steps rose
    to only 0.32 under the row-keyed sampling streams).
    """
    model = build_tiny_qwen2(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows(200, seed=0, low=0, high=4)))
    config = user["root"] / "conf" / "rise.yaml"  # beside the reward file it names
    config.write_text(RISE_CONFIG.format(model=model))
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), "--dataset", str(data), "--output_dir", str(out)]) == 0
    rewards = [r["reward"] for r in read_metrics(out / "metrics.jsonl")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first > 0.1, rewards  # the warm-up taught the format: GRPO has signal
    assert last > first + 0.08, rewards


def test_the_seed_config_runs_once_its_model_is_a_local_directory(user, tmp_path, capsys):
    """configs/seed/qwen2_5_7b_grpo.yaml as shipped (bf16, flash attention, 8 data-parallel ranks, one rollout),
    on one CPU process: each refusal names the override that lifts it, then two steps run."""
    seed = Path(__file__).resolve().parents[1] / "configs" / "seed" / "qwen2_5_7b_grpo.yaml"
    out = tmp_path / "out"

    def run(*overrides):
        argv = ["train", "--config", str(seed), "--dataset", str(user["train"]), "--output_dir", str(out)]
        return main([*argv, "trainer.steps=2", "trainer.threads=1", "trainer.progress=false", *overrides])

    assert run() == 2
    (err,) = _errors(capsys)
    assert "Qwen/Qwen2.5-7B-Instruct" in err and "override model.model_name_or_path=DIR" in err
    local = f"model.model_name_or_path={user['model']}"
    assert run(local) == 2
    assert "override parallel.data_parallel=1" in _errors(capsys)[0]
    assert run(local, "parallel.data_parallel=1") == 2
    assert "override rl.num_rollouts=2" in _errors(capsys)[0]
    with pytest.warns(UserWarning, match="flash-attn is not installed"):
        assert run(local, "parallel.data_parallel=1", "rl.num_rollouts=2") == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert all(0.0 <= r["reward"] <= 1.0 for r in records)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / "hf", dtype="auto")
    assert next(exported.parameters()).dtype == torch.bfloat16  # the seed's torch_dtype


DPO_CONFIG = """
model:
  model_name_or_path: {model}
rl:
  algo: dpo
  batch_size: 16
  mini_batch_size: 16
  num_rollouts: 1
  beta: 0.5
  lr: 0.01
data:
  max_response_length: 12
trainer:
  steps: 8
  reward_workers: 1
  threads: 1
  progress: false
  plot: false
"""


def _preference_rows(n: int) -> list[dict]:
    """Pairs of the arithmetic task: the right sum is chosen, a wrong one rejected (TRL's prompt / chosen / rejected)."""
    rows = arithmetic_rows(n, seed=3, low=0, high=9)
    return [
        {
            "prompt": r["prompt"],
            "chosen": f"The answer is \\\\boxed{{{r['answer']}}}.",
            "rejected": f"The answer is \\\\boxed{{{int(r['answer']) + 3}}}.",
        }
        for r in rows
    ]


def test_offline_dpo_on_a_preference_dataset(user, tmp_path, capsys):
    """`rlcore train` with rl.algo dpo and a preference JSONL: the DPO loss falls, the implicit reward margin and
    accuracy rise; no rollout and no reward worker run."""
    rows = _preference_rows(16)
    rows.append({**rows[0], "rejected": "The answer is " + "9" * 40})  # longer than data.max_response_length
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "dpo.yaml"
    config.write_text(DPO_CONFIG.format(model=user["model"]))
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), "--dataset", str(data), "--output_dir", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "16 preference pairs" in summary and "1 dropped and 0 truncated as overlong responses" in summary
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(8))
    assert "reward" not in records[0] and "busy_s/rollout" not in records[0]  # offline: nothing sampled or scored
    loss = [r["loss"] for r in records]
    margins = [r["margins"] for r in records]
    accuracy = [r["accuracies"] for r in records]
    assert loss[0] == pytest.approx(math.log(2), abs=1e-3)  # the policy starts as the reference
    # every step sees all sixteen pairs: the loss falls, the margin and the accuracy rise
    assert max(loss[-3:]) < min(loss[:3]) and loss[-1] < loss[0] - 0.2, loss
    assert min(margins[-3:]) > max(margins[:3]) and margins[-1] > 0.5, margins
    assert accuracy[-1] >= 0.75 > accuracy[0] and accuracy[-1] > accuracy[1], accuracy
    assert records[-1]["data/dropped"] == 1.0
    # the checkpoint resumes
    assert (
        main(
            [
                "train",
                "--config",
                str(config),
                "--dataset",
                str(data),
                "--output_dir",
                str(out),
                "--resume",
                "trainer.steps=9",
            ]
        )
        == 0
    )
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(9))


def test_dpo_dataset_without_its_response_column_names_it_and_the_file(user, tmp_path, capsys):
    data = tmp_path / "prefs.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "chosen": r["chosen"]}) + "\n" for r in _preference_rows(4))
    )
    config = tmp_path / "dpo.yaml"
    config.write_text(DPO_CONFIG.format(model=user["model"]))
    err = _bad(user, tmp_path, capsys, "--dataset", str(data), config=config)
    assert "rejected_key: column 'rejected' is not in" in err and str(data) in err
    err = _bad(user, tmp_path, capsys, "--dataset", str(data), "data.chosen_key=good", config=config)
    assert "chosen_key: column 'good' is not in" in err


STUBBORN_FILE = """
from rlcore.rewards import VerifiedMath

PATHOLOGICAL = r"\\boxed{9^{9^{9^{9^{9}}}}}"


class Stubborn(VerifiedMath):
    # Verified maths whose first response of every call is a pathological answer (it times out).
    def __call__(self, prompts, responses, **columns):
        return super().__call__(prompts, [PATHOLOGICAL, *responses[1:]], **columns)
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_maths_timeouts_are_counted_in_the_step_records(user, tmp_path, workers):
    """The verified-maths counters reach metrics.jsonl, from the trainer's process and from a reward worker."""
    (user["root"] / "conf" / "rewards" / "stubborn.py").write_text(STUBBORN_FILE)
    config = user["root"] / "conf" / f"stubborn{workers}.yaml"  # beside the reward file it names
    reward = "{reward: rewards/stubborn.py:Stubborn, name: math, kwargs: {timeout: 1.0}}"
    text = user["config"].read_text().split("rewards:")[0] + f"rewards:\n  - {reward}\ntrainer:\n  steps: 2\n"
    config.write_text(text + f"  reward_workers: {workers}\n  threads: 1\n  progress: false\n  plot: false\n")
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), "--dataset", str(user["train"]), "--output_dir", str(out)]) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:  # 4 prompts x 4 samples a step, the first of them pathological (on a loaded machine
        # another item may run past the timeout too)
        assert r["reward/math/checked"] == 16 and 1 <= r["reward/math/timeouts"] <= 16 - r["reward/math/no_answer"], r


RECORDER_FILE = """
import json, os


class Recorder:
    # Scores 1 for every response and appends, per call (one call a step), the dataset ids this rank scored.
    def __init__(self, folder):
        self.folder = folder

    def __call__(self, prompts, responses, *, id, **columns):
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(self.folder, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(sorted(set(id))) + "\\n")
        return [1.0] * len(responses)
"""

TORCHRUN_CONFIG = """
model:
  model_name_or_path: {model}
rl:
  algo: grpo
  batch_size: 2
  mini_batch_size: 2
  num_rollouts: 2
  max_new_tokens: 2
parallel:
  data_parallel: 2
rewards:
  - {{reward: rewards/recorder.py:Recorder, kwargs: {{folder: {folder}}}}}
trainer:
  steps: 2
  warmup_steps: 1
  warmup_batch_size: 2
  reward_workers: 0
  threads: 1
  progress: false
  plot: false
"""


def test_torchrun_two_ranks_shard_each_global_batch_of_the_dataset(user, tmp_path):
    """torchrun -m rlcore.train --dataset: each rank scores its own share of every step's global batch (together
    the batch the seeded order draws, none twice); the checkpoint resumes at one rank with the next global batch."""
    from rlcore.data import sample_indices

    rows = [{**r, "id": i} for i, r in enumerate(arithmetic_rows(24, seed=7))]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder = tmp_path / "seen"
    folder.mkdir()
    config = user["root"] / "conf" / "torchrun.yaml"  # beside the reward file it names
    (user["root"] / "conf" / "rewards" / "recorder.py").write_text(RECORDER_FILE)
    config.write_text(TORCHRUN_CONFIG.format(model=user["model"], folder=folder))
    out = tmp_path / "out"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    flags = ["--config", str(config), "--dataset", str(data), "--output_dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, "-m", "rlcore.train", *flags], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [[json.loads(line) for line in (folder / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [len(s) for s in seen] == [2, 2]  # one reward call a step on each rank
    for step in range(2):
        mine, theirs = seen[0][step], seen[1][step]
        assert len(mine) == len(theirs) == 2 and not set(mine) & set(theirs), (step, mine, theirs)
        want = sample_indices(len(rows), 4, seed=0, position=4 * step).indices  # the step's global batch
        assert sorted(mine + theirs) == sorted(want), (step, mine, theirs)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
    # the 2-rank checkpoint resumes in one process, with the same global batch per step
    one_rank = ["parallel.data_parallel=1", "rl.batch_size=4", "rl.mini_batch_size=4", "trainer.warmup_batch_size=4"]
    assert main(["train", *flags, "--resume", "trainer.steps=3", *one_rank]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    last = json.loads((folder / "rank0.jsonl").read_text().splitlines()[-1])
    assert last == sorted(set(sample_indices(len(rows), 4, seed=0, position=8).indices))


def test_reprobe30_offline_dpo_with_the_progress_bar_exits_0_and_shows_the_dpo_metrics(user, tmp_path, capsys):
    """Offline DPO with the progress bar on (the default): the final summary and the bar carry the DPO metrics
    (there is no reward), and curves.png is written."""
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _preference_rows(16)))
    config = tmp_path / "dpo.yaml"
    config.write_text(DPO_CONFIG.format(model=user["model"]))
    out = tmp_path / "out"
    argv = ["train", "--config", str(config), "--dataset", str(data), "--output_dir", str(out)]
    assert main([*argv, "trainer.progress=true", "trainer.plot=true", "trainer.steps=4"]) == 0
    captured = capsys.readouterr()
    done = [line for line in captured.out.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and "reward" not in done[0], done
    records = read_metrics(out / "metrics.jsonl")
    margins = sum(r["margins"] for r in records[:1]), sum(r["margins"] for r in records[-1:])
    assert f"margins of steps 0-0 {margins[0]:.3f}, of steps 3-3 {margins[1]:.3f}" in done[0], done
    assert "accuracies of steps 0-0" in done[0] and "loss of steps 0-0" in done[0], done
    bar = captured.err.splitlines()
    assert any("margin=" in line and "acc=" in line and "loss=" in line for line in bar), captured.err[-400:]
    assert "Generating train split" not in captured.err  # datasets' bar does not cut into the run's
    assert (out / "curves.png").is_file()


def _one_error_line(capsys) -> str:
    """The CLI's whole stderr, which must be one line (no library log or progress lines beside it)."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rlcore: error: "), lines
    return lines[0]


def test_reprobe30_malformed_datasets_exit_2_from_the_cli_with_one_line_naming_the_file(user, tmp_path, capsys):
    import datasets

    rows = [json.loads(line) for line in Path(user["train"]).read_text().splitlines()]
    cases = {"blank.jsonl": b"\n\n", "broken.jsonl": b'{"prompt": "x", "answer": "1", "a": 1, "b": 0}\n{"prompt": \n'}
    cases["latin.jsonl"] = b'{"prompt": "caf\xe9", "answer": "1", "a": 1, "b": 0}\n'
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "cut.parquet"))
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "cut.parquet").read_bytes()[:300])
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps({**r, "batch": 1}) + "\n" for r in rows))
    capsys.readouterr()
    expected = {
        "blank.jsonl": "holds only blank lines",
        "broken.jsonl": "line 2 is not valid JSON",
        "latin.jsonl": "line 1 of",
        "cut.parquet": "not a readable parquet file",
        "batch.jsonl": "has a column named 'batch'",
    }
    for name, words in expected.items():
        assert main(["train", "--config", str(user["config"]), "--dataset", str(tmp_path / name)]) == 2, name
        err = _one_error_line(capsys)
        assert str(tmp_path / name) in err and words in err, err


def test_reprobe30_the_position_limit_is_checked_on_the_dataset(user, tmp_path, capsys):
    # The model has 512 positions; the config cannot know the prompts' lengths, the load does.
    assert (
        main(["train", "--config", str(user["config"]), "--dataset", str(user["train"]), "rl.max_new_tokens=505"]) == 2
    )
    err = _one_error_line(capsys)
    assert re.search(
        r"data\.(val_)?path: row \d+ of '.*' needs \d+ positions \(its prompt and rl\.max_new_tokens=505\), more than the model's max_position_embeddings=512",
        err,
    ), err
    config = tmp_path / "dpo.yaml"
    config.write_text(
        DPO_CONFIG.format(model=user["model"]).replace("max_response_length: 12", "max_response_length: 600")
    )
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({**r, "chosen": "7 " * 270}) + "\n" for r in _preference_rows(4)))
    assert main(["train", "--config", str(config), "--dataset", str(data), "--output_dir", str(tmp_path / "o")]) == 2
    err = _one_error_line(capsys)
    assert "data.path: row 0 of" in err and "(its prompt and its longer response), more than the model's" in err, err


SHIPPED_DPO = Path(__file__).resolve().parents[1] / "configs" / "dpo_offline_tiny.yaml"


def test_reprobe30_the_shipped_offline_dpo_config_learns_with_the_progress_bar_on(tmp_path, capsys):
    """configs/dpo_offline_tiny.yaml on a shortened schedule: the CLI exits 0 with the progress bar on (the
    default), and the implicit reward margin rises from its first to its last steps (the full run: shipped-configs)."""
    out = tmp_path / "run"
    assert main(["train", "--config", str(SHIPPED_DPO), "--output_dir", str(out), "trainer.steps=20"]) == 0
    captured = capsys.readouterr()
    assert "512 preference pairs" in captured.out and "done: step 19; margins of steps 0-1" in captured.out
    assert "margin=" in captured.err
    records = read_metrics(out / "metrics.jsonl")
    margins = [r["margins"] for r in records]
    assert len(margins) == 20 and sum(margins[-2:]) / 2 > sum(margins[:2]) / 2 + 0.01, margins
    assert (out / "hf" / "tokenizer.json").is_file()  # the shipped tokenizer travels with the export


def test_offline_dpo_takes_rl_epochs_passes_over_each_steps_pairs(tmp_path):
    """rl.epochs applies to a dataset's pairs as to sampled ones: epochs 2 is two updates on the same pairs.

    The step's logged loss is the mean over its updates: log 2 at the first update (the policy starts as the
    reference), lower at the second; were the second pass skipped, the mean would be log 2 / 2."""
    from rlcore.train import load_config, train

    def run(epochs: int):
        cfg = load_config(
            SHIPPED_DPO,
            [
                f"trainer.output_dir={tmp_path / str(epochs)}",
                "trainer.steps=1",
                "trainer.progress=false",
                "trainer.plot=false",
                f"rl.epochs={epochs}",
            ],
        )
        return train(cfg)

    one, two = run(1), run(2)
    assert one.records[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert math.log(2) / 2 + 0.1 < two.records[0]["loss"] < math.log(2) - 1e-4, two.records[0]["loss"]
    moved = [(a - b).abs().max() for a, b in zip(one.policy.parameters(), two.policy.parameters())]
    assert max(moved) > 0  # the second pass trained
