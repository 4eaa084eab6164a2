"""Verified maths against math-verify's own verdicts: its extraction on unmarked answers, linear extraction, bounds."""

from __future__ import annotations

import re
import time
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reward_helpers import math_verify_verdict
from rlcore.rewards import VerifiedMath, extract_final_answer

# Realistic answers with no \boxed{} and no ####: math-verify's own extraction decides, so
# rlcore's verdict must be math-verify's verify(parse(gold), parse(response)).
UNMARKED = [
    ("0.75", r"The answer is $\frac{6}{8}$"),
    ("0.75", r"The answer is $\frac{6}{8}$."),
    ("3/4", r"So the probability is $\dfrac{3}{4}$."),
    ("0.5", r"Therefore $x = \frac{1}{2}$."),
    ("0.5", r"We get \(\frac{1}{2}\) in the end."),
    ("3", r"Solving gives \[ x = 3 \]"),
    ("5", "The final answer is 5."),
    ("7", "first 3 then 5 and finally 7"),
    ("7", "first 3 then 7 and finally 5"),
    ("1234567", "the total is 1,234,567 dollars"),
    ("-12", "it drops to -12"),
    (r"\sqrt{2}", r"The side has length $\sqrt{2}$ units."),
    (r"\frac{\pi}{4}", r"The angle is $\frac{\pi}{4}$ radians."),
    ("x^2-1", r"Expanding, the product is $(x-1)(x+1)$."),
    ("2", "no answer here, sorry"),
    ("12", r"It costs $12 per ticket, so $3 \times 4 = 12$."),
    ("0.25", "The ratio is 1/4."),
    ("10", r"The final answer is $10$. I hope it is correct."),
]


@pytest.fixture(scope="module")
def math_reward():
    reward = VerifiedMath(timeout=60.0)
    yield reward
    reward.close()


def test_reprobe30_latex_fraction_without_a_box_is_read_by_math_verify(math_reward):
    # The fallback took the last number (8) and scored 0.
    assert math_verify_verdict("0.75", r"The answer is $\frac{6}{8}$") is True
    assert math_reward(["q"], [r"The answer is $\frac{6}{8}$"], answers=["0.75"]).tolist() == [1.0]
    assert math_reward(["q"], [r"The answer is $\frac{6}{8}$"], answers=[0.75]).tolist() == [1.0]


def test_reprobe30_unmarked_answers_agree_with_math_verify(math_reward):
    math_reward.pop_metrics()
    scores = math_reward(["q"] * len(UNMARKED), [r for _, r in UNMARKED], answers=[g for g, _ in UNMARKED])
    verdicts = [math_verify_verdict(g, r) for g, r in UNMARKED]
    assert any(verdicts) and not all(verdicts)  # the list holds both kinds
    for (gold, response), verdict, score in zip(UNMARKED, verdicts, scores.tolist()):
        assert bool(score) == verdict, (gold, response)
    metrics = math_reward.pop_metrics()
    assert metrics["checked"] == len(UNMARKED) and metrics["timeouts"] == 0 and metrics["errors"] == 0


def _formats(value: Fraction) -> list[str]:
    p, q = value.numerator, value.denominator
    sign = "-" if p < 0 else ""
    out = [rf"{sign}\frac{{{abs(p)}}}{{{q}}}", f"{p}/{q}" if q != 1 else str(p)]
    if q in (1, 2, 4, 5, 8, 10, 20, 25):  # a terminating decimal
        out.append(f"{float(value):g}" if q != 1 else f"{p}.0")
    return out


_TEMPLATES = [
    "{}",
    "The answer is ${}$",
    "So we find that the value is ${}$.",
    r"Therefore \({}\) is the result",
    r"so the answer is \boxed{{{}}}.",
    "She has that many.\n#### {}",
]


@st.composite
def _pairs(draw):
    p = draw(st.integers(-40, 40))
    q = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 8, 10]))
    gold_value = Fraction(p, q)
    other = draw(st.booleans())
    shown_value = gold_value + Fraction(1, 2) if other else gold_value
    gold = draw(st.sampled_from(_formats(gold_value)))
    shown = draw(st.sampled_from(_formats(shown_value)))
    if "\\frac" in shown:
        template = draw(st.sampled_from(_TEMPLATES[1:5]))  # LaTeX in math mode or a box
    else:
        template = draw(st.sampled_from(_TEMPLATES))
    return gold, template.format(shown), shown_value == gold_value


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_pairs())
def test_reprobe30_numbers_and_fractions_agree_with_math_verify(math_reward, case):
    gold, response, equal = case
    score = math_reward(["q"], [response], answers=[gold]).item()
    assert bool(score) == math_verify_verdict(gold, response), (gold, response)
    assert bool(score) == equal, (gold, response)  # and both are right


def test_reprobe30_extraction_is_linear_in_the_response():
    # 6,000 unclosed \boxed{ took 16 s (each opening scanned the rest of the text).
    for text in ("\\boxed{" * 6000, "\\boxed{" * 60000 + "\\boxed{7}", "{" * 200000 + "\\boxed{1}"):
        start = time.perf_counter()
        found = extract_final_answer(text)
        assert time.perf_counter() - start < 1.0
        assert found == (None if text.endswith("{") else ("boxed", "7" if "7" in text else "1"))


def test_reprobe30_extraction_runs_inside_the_per_item_timeout():
    # A response math-verify cannot finish in time scores 0 within the timeout, however it is built.
    reward = VerifiedMath(timeout=3.0)
    try:
        reward(["q"], ["\\boxed{1}"], answers=["1"])  # the worker is up
        reward.pop_metrics()
        hostile = ["\\boxed{" * 6000, "$" + "(" * 20000 + "$", "1+" * 200000 + "1"]
        start = time.monotonic()
        # Wrong whether math-verify finishes in time or not (the sum is 200001, its last number 1): 0 either way.
        scores = reward(["q"] * len(hostile), hostile, answers=["1", "1", "2"])
        elapsed = time.monotonic() - start
        assert scores.tolist() == [0.0] * len(hostile)
        assert elapsed < len(hostile) * (reward.timeout + 1.0), elapsed
        assert reward(["q"], ["#### 2"], answers=["2"]).tolist() == [1.0]  # and the next item is checked
    finally:
        reward.close()


def test_reprobe30_tensor_answers_are_their_numbers(math_reward):
    # A tensor answer was compared as the text "tensor(3.)".
    responses = [r"The answer is $3$", r"\boxed{\frac{14}{2}}", "#### 0.5"]
    answers = [torch.tensor(3.0), torch.tensor([7]), torch.tensor(0.5, dtype=torch.float64)]
    assert math_reward(["q"] * 3, responses, answers=answers).tolist() == [1.0, 1.0, 1.0]
    assert math_reward(["q"] * 2, responses[:2], answers=torch.tensor([3.0, 7.0])).tolist() == [1.0, 1.0]
    math_reward.pop_metrics()
    with pytest.raises(ValueError, match=r"answers\[0\]: got a tensor of shape \(1, 2\), expected a string"):
        math_reward(["q"], ["1"], answers=[torch.ones(1, 2)])
    assert math_reward.pop_metrics()["checked"] == 0  # refused before anything was counted


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"timeout": float("inf")}, "timeout"),  # raised OverflowError at the first call
        ({"timeout": float("nan")}, "timeout"),
        ({"startup_timeout": 0}, "startup_timeout"),  # failed only at the first call, mid-run
        ({"startup_timeout": float("inf")}, "startup_timeout"),
        ({"float_rounding": "x"}, "float_rounding"),  # accepted, used only past exact equality
        ({"float_rounding": -1}, "float_rounding"),
        ({"float_rounding": True}, "float_rounding"),
        ({"numeric_precision": 0}, "numeric_precision"),
        ({"numeric_precision": "15"}, "numeric_precision"),
        ({"strict": "no"}, "strict"),  # a truthy string: strict comparison, silently
    ],
)
def test_reprobe30_bad_verified_math_options_are_refused_when_built(kwargs, key):
    with pytest.raises(ValueError, match=rf"^{key}: got {re.escape(repr(kwargs[key]))}, expected"):
        VerifiedMath(**kwargs)


def test_reprobe30_list_answers_are_refused_naming_the_index(math_reward):
    # A list of acceptable answers was compared as its text "['1', '2']" and scored 0, silently.
    with pytest.raises(ValueError, match=r"answers\[1\]: got a list, expected a string, a number"):
        math_reward(["q"] * 2, ["1", "2"], answers=["1", ["1", "2"]])
