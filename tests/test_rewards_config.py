"""Rewards from the config: verified maths (against math-verify), timeouts, reward models, references, weights."""

from __future__ import annotations

import pickle
import re
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_helpers import math_verify_verdict
from rlcore.rewards import (
    BaseReward,
    RewardModel,
    RewardPool,
    VerifiedMath,
    Weighted,
    build_reward,
    close_reward,
    extract_final_answer,
    reward_metrics,
)
from rlcore.testing.hf_fixtures import build_tiny_reward_model

PATHOLOGICAL = r"\boxed{9^{9^{9^{9^{9}}}}}"

# Tricky verified-maths cases: (reference answer, response, the verdict math-verify gives).
CASES = [
    # fractions
    ("1/2", r"The answer is \boxed{\frac{1}{2}}.", True),
    ("0.5", r"So we get \boxed{\frac12}", True),
    (r"\frac{1}{2}", r"Hence \boxed{0.5}", True),
    (r"\dfrac{3}{4}", r"\boxed{\tfrac{3}{4}}", True),
    ("6", r"\boxed{\frac{12}{2}}", True),
    ("1/3", r"\boxed{0.333}", False),
    ("2/3", r"\boxed{\frac{4}{6}}", True),
    ("3/4", "so the ratio is 3/4", True),
    # LaTeX forms
    (r"\frac{\sqrt{2}}{2}", r"\boxed{\frac{1}{\sqrt{2}}}", True),
    (r"\sqrt{8}", r"\boxed{2\sqrt{2}}", True),
    (r"\pi", r"\boxed{\pi}", True),
    (r"\infty", r"\boxed{\infty}", True),
    ("10^{3}", r"\boxed{1000}", True),
    (r"\frac{1}{2}", r"\boxed{\left(\frac{1}{2}\right)}", True),
    # nested \boxed{} and several boxes
    ("3", r"\boxed{\boxed{3}}", True),
    (r"\frac{1}{\sqrt{3}}", r"\boxed{\frac{\sqrt{3}}{3}}", True),
    # units and percentages
    ("5", r"\boxed{5\text{ cm}}", True),
    ("5", r"\boxed{5 \text{cm}}", True),
    ("10", r"\boxed{10^\circ}", True),
    (r"50\%", r"\boxed{50\%}", True),
    ("0.5", r"\boxed{50\%}", True),
    # thousands separators
    ("1000", r"\boxed{1,000}", True),
    ("1000", "#### 1,000", True),
    ("1234567", "the total is 1,234,567 dollars", True),
    ("1,000", "#### 1000", True),
    # negative numbers
    ("-3", r"\boxed{-3}", True),
    ("-3", "#### -3", True),
    ("-3", r"\boxed{3}", False),
    ("-0.5", r"\boxed{-\frac{1}{2}}", True),
    ("-0.5", r"\boxed{\frac{-1}{2}}", True),
    ("-12", "it drops to -12", True),
    # equivalent forms and sets
    ("2x+2", r"\boxed{2(x+1)}", True),
    ("x^2-1", r"\boxed{(x-1)(x+1)}", True),
    (r"\{1,2\}", r"\boxed{\{2,1\}}", True),
    ("[0,1]", r"\boxed{[0, 1]}", True),
    ("[0,1]", r"\boxed{(0, 1)}", False),
    ("x=2", r"\boxed{2}", True),
    ("2", r"\boxed{x=2}", True),
    ("3.14159", r"\boxed{\pi}", False),
    # GSM8K-style and last-number answers
    ("72", "She has 72 apples.\n#### 72", True),
    ("12", "#### 12.0", True),
    ("12", "#### 13", False),
    ("7", "first 3 then 5 and finally 7", True),
    ("7", "first 3 then 7 and finally 5", False),
    ("2", "no answer here", False),
    (4, "2 + 2 = 4", True),
]

# Where rlcore's extraction rule decides (the last complete box wins, as in MATH's
# grader) rather than math-verify's own search of the whole text.
EXTRACTION_CASES = [
    ("7", r"first \boxed{5}, corrected: \boxed{7}", True),
    ("5", r"first \boxed{5}, corrected: \boxed{7}", False),
    ("4", r"\boxed{4} and then a cut-off \boxed{\frac{1}{", True),
    ("9", "#### 9\nafterthought: 11", True),
]


@pytest.fixture(scope="module")
def math_reward():
    # A generous timeout: on a loaded machine a plain comparison can take over a second.
    reward = VerifiedMath(timeout=60.0)
    yield reward
    reward.close()


@pytest.fixture(scope="module")
def quick_math_reward():
    # A short timeout, for the pathological answer (long enough for the plain ones beside it).
    reward = VerifiedMath(timeout=3.0)
    yield reward
    reward.close()


def test_math_table_agrees_with_math_verify(math_reward):
    assert len(CASES) >= 40
    scores = math_reward(["q"] * len(CASES), [c[1] for c in CASES], answers=[c[0] for c in CASES])
    for (gold, response, expected), score in zip(CASES, scores.tolist()):
        assert math_verify_verdict(gold, response) == expected, (gold, response)  # the table is math-verify's
        assert bool(score) == expected, (gold, response)
    metrics = math_reward.pop_metrics()
    assert metrics["checked"] == len(CASES) and metrics["timeouts"] == 0
    assert metrics["correct"] == sum(c[2] for c in CASES)


def test_last_complete_box_wins(math_reward):
    scores = math_reward(["q"] * 4, [c[1] for c in EXTRACTION_CASES], answers=[c[0] for c in EXTRACTION_CASES])
    assert [bool(s) for s in scores.tolist()] == [c[2] for c in EXTRACTION_CASES]


def test_pathological_answer_times_out_scores_zero_and_is_counted(quick_math_reward):
    quick_math_reward(["q"], ["\\boxed{1}"], answers=["1"])  # the worker is up
    quick_math_reward.pop_metrics()
    start = time.monotonic()
    scores = quick_math_reward(["q"], [PATHOLOGICAL], answers=["1"])
    elapsed = time.monotonic() - start
    assert scores.tolist() == [0.0]
    assert elapsed < quick_math_reward.timeout + 1.0, elapsed  # the bound: the timeout plus one second
    assert quick_math_reward.pop_metrics()["timeouts"] == 1
    # the next items are checked by the replacement worker
    scores = quick_math_reward(["q"] * 3, ["\\boxed{2}", PATHOLOGICAL, "#### 5"], answers=["2", "1", "5"])
    assert scores.tolist() == [1.0, 0.0, 1.0]
    assert quick_math_reward.pop_metrics()["timeouts"] == 1


def test_timeout_works_off_the_main_thread(quick_math_reward):
    out = {}
    thread = threading.Thread(
        target=lambda: out.update(s=quick_math_reward(["q"] * 2, [PATHOLOGICAL, "3"], answers=[1, 3]))
    )
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert out["s"].tolist() == [0.0, 1.0]


def test_math_reward_pickles_and_rejects_bad_input(math_reward):
    copy = pickle.loads(pickle.dumps(math_reward))
    try:
        assert copy(["q"], ["\\boxed{\\frac{2}{4}}"], answers=["0.5"]).tolist() == [1.0]
    finally:
        copy.close()
    with pytest.raises(ValueError, match="answers: got None, expected 2"):
        math_reward(["q"] * 2, ["1", "2"])
    with pytest.raises(ValueError, match="timeout: got 0"):
        VerifiedMath(timeout=0)
    assert math_reward(["q"], ["no digits"], answers=["1"]).tolist() == [0.0]
    assert math_reward.pop_metrics()["no_answer"] == 1


_ATOMS = st.sampled_from(["1", "x", "\\frac{1}{2}", "\\sqrt{3}", "a+b", " "])


@st.composite
def _braced(draw, depth=0):
    parts = draw(st.lists(_ATOMS if depth > 2 else st.one_of(_ATOMS, _braced(depth + 1)), min_size=1, max_size=3))
    return "".join(p if p in {"1", "x", "\\frac{1}{2}", "\\sqrt{3}", "a+b", " "} else "{" + p + "}" for p in parts)


@settings(max_examples=40)
@given(inner=_braced(), prefix=st.text(alphabet="ab 12#\n", max_size=10))
def test_extract_boxed_with_nested_braces(inner, prefix):
    found = extract_final_answer(f"{prefix}\\boxed{{{inner}}} done")
    if inner.strip():
        assert found == ("boxed", inner.strip())


def test_extract_final_answer_rules():
    assert extract_final_answer(r"\boxed{\boxed{3}}") == ("boxed", "3")
    assert extract_final_answer(r"\boxed{4} then \boxed{\frac{1}{") == ("boxed", "4")
    assert extract_final_answer("a\n#### 1,000 apples\nthanks 3") == ("####", "1,000 apples")
    assert extract_final_answer("it costs -3/4 or 1,250.5") is None  # unmarked: math-verify's extraction reads it
    assert extract_final_answer(r"\boxed{\left\{ x \right.} ok") == ("boxed", r"\left\{ x \right.")
    assert extract_final_answer("no answer") is None


USER_FILE = """
from rlcore.rewards import BaseReward


class QualityReward(BaseReward):
    def __init__(self):
        super().__init__()

    def forward(self, prompts, responses, **kwargs):
        # the seed's section 4.3, unchanged
        reward = [len(r) > 100 for r in responses]
        return reward


class Threshold(BaseReward):
    def __init__(self, min_length=1):
        super().__init__()
        self.min_length = min_length

    def forward(self, prompts, responses, **kwargs):
        return [len(r) >= self.min_length for r in responses]


def answer_seen(prompts, responses, *, answers, bonus=1.0, **kwargs):
    return [bonus * (str(a) in r) for r, a in zip(responses, answers)]
"""


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "my_rewards.py").write_text(USER_FILE)
    (tmp_path / "broken_rewards.py").write_text("import definitely_not_installed_pkg\n")
    return tmp_path


def test_seed_style_reward_file_and_weights(user_dir):
    reward = build_reward(
        [
            {"reward": "my_rewards.py:QualityReward", "weight": 0.5},
            {"reward": "my_rewards.py:Threshold", "kwargs": {"min_length": 5}, "name": "long5"},
            {"reward": "my_rewards.py:answer_seen", "weight": 2.0, "kwargs": {"bonus": 0.25}},
            "length",
        ],
        base_dir=user_dir,
    )
    responses = ["x" * 101 + " 7", "abc"]
    columns = {"answers": ["7", "9"]}
    expected = 0.5 * torch.tensor([1.0, 0.0]) + torch.tensor([1.0, 0.0]) + 2.0 * torch.tensor([0.25, 0.0]) + 1.0
    assert torch.equal(reward(["p", "q"], responses, **columns), expected)
    assert list(reward.components(["p", "q"], responses, **columns)) == [
        "QualityReward",
        "long5",
        "answer_seen",
        "length",
    ]
    short = build_reward({"length": 2.0, "my_rewards.py:QualityReward": 1.0}, base_dir=user_dir)
    assert short(["p"], ["x" * 200]).tolist() == [3.0]
    assert isinstance(build_reward(["math"]), Weighted)


def test_file_reward_works_in_a_reward_pool(user_dir):
    reward = build_reward(["my_rewards.py:QualityReward"], base_dir=user_dir)
    with RewardPool(reward, num_workers=1) as pool:
        assert pool.submit(["p", "q"], ["x" * 101, "y"], batch=0).result(timeout=120).tolist() == [1.0, 0.0]


def test_config_errors_name_the_entry(user_dir):
    cases = [
        (["maths"], r"rewards\[0\]\.reward: got 'maths', expected a built-in reward \["),
        (
            ["length", "broken_rewards.py:X"],
            r"rewards\[1\]\.reward: got 'broken_rewards\.py:X', but importing .* raised ModuleNotFoundError: "
            r"No module named 'definitely_not_installed_pkg'",
        ),
        (["my_rewards.py:Nope"], r"rewards\[0\]\.reward: got 'my_rewards\.py:Nope', but .* has no attribute 'Nope'"),
        ([{"reward": "length", "kwargs": {"nope": 1}}], r"rewards\[0\]: building 'length' with kwargs .* TypeError"),
        ([{"reward": "length", "wieght": 1}], r"rewards\[0\]: got keys \['reward', 'wieght'\], expected"),
        ([{"reward": "length", "weight": "high"}], r"rewards\[0\]\.weight: got 'high'"),
        ([{"reward": "length", "kwargs": [1]}], r"rewards\[0\]\.kwargs: got \[1\]"),
        ([], r"rewards: got \[\], expected a non-empty list"),
        ("math", r"rewards: got 'math', expected a non-empty list"),
    ]
    for spec, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as info:
            build_reward(spec, base_dir=user_dir)
        assert "\n" not in str(info.value)


def test_reward_metrics_and_close_collect_from_components():
    reward = build_reward([{"reward": "math", "kwargs": {"timeout": 1.0}}, "length"])
    try:
        reward(["q"] * 2, ["\\boxed{1}", "none"], answers=["1", "2"])
        metrics = reward_metrics(reward)
        assert metrics["math/checked"] == 2 and metrics["math/correct"] == 1 and metrics["math/no_answer"] == 1
        assert reward_metrics(reward)["math/checked"] == 0
    finally:
        close_reward(reward)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_reward_pool_brings_the_counters_back_per_batch(num_workers):
    """The verified-maths counters reach the pool's owner with the scores, from a worker process too."""
    reward = build_reward([{"reward": "math", "kwargs": {"timeout": 1.0}}, "length"])
    try:
        with RewardPool(reward, num_workers=num_workers, timeout=120) as pool:
            # the verified-maths counters, and each component's raw scores summed (the per-reward breakdown)
            breakdown = ["length/score_sum", "length/scored", "math/score_sum", "math/scored"]
            assert pool.pop_metrics(0) == dict.fromkeys(
                ["math/checked", "math/correct", "math/errors", "math/no_answer", "math/timeouts", *breakdown], 0.0
            )
            first = pool.submit(["q"] * 3, ["\\boxed{2}", PATHOLOGICAL, "none"], batch=0, answers=["2", "1", "3"])
            assert first.result().tolist() == [2.0, 1.0, 1.0]  # math + length (max_length default)
            second = pool.submit(["q"], ["\\boxed{5}"], batch=1, answers=["4"])
            assert second.result().tolist() == [1.0]
            got = pool.pop_metrics(0)
            assert got == {
                "math/checked": 3,
                "math/correct": 1,
                "math/errors": 0,
                "math/no_answer": 1,
                "math/timeouts": 1,
                "math/score_sum": 1,
                "math/scored": 3,
                "length/score_sum": 3,
                "length/scored": 3,
            }
            assert pool.pop_metrics(0)["math/checked"] == 0  # popped
            assert pool.pop_metrics(1) == {
                **dict.fromkeys(got, 0.0),
                "math/checked": 1.0,
                "math/scored": 1.0,
                "length/score_sum": 1.0,
                "length/scored": 1.0,
            }
    finally:
        close_reward(reward)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"))


def test_reward_model_scores_pairs_in_batches(reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts = ["What is 1 + 1?", "What is 12 + 7?", "Hi", "What is 3 + 3?"]
    responses = ["2", "The answer is \\boxed{19}.", "", "six, I think: 6"]
    batched = RewardModel(reward_model_dir, batch_size=3)(prompts, responses)
    single = RewardModel(reward_model_dir, batch_size=1)(prompts, responses)
    assert batched.shape == (4,) and batched.dtype == torch.float32
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
    # the reference: each pair through the chat template and transformers directly
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    for i, (p, r) in enumerate(zip(prompts, responses)):
        text = tok.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
        )
        with torch.no_grad():
            want = model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
        torch.testing.assert_close(batched[i], want, atol=1e-5, rtol=1e-5)
    # through the config, and pickled without weights
    configured = build_reward([{"reward": "reward_model", "kwargs": {"path": str(reward_model_dir), "batch_size": 2}}])
    torch.testing.assert_close(configured(prompts, responses), batched, atol=1e-5, rtol=1e-5)
    rm = RewardModel(reward_model_dir)
    rm(prompts[:1], responses[:1])
    assert len(pickle.dumps(rm)) < 2000


def test_reward_model_on_an_accelerator(reward_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cpu = RewardModel(reward_model_dir)(["a", "b"], ["1", "2"])
    gpu = RewardModel(reward_model_dir, device="cuda")(["a", "b"], ["1", "2"])
    torch.testing.assert_close(gpu, cpu, atol=1e-4, rtol=1e-4)


def test_reward_model_errors(tmp_path, reward_model_dir):
    with pytest.raises(
        ValueError, match=r"reward_model\.path: got '.*absent', expected a local reward-model directory"
    ):
        RewardModel(tmp_path / "absent")
    with pytest.raises(ValueError, match="batch_size: got 0"):
        RewardModel(reward_model_dir, batch_size=0)
    with pytest.raises(ValueError, match="label: got 3"):
        RewardModel(reward_model_dir, label=3)(["a"], ["b"])


def test_base_reward_without_forward_names_itself():
    class Empty(BaseReward):
        pass

    with pytest.raises(Exception, match=r"Empty\.forward\(prompts, responses, \*\*kwargs\) is not defined"):
        Empty()(["q"], ["r"])


def test_reprobe_reward_class_that_cannot_be_called_is_refused_when_built(tmp_path):
    # A class with neither __call__ nor forward was accepted and failed only at the first step.
    (tmp_path / "odd.py").write_text("class Scores:\n    def score(self, prompts, responses):\n        return [1.0]\n")
    with pytest.raises(ValueError, match=r"rewards\[0\].reward: .*odd.py:Scores' built a Scores with neither"):
        build_reward([f"{tmp_path / 'odd.py'}:Scores"])


@pytest.mark.parametrize("body", ["import sys\nsys.exit(3)\n", "raise SystemExit('bye')\n", "exit()\n"])
def test_reprobe30_reward_file_calling_exit_at_import_is_a_named_error(tmp_path, body):
    # sys.exit at import escaped as a bare SystemExit: the CLI exited with the file's status.
    (tmp_path / "exits.py").write_text(body)
    with pytest.raises(
        ValueError, match=r"rewards\[1\]\.reward: got 'exits\.py:Score', but importing .*exits\.py"
    ) as info:
        build_reward(["length", "exits.py:Score"], base_dir=tmp_path)
    assert "SystemExit" in str(info.value) and "\n" not in str(info.value)


def test_reprobe30_reward_class_calling_exit_when_built_is_a_named_error(tmp_path):
    (tmp_path / "exits.py").write_text("import sys\n\nclass Score:\n    def __init__(self):\n        sys.exit(4)\n")
    with pytest.raises(
        ValueError, match=r"rewards\[0\]: building 'exits\.py:Score' with kwargs \{\} raised SystemExit: 4"
    ):
        build_reward(["exits.py:Score"], base_dir=tmp_path)


def test_reprobe30_cli_reward_file_calling_exit_is_status_2_with_one_line(tmp_path, capsys):
    from pathlib import Path

    import yaml

    from rlcore.train.cli import main

    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "grpo_tiny.yaml").read_text())
    raw["rewards"] = ["exits.py:Score"]  # relative to the config's folder
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    code = main(["train", "--config", str(tmp_path / "run.yaml"), f"trainer.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "rewards[0].reward" in err[0] and "exits.py" in err[0] and "SystemExit" in err[0], err


ODD_FILE = """
async def coro(prompts, responses, **kwargs):
    return [1.0] * len(responses)


def one_argument(text):
    return [1.0]


def strict_keywords(prompts, responses, *, answers):
    return [1.0] * len(responses)


class ForwardTakesOne:
    def forward(self, responses):
        return [1.0] * len(responses)


class AsyncCall:
    async def __call__(self, prompts, responses, **kwargs):
        return [1.0] * len(responses)
"""


@pytest.mark.parametrize(
    "entry, pattern",
    [
        ("odd.py:coro", r"rewards\[0\]\.reward: 'odd\.py:coro' is an async function"),
        ("odd.py:AsyncCall", r"rewards\[0\]\.reward: 'odd\.py:AsyncCall' built a AsyncCall whose __call__ is async"),
        ("odd.py:one_argument", r"rewards\[0\]\.reward: 'odd\.py:one_argument' cannot be called as "),
        ("odd.py:ForwardTakesOne", r"rewards\[0\]\.reward: 'odd\.py:ForwardTakesOne' cannot be called as "),
        (
            {"reward": "odd.py:strict_keywords", "kwargs": {"bonus": 1}},
            r"rewards\[0\]\.kwargs: 'odd\.py:strict_keywords' does not take \{'bonus': 1\}",
        ),
    ],
)
def test_reprobe30_reward_with_an_odd_signature_is_refused_when_built(tmp_path, entry, pattern):
    # Each was accepted and failed only at step 0 (or, async, returned a coroutine).
    (tmp_path / "odd.py").write_text(ODD_FILE)
    with pytest.raises(ValueError, match=pattern) as info:
        build_reward([entry], base_dir=tmp_path)
    assert "\n" not in str(info.value)
    # the usual shapes still build: keyword-only columns, **kwargs, a forward method
    build_reward(["odd.py:strict_keywords", "length"], base_dir=tmp_path)


COUNTERS_FILE = """
class NeedsStep:
    def __call__(self, prompts, responses, **kwargs):
        return [1.0] * len(responses)

    def pop_metrics(self, step):
        return {}


class NotAMapping(NeedsStep):
    def pop_metrics(self):
        return None


class TextCounter(NeedsStep):
    def pop_metrics(self):
        return {"seen": "many"}
"""


@pytest.mark.parametrize(
    "name, problem",
    [
        ("NeedsStep", "raised TypeError"),
        ("NotAMapping", "returned NoneType"),
        ("TextCounter", "counter 'seen' is 'many'"),
    ],
)
def test_reprobe30_a_reward_with_an_odd_pop_metrics_is_named(tmp_path, name, problem):
    # A user class's own pop_metrics (another signature, another return) raised a raw
    # TypeError / AttributeError / ValueError when the trainer made its reward pool.
    (tmp_path / "counters.py").write_text(COUNTERS_FILE)
    reward = build_reward([f"counters.py:{name}"], base_dir=tmp_path)
    with pytest.raises(ValueError, match=rf"reward '{name}': pop_metrics\(\) {re.escape(problem)}.*expected"):
        RewardPool(reward, num_workers=0)


@pytest.mark.parametrize(
    "entry, pattern",
    [
        ({"reward": "length", "weight": 10**400}, r"rewards\[0\]\.weight: got 1000.*, expected a finite number"),
        ({"reward": "length", "name": ["a"]}, r"rewards\[0\]\.name: got \['a'\], expected a non-empty string"),
        ({"reward": "length", "name": True}, r"rewards\[0\]\.name: got True, expected a non-empty string"),
    ],
)
def test_reprobe30_config_entry_edges_are_named(entry, pattern):
    # A YAML integer past float's range raised a raw OverflowError (a traceback from the CLI);
    # a list as the name was logged as its text.
    with pytest.raises(ValueError, match=pattern):
        build_reward([entry])
