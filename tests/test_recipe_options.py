"""The config's recipe options: rl.policy_loss (+ args), rl.entropy_coef, rl.algo opd with model.teacher.

Each is refused with a ValueError naming its key when wrong, reaches the recipe the trainer
builds, changes its loss as it claims, and runs in the trainer."""

from pathlib import Path

import pytest
import torch
import transformers

from rlcore import algos
from rlcore.train import build_algorithm, load_config, parse_config, train
from rlcore.train.recipe_options import POLICY_LOSSES
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]
INLINE = {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
ARGS = {"dro": {"beta": 0.1}, "clip_cov": {"cov_fraction": 0.3, "cov_low": -1.0}}


def _cfg(rl=None, model=None):
    return parse_config({"model": {"model_name_or_path": INLINE, **(model or {})}, "rl": rl or {}})


def _batch(seed=0, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[:, 0] = True
    old = -torch.rand(b, t, generator=g) * 2
    return {
        "scores": torch.randint(0, 2, (b,), generator=g).float(),
        "group_ids": torch.arange(b) // 3,
        "mask": mask,
        "old_logp": old,
        "logp": (old + 0.3 * torch.randn(b, t, generator=g)).requires_grad_(),
        "ref_logp": -torch.rand(b, t, generator=g) * 2,
        "entropy": torch.rand(b, t, generator=g),
    }


@pytest.mark.parametrize(
    ("rl", "model", "key"),
    [
        ({"policy_loss": "ppo"}, None, "rl.policy_loss"),
        ({"policy_loss": "clip_cov", "policy_loss_args": {"cov_fractoin": 0.1}}, None, "rl.policy_loss_args"),
        ({"policy_loss": "clip_cov", "policy_loss_args": {"cov_fraction": 2.0}}, None, "rl.policy_loss_args"),
        ({"policy_loss": "dppo_tv", "policy_loss_args": {"clip_low": "x"}}, None, "rl.policy_loss_args"),
        ({"policy_loss": "dro"}, None, "rl.policy_loss_args"),  # no published beta
        ({"policy_loss_args": {"clip_low": 0.1}}, None, "rl.policy_loss_args"),  # args without a loss
        ({"algo": "dpo", "num_rollouts": 1, "policy_loss": "ppo_clip"}, None, "rl.policy_loss"),
        ({"algo": "dpo", "num_rollouts": 1, "entropy_coef": 0.1}, None, "rl.entropy_coef"),
        ({"entropy_coef": -0.1}, None, "rl.entropy_coef"),
        ({"algo": "opd"}, None, "model.teacher"),  # no teacher
        ({"algo": "opd"}, {"teacher": " "}, "model.teacher"),
        ({}, {"teacher": "."}, "model.teacher"),  # a teacher without opd
        ({"task_coef": 0.0}, None, "rl.task_coef"),  # an opd option without opd
        ({"opd_loss": "reverse_kl"}, None, "rl.opd_loss"),
        ({"algo": "opd", "beta": 0.1}, {"teacher": "."}, "rl.beta"),
        ({"algo": "opd", "teacher_coef": -1.0}, {"teacher": "."}, "rl.teacher_coef"),
        ({"opd_beta": 0.5}, None, "rl.opd_beta"),  # a jsd option without opd
        ({"algo": "opd", "opd_beta": 0.5}, {"teacher": "."}, "rl.opd_beta"),  # without opd_loss jsd
        ({"algo": "opd", "opd_loss": "reverse_kl", "opd_top_k": 4}, {"teacher": "."}, "rl.opd_top_k"),
        ({"algo": "opd", "opd_loss": "jsd", "opd_beta": 1.5}, {"teacher": "."}, "rl.opd_beta"),
        ({"algo": "opd", "opd_loss": "jsd", "opd_beta": True}, {"teacher": "."}, "rl.opd_beta"),
        ({"algo": "opd", "opd_loss": "jsd", "opd_top_k": 0}, {"teacher": "."}, "rl.opd_top_k"),
    ],
)
def test_bad_recipe_options_name_their_key(rl, model, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        _cfg(rl, model)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("algo", ["grpo", "dapo", "rloo"])
def test_policy_loss_replaces_the_recipes_own(name, algo):
    args = ARGS.get(name, {})
    algo_built = build_algorithm(_cfg({"algo": algo, "policy_loss": name, "policy_loss_args": args or None}))
    base = build_algorithm(_cfg({"algo": algo}))
    batch = base.advantages(_batch())
    counts = base.global_counts(batch)
    torch.manual_seed(0)  # clip_cov's ranking draws
    _, metrics = algo_built.loss(batch, **counts)
    torch.manual_seed(0)
    loss_t, _ = POLICY_LOSSES[name](batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"], **args)
    expected = algos.aggregate(loss_t, batch["mask"], mode=base.agg_mode, **counts)
    torch.testing.assert_close(metrics["pg_loss"], expected.detach())
    assert algo_built.agg_mode == base.agg_mode


def test_entropy_coef_subtracts_the_aggregated_entropy():
    base = build_algorithm(_cfg({"algo": "grpo", "beta": 0.0}))
    bonus = build_algorithm(_cfg({"algo": "grpo", "beta": 0.0, "entropy_coef": 0.25}))
    assert bonus.entropy_coef == 0.25
    batch = base.advantages(_batch(1))
    counts = base.global_counts(batch)
    entropy = algos.aggregate(torch.where(batch["mask"], batch["entropy"], 0.0), batch["mask"], mode=base.agg_mode)
    torch.testing.assert_close(bonus.loss(batch, **counts)[0], base.loss(batch, **counts)[0] - 0.25 * entropy)


@pytest.mark.parametrize("opd_loss", ["reward", "reverse_kl"])
def test_opd_builds_on_policy_distillation(tmp_path, opd_loss):
    algo = build_algorithm(
        _cfg({"algo": "opd", "opd_loss": opd_loss, "teacher_coef": 0.5, "task_coef": 0.0}, {"teacher": str(tmp_path)})
    )
    ref = algos.on_policy_distillation(teacher_coef=0.5, task_coef=0.0, loss=opd_loss)
    batch = _batch(2)
    a, b = algo.advantages(batch), ref.advantages(batch)
    torch.testing.assert_close(algo.loss(a, **algo.global_counts(a))[0], ref.loss(b, **ref.global_counts(b))[0])
    # The teacher is read every step; the dense reward also reads the sampling policy's log-probs first.
    assert algos.scoring_needs(algo) == algos.ScoringNeeds(old_logp=opd_loss == "reward", ref_logp=True)


def test_opd_jsd_builds_the_full_vocabulary_recipe(tmp_path):
    cfg = {"algo": "opd", "opd_loss": "jsd", "opd_beta": 0.25, "opd_top_k": 3, "teacher_coef": 0.5}
    algo = build_algorithm(_cfg(cfg, {"teacher": str(tmp_path)}))
    ref = algos.on_policy_distillation(teacher_coef=0.5, loss="jsd", beta=0.25, top_k=3)
    assert (
        (algo.distill.keywords, algo.distill_coef)
        == (ref.distill.keywords, ref.distill_coef)
        == ({"beta": 0.25, "top_k": 3}, 0.5)
    )
    # The teacher's logits come in the update's forward: no old-policy or reference stage.
    assert algos.scoring_needs(algo) == algos.ScoringNeeds(old_logp=False, ref_logp=False, logits=True)


def test_opd_jsd_is_refused_under_context_parallelism(tmp_path):
    with pytest.raises(ValueError, match="'parallel.context_parallel': got 2 with rl.opd_loss 'jsd'"):
        load_config(
            ROOT / "configs" / "opd_tiny.yaml",
            [f"model.teacher={tmp_path}", "rl.opd_loss=jsd", "parallel.context_parallel=2", "parallel.data_parallel=1"],
        )


def _teacher(path: Path, vocab: int) -> str:
    config = transformers.AutoConfig.for_model(**{**INLINE, "hidden_size": 32, "vocab_size": vocab})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a peaked teacher, far from the near-uniform student of a two-step warm-up
        model.lm_head.weight.mul_(50.0)
    model.save_pretrained(path)
    return str(path)


def _run(tmp_path, *extra):
    return load_config(
        ROOT / "configs" / "opd_tiny.yaml", [*TINY, f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=2", *extra]
    )


def test_opd_trains_against_the_teacher(tmp_path):
    """The teacher is the reference: the first step's KL is not 0 (a warmed-up policy's own is), and with
    ``rl.task_coef`` 0 the loss is the reverse-KL term alone."""
    teacher = _teacher(tmp_path / "teacher", vocab=9)  # the reversal task over "abcdef": 6 letters, '>', pad, eos
    run = train(_run(tmp_path, f"model.teacher={teacher}", "rl.opd_loss=reverse_kl"))
    first = run.records[0]
    assert first["kl"] > 0.05  # the student's KL to the teacher (k3), logged every step
    assert first["pg_loss"] == pytest.approx(0.0, abs=1e-6)  # no task advantages
    assert first["loss"] != pytest.approx(0.0, abs=1e-4)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in run.records)


@pytest.mark.parametrize(
    "extra",
    [
        [],  # two updates per step: the old policy's forward is a stage, the update's own forward has the logits
        ["rl.mini_batch_size=4"],  # one update: the update's forward runs ahead while the rows are scored
        ["rl.opd_top_k=3", "rl.opd_beta=0.5", "rl.task_coef=1.0"],
    ],
)
def test_opd_jsd_trains_on_the_full_distributions(tmp_path, extra):
    """``rl.opd_loss: jsd``: the teacher's logits meet the student's in the update; the distillation term is the loss
    (no task advantages with ``rl.task_coef`` 0), the KL to the teacher is logged every step, and the student moves."""
    teacher = _teacher(tmp_path / "teacher", vocab=9)
    run = train(_run(tmp_path, f"model.teacher={teacher}", "rl.opd_loss=jsd", *extra))
    for r in run.records:
        assert r["kl"] > 0.05 and r["distill"] > 0.01
        if "rl.task_coef=1.0" not in extra:  # forward KL alone: the loss is its term
            assert r["pg_loss"] == pytest.approx(0.0, abs=1e-6)
            assert r["loss"] == pytest.approx(r["distill"], rel=1e-5)
    assert run.records[1]["distill"] != run.records[0]["distill"]


def test_missing_teacher_is_refused_before_the_run(tmp_path):
    with pytest.raises(ValueError, match="'model.teacher': got '/nonexistent/teacher', which is not a directory"):
        train(_run(tmp_path, "model.teacher=/nonexistent/teacher"))
    assert not (tmp_path / "run").exists()


def test_teacher_with_another_vocabulary_is_refused(tmp_path):
    teacher = _teacher(tmp_path / "teacher", vocab=7)
    with pytest.raises(ValueError, match="'model.teacher'.*vocab_size 7"):
        train(_run(tmp_path, f"model.teacher={teacher}"))


def test_clip_cov_and_entropy_bonus_run_in_the_trainer(tmp_path):
    cfg = load_config(
        ROOT / "configs" / "grpo_tiny.yaml",
        [*TINY, f"trainer.output_dir={tmp_path}", "trainer.steps=2", "rl.mini_batch_size=4", "rl.policy_loss=clip_cov",
         "rl.policy_loss_args={cov_fraction: 0.5, cov_low: -10.0}", "rl.entropy_coef=0.5"],
    )  # fmt: skip
    records = train(cfg).records
    assert all("cov_frac" in r for r in records)  # the clip_cov loss's own metric
    # beta 0: the loss is the policy loss minus the entropy bonus, which is not 0.
    assert all(r["loss"] < r["pg_loss"] - 1e-3 for r in records)


def test_the_shipped_student_names_its_teachers_config_relative_to_itself():
    cfg = load_config(ROOT / "configs" / "opd_tiny.yaml")
    assert cfg.model.teacher == str(ROOT / "configs" / "opd_teacher_tiny.yaml")


def test_a_teacher_config_is_trained_once_into_the_run_folder(tmp_path, monkeypatch):
    """``model.teacher`` naming a config: the first run trains it into output_dir/teacher, a repeated run reuses it."""
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / "opd_teacher_tiny.yaml").read_text())
    raw["model"]["model_name_or_path"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    raw["rl"].update(batch_size=2, mini_batch_size=2, num_rollouts=2)
    raw["trainer"].update(steps=1, warmup_steps=2, warmup_batch_size=8, progress=False, threads=1, reward_workers=0)
    teacher_yaml = tmp_path / "teacher.yaml"
    teacher_yaml.write_text(yaml.safe_dump(raw))
    student = _run(tmp_path, f"model.teacher={teacher_yaml}")

    with monkeypatch.context() as m:  # under torchrun the teacher is not trained by every rank: refused, nothing made
        m.setenv("WORLD_SIZE", "2")
        with pytest.raises(ValueError, match=r"model.teacher': got the config .* under torchrun"):
            train(student)
    made = tmp_path / "run" / "teacher" / "hf"
    assert not made.exists()

    first = train(student)
    assert (made / "config.json").is_file() and first.records
    stamp = (made / "config.json").stat().st_mtime_ns
    train(student, overwrite=True)
    assert (made / "config.json").stat().st_mtime_ns == stamp  # reused, not trained again

    bad = tmp_path / "bad.yaml"
    bad.write_text("rl: {bacth_size: 2}\n")
    with pytest.raises(ValueError, match=r"model.teacher': the config .*bacth_size"):
        train(_run(tmp_path / "other", f"model.teacher={bad}"))
