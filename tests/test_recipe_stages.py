"""The Recipe protocol and the stages each kind of recipe adds to the step, found by the recipe's type."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from rlcore import algos
from rlcore.train import (
    PAIR_TOKEN_COLUMNS,
    CharTokenizer,
    PolicyGradientStages,
    PreferenceStages,
    ScoringPlan,
    StepParts,
    build_model,
    load_config,
    pairs_stage,
    response_sequences,
    stages_for,
)
from rlcore.train.stages import advantages_stage
from tiny_runs import TINY

ROOT = Path(__file__).resolve().parents[1]
NAMED = [algos.grpo, algos.dr_grpo, algos.dapo, algos.gspo, algos.rloo, algos.reinforce_pp, algos.ppo]
LOGGED = ("scores", "mask", "prompt_mask", "iteration", "version")
TRAINER = ROOT / "src" / "rlcore" / "train" / "trainer.py"
BUILD = ROOT / "src" / "rlcore" / "train" / "build.py"
ASSEMBLY = [
    TRAINER,
    BUILD,
    *(ROOT / "src" / "rlcore" / "train" / f"{m}.py" for m in ("step_graph", "scoring", "world")),
]
NO_FORWARDS = ScoringPlan(False, 0, ref_stage=False)


@pytest.fixture(scope="module")
def models():
    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", TINY)
    torch.manual_seed(0)
    policy, reference = build_model(cfg, 16), build_model(cfg, 16)
    return policy, reference, build_model(cfg, 16, critic=True)


# --- the protocol -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [*NAMED, algos.dpo, lambda: algos.dpo(loss_type="ipo", reduce="mean")])
def test_every_recipe_is_a_recipe(make):
    assert isinstance(make(), algos.Recipe)


@pytest.mark.parametrize("not_a_recipe", [algos.gae, algos.grpo().advantages, {"loss": 1}, object()])
def test_what_lacks_counts_or_loss_is_not_a_recipe(not_a_recipe):
    assert not isinstance(not_a_recipe, algos.Recipe)


# --- finding a recipe's stages by its type -----------------------------------------------------------------


@pytest.mark.parametrize("make", NAMED)
def test_every_algorithm_gets_policy_gradient_stages(make):
    assert type(stages_for(make())) is PolicyGradientStages


def test_dpo_gets_preference_stages_and_no_critic():
    kind = stages_for(algos.dpo(beta=0.3))
    assert type(kind) is PreferenceStages and kind.critic is False


def test_only_a_value_loss_asks_for_a_critic():
    assert [stages_for(make()).critic for make in NAMED] == [False] * 6 + [True]
    assert stages_for(algos.ppo(kl_coef=0.0)).critic
    assert not stages_for(algos.ppo()._replace(value_loss=None)).critic
    assert stages_for(algos.grpo()._replace(value_loss=algos.value_loss)).critic


def test_a_subclass_finds_its_base_kind_and_a_new_kind_is_registered_by_type():
    class MyAlgorithm(algos.Algorithm):
        pass

    mine = MyAlgorithm(*algos.grpo())
    assert type(stages_for(mine)) is PolicyGradientStages

    class Ranking(NamedTuple):
        margin: float = 1.0

    class RankingStages:
        critic = False

        def __init__(self, recipe):
            self.recipe = recipe

    with pytest.raises(ValueError, match=r"recipe: got a Ranking, expected a recipe of a kind with registered stages"):
        stages_for(Ranking())
    stages_for.register(Ranking, RankingStages)
    kind = stages_for(Ranking(2.0))
    assert type(kind) is RankingStages and kind.recipe == Ranking(2.0)


@pytest.mark.parametrize("bad", [object(), "grpo", None])
def test_an_unknown_recipe_is_refused_naming_the_kinds(bad):
    with pytest.raises(ValueError, match=r"recipe: got a .*(Algorithm, DPO|DPO, Algorithm)"):
        stages_for(bad)


# --- the policy-gradient stages ------------------------------------------------------------------------


def _parts(models, *, critic=False, plan=NO_FORWARDS, **options):
    policy, reference, value_model = models
    return StepParts(policy, reference, value_model if critic else None, plan, logged=LOGGED, **options)


@pytest.mark.parametrize(
    ("recipe", "plan", "reads", "resource"),
    [
        (algos.grpo(kl_coef=0.0), NO_FORWARDS, ("scores", "mask", "group"), "cpu"),
        (algos.grpo(), ScoringPlan(False, 1), ("scores", "mask", "group", "ref_logp"), "device"),
        (algos.rloo(), ScoringPlan(True, 1), ("scores", "mask", "group", "old_logp", "ref_logp"), "device"),
        (algos.dapo(), NO_FORWARDS, ("scores", "mask", "group"), "cpu"),
    ],
)
def test_the_advantages_stage_reads_what_the_recipe_reads(models, recipe, plan, reads, resource):
    part = stages_for(recipe).graph(_parts(models, plan=plan, epochs=2))
    assert [s.name for s in part.stages] == ["advantages"]
    assert part.stages[0].inputs == reads and part.stages[0].outputs == ("advantages", "loss_mask")
    # Only the host's columns read: it runs on the host thread beside the device's forward, else on the device.
    assert part.stages[0].resource == resource
    # Without an old-policy forward the update's own forward runs ahead and writes old_logp.
    ahead = [] if plan.old_logp else ["policy_forward"]
    assert [s.name for s in part.ahead] == ahead
    written = [] if plan.old_logp else ["old_logp", "entropy"]
    assert part.inputs == ["prompts", "responses", "advantages", "loss_mask", *LOGGED, *written]
    assert part.recipe is recipe and part.epochs == 2


def test_the_advantages_stay_on_the_device_where_the_estimator_may_make_a_collective(models):
    # Batch whitening takes its moments over the data-parallel ranks: a collective beside the device's would race.
    dp = stages_for(algos.grpo(kl_coef=0.0)).graph(_parts(models, dp_group=object()))
    assert dp.stages[0].resource == "device"


def test_host_advantages_read_device_columns_from_host_memory():
    s = advantages_stage(algos.grpo(), inputs=("scores", "mask", "group"), resource="cpu")
    meta = {"scores": torch.tensor([1.0, 0.0]), "mask": torch.ones(2, 2, device="meta"), "group": torch.tensor([3, 3])}
    with pytest.raises(NotImplementedError):  # a meta tensor cannot come to host memory: the stage tried
        s.fn(meta)
    out = s.fn({**meta, "mask": torch.ones(2, 2)})
    assert out["advantages"].device.type == "cpu"


def test_ppo_scores_the_critic_before_gae_and_trains_it(models):
    part = stages_for(algos.ppo(kl_coef=0.0)).graph(_parts(models, critic=True))
    assert [s.name for s in part.stages] == ["old_values", "advantages"]
    assert part.stages[1].inputs[-1] == "old_values"
    assert part.stages[1].outputs == ("advantages", "loss_mask", "returns")
    assert part.stages[1].resource == "device"  # GAE reads the critic's values: a device column
    values = ["old_values", "returns"]
    assert part.inputs == ["prompts", "responses", "advantages", "loss_mask", *values, *LOGGED, "old_logp", "entropy"]
    rows = {**_rows(), "loss_mask": _rows()["mask"], "advantages": torch.zeros(2, 3)}
    with torch.no_grad():
        written = part.ahead[0].fn({k: rows[k] for k in part.ahead[0].inputs})
        batch = part.forward({**rows, **written})
        scored = ScoringPlan(True, 0, ref_stage=False)
        plain = (
            stages_for(algos.grpo())
            .graph(_parts(models, plan=scored))
            .forward({**rows, "old_logp": written["old_logp"]})
        )
    assert batch["values"].shape == (2, 3) and "values" not in plain
    torch.testing.assert_close(batch["old_logp"], batch["logp"])  # the forward run ahead wrote the old policy's
    torch.testing.assert_close(plain["logp"], batch["logp"])


def _rows():
    return {
        "prompts": torch.tensor([[0, 4, 5], [6, 7, 8]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "responses": torch.tensor([[9, 1, 0], [10, 11, 1]]),
        "mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        "iteration": torch.zeros(2, dtype=torch.long),
    }


def test_a_critic_that_does_not_match_the_value_loss_is_refused(models):
    with pytest.raises(ValueError, match=r"parts.critic: got NoneType, expected a value model"):
        stages_for(algos.ppo()).graph(_parts(models))
    with pytest.raises(ValueError, match=r"parts.critic: got .*, expected None"):
        stages_for(algos.grpo()).graph(_parts(models, critic=True))


def test_a_policy_gradient_recipe_needs_sampled_rows(models):
    with pytest.raises(ValueError, match=r"parts.sampled: got False, expected rows sampled by a rollout"):
        stages_for(algos.grpo()).graph(_parts(models, sampled=False))


# --- the preference stages -------------------------------------------------------------------------------


def test_online_dpo_pairs_the_samples_then_scores_them_under_the_reference(models):
    tok = CharTokenizer("0123456789+=")
    recipe = algos.dpo()
    part = stages_for(recipe).graph(_parts(models, tokenizer=tok, seed=7, epochs=3))
    assert [s.name for s in part.stages] == ["pairs", "ref_pair_logps"]
    assert part.stages[0].outputs == PAIR_TOKEN_COLUMNS and part.stages[1].inputs == PAIR_TOKEN_COLUMNS
    assert part.inputs == [*PAIR_TOKEN_COLUMNS, "ref_chosen_logps", "ref_rejected_logps", *LOGGED]
    assert part.recipe is recipe and part.epochs == 3


def test_offline_dpo_scores_the_datasets_pairs_and_takes_rl_epochs_passes(models):
    part = stages_for(algos.dpo()).graph(_parts(models, sampled=False, epochs=3)._replace(logged=("prompt_mask",)))
    assert [s.name for s in part.stages] == ["ref_pair_logps"]
    assert part.inputs == [*PAIR_TOKEN_COLUMNS, "ref_chosen_logps", "ref_rejected_logps", "prompt_mask"]
    assert part.epochs == 3  # rl.epochs passes over each step's pairs, as for sampled pairs


def test_preference_stages_refuse_what_they_cannot_run(models):
    with pytest.raises(ValueError, match=r"parts.seed, parts.tokenizer: got None"):
        stages_for(algos.dpo()).graph(_parts(models))
    with pytest.raises(ValueError, match=r"parts.context_parallel: got .*expected None"):
        stages_for(algos.dpo()).graph(_parts(models, sampled=False, context_parallel=(None, "ulysses")))


# --- the pairs stage ----------------------------------------------------------------------------------------


class _Letters:
    """A tokenizer of single letters: a=2, b=3, ...; <pad>=0, <eos>=1."""

    pad_token_id, eos_token_id = 0, 1
    alphabet = "abcdefgh"

    def encode(self, text):
        return [self.alphabet.index(c) + 2 for c in text]

    def decode(self, ids):
        return "".join(self.alphabet[i - 2] for i in ids if i > 1)


def test_response_sequences_by_hand():
    out = response_sequences(_Letters(), ["a", "ab"], ["ba", ""])
    assert out["input_ids"].tolist() == [[2, 3, 2, 1], [2, 3, 1, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert out["mask"].tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]


def test_pairs_put_the_answer_against_the_sample_and_perturb_a_correct_sample():
    tok = _Letters()
    rows = {
        "prompts": torch.tensor([[0, 2], [2, 3]]),  # "a" left-padded, "ab"
        "prompt_mask": torch.tensor([[0, 1], [1, 1]]),
        "answers": torch.tensor([[4, 5], [6, 0]]),  # "cd", "e"
        "answers_mask": torch.tensor([[True, True], [True, False]]),  # the dock's padding companion
        "responses": torch.tensor([[7, 7, 1], [6, 1, 0]]),  # "ff" (wrong), "e" (right)
        "mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "scores": torch.tensor([0.0, 1.0]),
        "iteration": torch.tensor([5, 5]),
        "row": torch.tensor([8, 9]),
    }
    s = pairs_stage(tok, seed=3)
    out = s.fn(rows)
    assert s.outputs == PAIR_TOKEN_COLUMNS

    def text(side, i):
        ids, scored = out[f"{side}_input_ids"][i], out[f"{side}_mask"][i]
        return tok.decode(ids[scored != 0].tolist()), ids[-1].item()

    assert [text("chosen", i) for i in range(2)] == [("cd", 1), ("e", 1)]
    assert text("rejected", 0) == ("ff", 1)  # a wrong sample is the rejected answer as sampled
    perturbed, eos = text("rejected", 1)  # a right one: the answer plus one letter
    assert eos == 1 and len(perturbed) == 2 and perturbed[0] == "e" and perturbed[1] in tok.alphabet
    assert [row.tolist() for row in out["chosen_attention_mask"]] == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert (
        s.fn(rows)["rejected_input_ids"][1].tolist() == out["rejected_input_ids"][1].tolist()
    )  # same step and row, same letter
    alone = s.fn({k: v[1:] for k, v in rows.items()})  # the row's letter does not depend on the other rows
    assert alone["rejected_input_ids"][0].tolist() == out["rejected_input_ids"][1].tolist()


# --- the trainer holds no branch on the recipe ---------------------------------------------------------------


def test_the_trainer_branches_on_no_algorithm_name_or_recipe_type():
    """``rl.algo`` is read in ``build_algorithm`` only; nothing in the trainer, the step graph, the model building or
    the scoring set-up tests a recipe's type or names DPO's columns."""
    offenders = []
    for path in ASSEMBLY:
        tree = ast.parse(path.read_text())
        resolvers = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_algorithm"]
        allowed = {id(n) for r in resolvers for n in ast.walk(r)}
        for node in ast.walk(tree):
            if id(node) in allowed:
                continue
            if isinstance(node, ast.Attribute) and node.attr in (
                "algo",
                "DPO",
                "PAIR_LOGP_COLUMNS",
                "PAIR_TOKEN_COLUMNS",
            ):
                offenders.append(f"{path.name} line {node.lineno}: {ast.unparse(node)}")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "isinstance"
                and "algos." in ast.unparse(node.args[1])
            ):
                offenders.append(f"{path.name} line {node.lineno}: {ast.unparse(node)}")
    assert not offenders, offenders


def test_train_reads_as_a_short_recipe():
    """``train()`` and its one helper assemble a run in at most 122 lines (docstrings included); the file stays small."""
    tree = ast.parse(TRAINER.read_text())
    sizes = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert sum(sizes[name] for name in ("train", "_train", "_Trained")) <= 120, sizes
    assert len(TRAINER.read_text().splitlines()) <= 400
