"""No forward the step does not need: the old-policy and reference forwards the trainer skips, and PPO's epochs."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from rlcore import algos
from rlcore.train import ScoringPlan, load_config, scoring_plan, train
from rlcore.train.stages import forward_ahead, rl_forward, rl_outputs, update_stage, with_logged_reference
from tiny_runs import TINY, tiny_qwen2

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "configs" / "grpo_tiny.yaml"
ONE_UPDATE = ["rl.mini_batch_size=4"]  # TINY's batch_size is 4 prompts


def _cfg(*overrides: str, config: Path = MAIN):
    return load_config(config, [*TINY, "trainer.log_ref_kl_every=0", *overrides])


# --- which recipe reads what ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("algo", "old", "ref"),
    [
        (algos.grpo(kl_coef=0.0), False, False),
        (algos.grpo(), False, True),
        (algos.dapo(), False, False),
        (algos.dr_grpo(), False, False),
        (algos.gspo(), False, False),
        (algos.ppo(), True, True),
        (algos.ppo(kl_coef=0.0), False, False),
        (algos.rloo(), True, True),
        (algos.rloo(kl_coef=0.0), False, False),
        (algos.reinforce_pp(), True, True),
        (algos.reinforce_pp(kl_coef=0.0), False, False),
        (algos.grpo(kl_coef=0.0)._replace(kl_coef=algos.adaptive_kl_controller(init_kl_coef=0.1)), False, True),
    ],
)
def test_scoring_needs_of_the_named_recipes(algo, old, ref):
    assert algos.scoring_needs(algo) == algos.ScoringNeeds(old, ref)


def test_a_shaping_step_it_does_not_know_counts_as_reading_both():
    custom = algos.grpo(kl_coef=0.0)._replace(shaping=lambda b: {**b, "scores": b["scores"] * 2})
    assert algos.scoring_needs(custom) == algos.ScoringNeeds(True, True)
    nested = algos.ppo(kl_coef=0.0)._replace(shaping=algos.chain(algos.token_rewards_shaping, lambda b: b))
    assert algos.scoring_needs(nested) == algos.ScoringNeeds(True, True)
    assert algos.scoring_needs(object()) == algos.ScoringNeeds(True, True)


@pytest.mark.parametrize("shaping", [algos.kl_reward_shaping, algos.kl_score_shaping])
def test_kl_shaping_at_coefficient_zero_reads_no_log_probs(shaping):
    batch = {"scores": torch.tensor([1.0, 0.0]), "mask": torch.ones(2, 3), "rewards": torch.zeros(2, 3)}
    assert shaping(batch, kl_coef=0.0) is batch  # no old_logp / ref_logp in the batch, and nothing raised
    with pytest.raises(ValueError, match="old_logp"):
        shaping(batch, kl_coef=0.1)


# --- the trainer's plan ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "plan"),
    [
        ([*ONE_UPDATE], ScoringPlan(False, 0, ref_stage=False)),  # the main job's shape: beta 0, one update per batch
        ([*ONE_UPDATE, "trainer.log_ref_kl_every=5"], ScoringPlan(False, 5, ref_stage=False)),
        ([*ONE_UPDATE, "rl.old_logp=forward"], ScoringPlan(True, 0, ref_stage=False)),
        ([], ScoringPlan(True, 0, ref_stage=False)),  # two mini-batches: the second update's policy is not the sampler
        ([*ONE_UPDATE, "rl.epochs=2"], ScoringPlan(True, 0, ref_stage=False)),
        # Async: rows may come from an older policy. The decoupled objective (auto) anchors the ratio at the
        # update's start and weighs by the sampler's log-probs: no forward, but not run ahead of an update.
        ([*ONE_UPDATE, "deploy.async_infer=true"], ScoringPlan(False, 0, ref_stage=False, ahead=False)),
        (
            [*ONE_UPDATE, "deploy.async_infer=true", "rl.behaviour_weights=none"],
            ScoringPlan(True, 0, ref_stage=False, ahead=False, old_in_update=True),
        ),
        # Async with two updates per batch: the proximal forward runs in the update, before its first step.
        (["deploy.async_infer=true"], ScoringPlan(True, 0, ref_stage=False, ahead=False, old_in_update=True)),
        ([*ONE_UPDATE, "rl.behaviour_weights=mask"], ScoringPlan(False, 0, ref_stage=False)),
        ([*ONE_UPDATE, "rl.beta=0.1"], ScoringPlan(False, 1)),  # the KL term reads the reference every step
        ([*ONE_UPDATE, "rl.algo=ppo"], ScoringPlan(False, 0, ref_stage=False)),
        ([*ONE_UPDATE, "rl.algo=ppo", "rl.beta=0.1"], ScoringPlan(True, 1)),  # KL in the reward: before the update
        ([*ONE_UPDATE, "rl.algo=dapo", "rl.beta=null"], ScoringPlan(False, 0, ref_stage=False)),
    ],
)
def test_scoring_plan(overrides, plan):
    from rlcore.train.build import build_algorithm

    cfg = _cfg("rl.beta=0.0", *overrides)
    assert scoring_plan(cfg, build_algorithm(cfg)) == plan


@pytest.mark.parametrize(
    ("overrides", "mode"),
    [
        ([], None),
        (["deploy.async_infer=true"], "truncate"),
        (["rl.behaviour_weights=mask", "rl.behaviour_cap=3"], "mask"),
    ],
)
def test_behaviour_weights_resolve_into_the_recipe(overrides, mode):
    from rlcore.train.build import build_algorithm

    algo = build_algorithm(_cfg(*overrides))
    if mode is None:
        assert algo.behaviour_weights is None
    else:
        assert algo.behaviour_weights.keywords["mode"] == mode
        assert algo.behaviour_weights.keywords["cap"] == (3.0 if mode == "mask" else 2.0)


def test_dpo_takes_no_behaviour_weights():
    with pytest.raises(ValueError, match="rl.behaviour_weights.*dpo"):
        load_config(ROOT / "configs" / "dpo_tiny.yaml", [*TINY, "rl.num_rollouts=1", "rl.behaviour_weights=truncate"])


def test_dpo_and_context_parallel_keep_both_forwards():
    from rlcore.train.build import build_algorithm

    cfg = _cfg(*ONE_UPDATE, "rl.beta=0.0")
    assert scoring_plan(cfg, build_algorithm(cfg), context_parallel=True) == ScoringPlan(True, 1)
    dpo = load_config(ROOT / "configs" / "dpo_tiny.yaml", [*TINY, "rl.num_rollouts=1", "rl.mini_batch_size=4"])
    assert scoring_plan(dpo, build_algorithm(dpo)) == ScoringPlan(True, 1)


@pytest.mark.parametrize("updates", [[], ONE_UPDATE])
def test_a_distillation_term_reads_the_teacher_in_the_update_every_step(updates):
    """The teacher's logits come in the update's forward: no reference stage, and the logged KL on every step."""
    cfg = _cfg(*updates)
    one = bool(updates)
    plan = scoring_plan(cfg, algos.on_policy_distillation(loss="jsd"))
    assert plan == ScoringPlan(not one, 1, ref_stage=False)  # log_ref_kl_every 0 would log it never


@pytest.mark.parametrize(
    "key", ["rl.old_logp=sometimes", "trainer.log_ref_kl_every=-1", "rl.behaviour_weights=clip", "rl.behaviour_cap=0"]
)
def test_bad_plan_keys_are_refused_by_name(key):
    with pytest.raises(ValueError, match=key.split("=")[0].replace(".", r"\.")):
        _cfg(key)


# --- the skipped forwards change nothing ----------------------------------------------------------------


def _run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    cfg = _cfg(*ONE_UPDATE, "rl.beta=0.0", "trainer.steps=4", f"trainer.output_dir={tmp_path / name}", *overrides)
    return train(cfg).records


def test_skipped_forwards_give_the_full_steps_losses_and_metrics(tmp_path):
    """beta 0, one update per batch: without the old-policy and reference forwards every logged value agrees to 1e-6."""
    lean = _run(tmp_path, "lean", "trainer.log_ref_kl_every=2")
    full = _run(tmp_path, "full", "rl.old_logp=forward", "trainer.log_ref_kl_every=1")
    assert "busy_s/old_logp" not in lean[0] and "busy_s/old_logp" in full[0]
    assert "busy_s/policy_forward" in lean[0] and "busy_s/policy_forward" not in full[0]  # the update's, run ahead
    assert [("kl" in r) for r in lean] == [True, False, True, False]  # the reference ran at steps 0 and 2
    for a, b in zip(lean, full):
        shared = [
            k
            for k in a
            if k in b and not k.startswith(("busy_s", "bubble", "step_time", "tokens_per_s", "sync", "checkpoint"))
        ]
        assert {"loss", "reward", "entropy", "pg_loss", "ratio_max"} <= set(shared)
        for k in shared:
            assert a[k] == pytest.approx(b[k], abs=1e-6), (a["step"], k)


def test_the_skipped_reference_forward_leaves_no_kl_and_plots_the_entropy(tmp_path):
    records = _run(tmp_path, "never", "trainer.plot=true")
    assert all("kl" not in r for r in records) and all(r["entropy"] > 0 for r in records)
    assert (tmp_path / "never" / "curves.png").stat().st_size > 1000


def test_with_logged_reference_scores_only_on_its_steps():
    from rlcore.models import load_causal_lm

    reference = load_causal_lm(tiny_qwen2(11), seed=1)
    seen = []
    forward = with_logged_reference(lambda b: seen.append("ref_logp" in b) or b, reference, every=3)
    rows = {
        "prompts": torch.tensor([[3, 4], [3, 4]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "responses": torch.tensor([[5, 1], [6, 0]]),
        "mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
    }
    outs = [forward({**rows, "iteration": torch.full((2,), i)}) for i in range(7)]
    assert seen == [True, False, False, True, False, False, True]
    assert outs[0]["ref_logp"].shape == (2, 2) and float(outs[0]["ref_logp"][1, 1]) == 0.0
    assert outs[0]["ref_logp"][0].lt(0).all() and reference.training  # its mode is restored
    with pytest.raises(ValueError, match="every: got 0"):
        with_logged_reference(lambda b: b, reference, every=0)


def _scored_rows(iteration: int = 0) -> dict[str, torch.Tensor]:
    return {
        "prompts": torch.tensor([[3, 4], [3, 4], [0, 7]]),
        "prompt_mask": torch.tensor([[1, 1], [1, 1], [0, 1]]),
        "responses": torch.tensor([[5, 1], [6, 0], [2, 2]]),
        "mask": torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]),
        "iteration": torch.full((3,), iteration),
        "advantages": torch.tensor([[0.5, 0.5], [-1.0, 0.0], [2.0, 2.0]]),
        "loss_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_ahead_gives_the_update_the_same_batch_and_gradient(dtype):
    """The update's forward run as a stage before the scores: the recipe sees the same values and gradients."""
    from rlcore.models import load_causal_lm

    policy = load_causal_lm(tiny_qwen2(11), seed=2).to(dtype)
    rows = _scored_rows()
    algo = algos.grpo(kl_coef=0.0)
    grads = []
    for ahead in (False, True):
        policy.zero_grad()
        if ahead:
            s, forward = forward_ahead(rl_outputs(policy))
            written = s.fn({k: rows[k] for k in s.inputs})
            batch = forward({**rows, **written})
        else:
            batch = rl_forward(policy)(rows)
            batch["old_logp"] = batch["logp"].detach()
            written = {"old_logp": batch["old_logp"], "entropy": batch["entropy"].detach()}
        loss, _ = algo.loss(batch, **algo.global_counts(batch))
        loss.backward()
        grads.append([p.grad.clone() for p in policy.parameters()])
        assert not written["old_logp"].requires_grad and torch.equal(written["old_logp"], batch["logp"].detach())
        assert torch.equal(batch["mask"], rows["loss_mask"]) and torch.equal(batch["advantages"], rows["advantages"])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_forward_ahead_refuses_an_update_of_other_rows():
    from rlcore.models import load_causal_lm

    s, forward = forward_ahead(rl_outputs(load_causal_lm(tiny_qwen2(11), seed=2)))
    rows = _scored_rows(iteration=4)
    with pytest.raises(RuntimeError, match="iteration 4 takes 3 rows, but the forward kept nothing"):
        forward(rows)
    s.fn({k: rows[k] for k in s.inputs})
    with pytest.raises(RuntimeError, match="iteration 4 takes 2 rows, but the forward kept 3 other rows"):
        forward({k: v[:2] for k, v in rows.items()})
    s.fn({k: rows[k] for k in s.inputs})
    with pytest.raises(RuntimeError, match="iteration 4 takes 3 rows, but the forward kept 3 other rows"):
        forward({k: v.flip(0) for k, v in rows.items()})  # the same number of rows, dealt differently


# --- PPO's epochs ------------------------------------------------------------------------------------


def test_update_stage_epochs_pass_over_the_mini_batches_in_order():
    seen = []

    def forward(b):
        return {"x": b["x"].float()}

    class Recipe:
        def global_counts(self, batch, *, process_group=None):
            return {}

        def loss(self, batch):
            seen.append(batch["x"].tolist())
            return batch["x"].float().sum(), {}

    s = update_stage(forward, Recipe(), lambda loss, rows: None, inputs=["x"], micro_batch=2, epochs=3)
    assert s.micro_batch is None  # the whole iteration per call
    out = s.fn({"x": torch.arange(4)})
    assert seen == [[0, 1], [2, 3]] * 3 and out["loss"].tolist() == [1.0, 1.0, 5.0, 5.0]
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="epochs"):
            update_stage(forward, Recipe(), lambda loss, rows: None, inputs=["x"], micro_batch=2, epochs=bad)


def test_update_stage_prepare_runs_once_per_iteration_before_its_first_step():
    """The old-policy forward inside the update: once over the whole iteration, with the weights before any step."""
    weight = torch.zeros(())
    events = []

    def prepare(b):
        events.append(("prepare", float(weight), b["x"].tolist()))
        return {"old": b["x"].float() + weight}

    class Recipe:
        def global_counts(self, batch, *, process_group=None):
            return {}

        def loss(self, batch):
            events.append(("update", batch["x"].tolist(), batch["old"].tolist()))
            return batch["x"].float().sum(), {}

    def step(loss, rows):
        weight.add_(1.0)

    s = update_stage(lambda b: dict(b), Recipe(), step, inputs=["x"], micro_batch=2, prepare=prepare)
    assert s.micro_batch is None  # the whole iteration per call
    s.fn({"x": torch.arange(4)})
    assert events == [("prepare", 0.0, [0, 1, 2, 3]), ("update", [0, 1], [0.0, 1.0]), ("update", [2, 3], [2.0, 3.0])]


def test_config_epochs_make_that_many_passes(tmp_path, monkeypatch):
    from rlcore.train import optim as optim_module

    updates = []
    real = optim_module.Optimiser.__call__

    @functools.wraps(real)
    def counted(self, loss, rows):
        updates.append(int(rows["iteration"][0]))
        return real(self, loss, rows)

    monkeypatch.setattr(optim_module.Optimiser, "__call__", counted)
    records = train(_cfg("rl.epochs=2", "trainer.steps=2", f"trainer.output_dir={tmp_path}")).records
    # TINY: 4 prompts, mini-batches of 2: two updates per pass, two passes per step.
    assert updates == [0, 0, 0, 0, 1, 1, 1, 1] and len(records) == 2
