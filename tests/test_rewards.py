"""rlcore.rewards: protocol, rule rewards, weighted composition, the process pool, error messages."""

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reward_helpers
from rlcore.rewards import (
    AnswerMatch,
    FormatMatch,
    LengthReward,
    RewardError,
    RewardPool,
    Weighted,
    build_reward,
    evaluate,
    extract_answer,
)
from rlcore.testing.reference import length_reward_ref, weighted_ref

TESTS = str(Path(__file__).resolve().parent)


class BaseReward:
    """The seed document's base class, as its users write it."""

    def forward(self, prompts, responses, **kwargs):
        raise NotImplementedError


class LongReward(BaseReward):
    def forward(self, prompts, responses, **kwargs):
        return [len(r) > 100 for r in responses]


class Explodes:
    name = "explodes"

    def __call__(self, prompts, responses, **columns):
        raise ZeroDivisionError("boom")


def short_list(prompts, responses, **columns):
    return [1.0] * (len(responses) - 1)


def count_a(prompts, responses, **columns):
    return [float(r.count("a")) for r in responses]


def test_seed_base_reward_style_works_unchanged():
    responses = ["x" * 101, "short"]
    assert evaluate(LongReward(), ["p", "p"], responses).tolist() == [1.0, 0.0]
    with RewardPool(LongReward(), num_workers=0) as pool:
        assert pool(["p", "p"], responses).tolist() == [1.0, 0.0]


def test_reward_that_raises_names_reward_and_batch():
    with pytest.raises(
        RewardError, match=r"reward 'explodes' on batch 7 of 2 responses raised ZeroDivisionError: boom"
    ):
        evaluate(Explodes(), ["p", "q"], ["a", "b"], batch=7)


def test_wrong_length_names_reward_and_batch():
    with pytest.raises(
        RewardError, match=r"reward 'short_list' on batch 3: got scores of shape \(2,\), expected \(3,\)"
    ):
        evaluate(short_list, ["p"] * 3, ["a"] * 3, batch=3)


@pytest.mark.parametrize(
    "out, message",
    [
        ("abc", "got str"),
        ([1.0, "x"], "got str at index 1"),
        ([1.0, float("nan")], "non-finite score"),
        (None, "got NoneType"),
    ],
)
def test_bad_outputs_are_errors(out, message):
    with pytest.raises(RewardError, match=message):
        evaluate(lambda p, r: out, ["p", "q"], ["a", "b"])


def test_mismatched_prompts_and_responses():
    with pytest.raises(ValueError, match="responses: got 1, expected 2"):
        evaluate(count_a, ["p", "q"], ["a"])


def test_process_pool_scores_and_propagates_errors():
    with RewardPool(Weighted([(1.0, count_a), (2.0, LongReward())]), num_workers=1) as pool:
        first = pool.submit(["p"] * 3, ["aa", "a" * 101, "b"], batch=0)
        bad = pool.submit(["p"], ["a", "b"], batch=1)
        assert first.result().tolist() == [2.0, 103.0, 0.0]
        assert first.result().dtype == torch.float32
        with pytest.raises(ValueError, match="responses: got 2, expected 1"):
            bad.result()
    with (
        RewardPool(Explodes(), num_workers=1) as pool,
        pytest.raises(RewardError, match="reward 'explodes' on batch 5"),
    ):
        pool(["p"], ["a"], batch=5)


def test_pool_rejects_unpicklable_reward_by_name():
    with pytest.raises(ValueError, match="reward: '<lambda>' cannot be pickled"):
        RewardPool(lambda p, r: [0.0] * len(r), num_workers=1)
    with pytest.raises(ValueError, match="num_workers: got -1"):
        RewardPool(count_a, num_workers=-1)


def test_stuck_reward_times_out_naming_the_reward_and_the_batch():
    # Issue 18, defect 3: waiting for scores had no timeout.
    with RewardPool(reward_helpers.Sleeps(600), num_workers=1, timeout=1) as pool:
        stuck = pool.submit(["p", "q"], ["slow", "x"], batch=3)
        # result(timeout=...) only guards the test against a hang; the pool raises first.
        with pytest.raises(RewardError, match=r"reward 'sleeps' on batch 3 did not finish within 1 s"):
            stuck.result(timeout=120)
        # The stuck worker was replaced: the pool keeps scoring.
        assert pool(["p"], ["fine"], batch=4).tolist() == [1.0]
    with RewardPool(reward_helpers.Sleeps(600), num_workers=0, timeout=0.2) as pool:
        with pytest.raises(RewardError, match=r"reward 'sleeps' on batch 5 did not finish within 0.2 s"):
            pool.submit(["p"], ["slow"], batch=5).result(timeout=120)
        with pytest.raises(RewardError, match=r"reward 'sleeps' on batch #1 \(unnamed\) did not finish"):
            pool(["p"], ["slow"])
        assert pool(["p"], ["fine"]).tolist() == [1.0]


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), True, "10"])
def test_pool_rejects_a_bad_timeout(timeout):
    with pytest.raises(ValueError, match=r"timeout: got .*expected a finite number of seconds > 0, or None"):
        RewardPool(count_a, num_workers=0, timeout=timeout)


def test_dead_reward_worker_is_the_named_reward_error():
    # Issue 18, defect 8: a dead worker surfaced as a BrokenProcessPool traceback.
    with (
        RewardPool(reward_helpers.DiesInWorker(), num_workers=1) as pool,
        pytest.raises(RewardError, match=r"reward 'dies' on batch 2: the reward's worker process died \(exit code 9\)"),
    ):
        pool.submit(["p"], ["a"], batch=2).result(timeout=120)


def test_close_never_waits_for_a_running_call_and_fails_what_is_left(tmp_path):
    marker = tmp_path / "pid"
    pool = RewardPool(reward_helpers.StuckInC(str(marker)), num_workers=1)
    running = pool.submit(["p"], ["a"], batch=0)
    queued = pool.submit(["p"], ["a"], batch=1)
    assert reward_helpers.wait_for(marker.is_file, 120)
    pool.close()  # returns although the reward is stuck in C code
    for future in (running, queued):
        with pytest.raises((RewardError, CancelledError)):
            future.result(timeout=120)
    assert reward_helpers.wait_for(lambda: not reward_helpers.alive(int(marker.read_text())), 120)
    with pytest.raises(RuntimeError, match="submit after close"):
        pool.submit(["p"], ["a"])


def test_reprobe_close_after_the_pool_broke_is_clean(monkeypatch):
    # A pool whose worker could not even be started (e.g. spawn from an unguarded main
    # module) failed its futures, but close() then raised OSError("handle is closed").
    import rlcore.rewards.pool as pool_module

    def cannot_start(self):
        raise RuntimeError("no process can be started here")

    monkeypatch.setattr(pool_module._Dispatcher, "_start", cannot_start)
    with RewardPool(reward_helpers.Sleeps(0.0), num_workers=1) as pool:
        with pytest.raises(RewardError, match=r"reward 'sleeps': the reward pool stopped \(RuntimeError: no process"):
            pool.submit(["p"], ["a"], batch=0).result(timeout=120)
        with pytest.raises(RewardError, match="the reward pool stopped"):
            pool.submit(["p"], ["a"], batch=1).result(timeout=120)
    pool.close()  # twice: still clean


_OWNER = """
import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stacks, should a test find it stuck
# Ctrl-C as in a terminal, even when the suite itself was started with SIGINT ignored (a background job).
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
import reward_helpers
from rlcore.rewards import RewardPool
with RewardPool(reward_helpers.StuckInC({marker!r}), num_workers=1) as pool:
    pool.submit(["p"], ["a"], batch=0).result()
"""


def _start_owner(tmp_path):
    marker = tmp_path / "pid"
    script = _OWNER.format(tests=TESTS, marker=str(marker))
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    if not reward_helpers.wait_for(marker.is_file, 120):
        proc.kill()
        raise AssertionError(f"the reward never started: {proc.communicate()[1]}")
    return proc, int(marker.read_text())


def test_stuck_reward_ctrl_c_stops_the_owner_within_seconds(tmp_path):
    # Issue 18, defect 3: shutdown waited for the running call, so Ctrl-C hung.
    proc, worker = _start_owner(tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            report = reward_helpers.process_report(proc.pid)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            proc.kill()
            raise AssertionError(f"the owner did not stop:\n{report}\n{proc.communicate()[1]}") from None
        assert "KeyboardInterrupt" in err
        assert reward_helpers.wait_for(lambda: not reward_helpers.alive(worker), 120)
    finally:
        proc.kill()
        proc.communicate()


def test_stuck_reward_kill_9_of_the_owner_leaves_no_orphan_worker_or_tracker(tmp_path):
    # Issue 18, defect 3: workers blocked for ever once their parent was killed.
    proc, worker = _start_owner(tmp_path)
    below = reward_helpers.descendants(proc.pid)
    try:
        assert worker in below  # with the resource tracker, when multiprocessing starts one
        proc.kill()
        proc.communicate()
        assert reward_helpers.wait_for(lambda: not any(reward_helpers.alive(p) for p in below), 120), [
            p for p in below if reward_helpers.alive(p)
        ]
    finally:
        for pid in below:
            if reward_helpers.alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{42} not \\boxed{41}. \\boxed{3/4}", "3/4"),
        ("reasoning 12 then\n#### 1,024", "1,024"),
        ("x = 3, y = -2.5e3", "-2.5e3"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer_conventions(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_with_pattern_takes_last_match():
    assert extract_answer("<a>1</a> <a>2</a>", pattern=r"<a>(.*?)</a>") == "2"
    assert extract_answer("dcba", pattern=r"\S+") == "dcba"
    assert extract_answer("nothing", pattern=r"<a>(.*?)</a>") is None


@given(st.integers(-(10**9), 10**9), st.sampled_from(["{:,}", "{}", "{}.0", "{:.2f}"]), st.text("abc xyz", max_size=8))
def test_numeric_match_ignores_formatting(value, fmt, prefix):
    response = prefix + " " + fmt.format(value)
    assert AnswerMatch(numeric=True)(["q"], [response], answers=[value]).tolist() == [1.0]
    assert AnswerMatch(numeric=True)(["q"], [response], answers=[value + 1]).tolist() == [0.0]


def test_exact_match_is_string_equality_after_strip():
    got = AnswerMatch()(["q"] * 3, ["#### 10", "#### 10.0", "#### ten"], answers=["10 ", "10", "10"])
    assert got.tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="answers: got 1 values, expected 3"):
        AnswerMatch()(["q"] * 3, ["a"] * 3, answers=["1"])
    with pytest.raises(ValueError, match="answers: got None"):
        AnswerMatch()(["q"], ["a"])


def test_format_match_fullmatch_and_search():
    think = FormatMatch(r"<think>.*?</think>\s*<answer>.*?</answer>")
    ok = "<think>a\nb</think> <answer>1</answer>"
    assert think(["q"] * 2, [ok, ok + " trailing"]).tolist() == [1.0, 0.0]
    assert FormatMatch(r"answer", search=True)(["q"], [ok]).tolist() == [1.0]


@given(
    st.lists(st.text(max_size=12), min_size=1, max_size=6),
    st.integers(0, 5),
    st.integers(0, 6),
    st.integers(0, 4),
)
def test_length_reward_matches_reference(responses, lo, extra, slack):
    reward = LengthReward(min_length=lo, max_length=lo + extra, slack=slack)
    got = reward(["q"] * len(responses), responses)
    expected = torch.tensor(length_reward_ref(responses, min_length=lo, max_length=lo + extra, slack=slack))
    torch.testing.assert_close(got, expected)
    assert bool(((got >= 0) & (got <= 1)).all())


def test_length_reward_hand_values_and_bad_bounds():
    assert LengthReward(min_length=3, slack=3)(["q"] * 3, ["a", "abc", "abcdefgh"]).tolist() == pytest.approx(
        [1 / 3, 1, 1]
    )
    with pytest.raises(ValueError, match="min_length, max_length, slack"):
        LengthReward(min_length=4, max_length=2)


@settings(max_examples=25)
@given(
    st.lists(st.text("ab ", max_size=6), min_size=1, max_size=5),
    st.lists(st.floats(-3, 3, allow_nan=False), min_size=2, max_size=2),
)
def test_weighted_matches_reference_and_is_linear(responses, weights):
    prompts = ["q"] * len(responses)
    parts = [count_a, LongReward()]
    reward = Weighted(list(zip(weights, parts)))
    scores = [evaluate(p, prompts, responses).tolist() for p in parts]
    torch.testing.assert_close(reward(prompts, responses), torch.tensor(weighted_ref(scores, weights)))
    doubled = Weighted([(2 * w, p) for w, p in zip(weights, parts)])
    torch.testing.assert_close(doubled(prompts, responses), 2 * reward(prompts, responses))
    assert set(reward.components(prompts, responses)) == {"count_a", "LongReward"}


def test_weighted_names_failing_component_and_rejects_bad_pairs():
    with pytest.raises(RewardError, match="reward 'explodes' on batch 2"):
        Weighted([(1.0, count_a), (1.0, Explodes())])(["q"], ["a"], batch=2)
    with pytest.raises(ValueError, match=r"rewards\[0\]: got"):
        Weighted([count_a])
    with pytest.raises(ValueError, match="rewards: got an empty sequence"):
        Weighted([])


@pytest.mark.parametrize("big", [10**400, -(10**400)])
def test_reprobe_score_beyond_float_range_is_a_named_reward_error(big):
    # An int past float's range gave a raw "OverflowError: int too large to convert to float".
    def huge(prompts, responses, **columns):
        return [1.0, big]

    with pytest.raises(RewardError, match=r"reward 'huge' on batch 4: got a non-finite score .*inf at index 1"):
        evaluate(huge, ["p", "q"], ["a", "b"], batch=4)


def test_reprobe_reward_calling_exit_is_a_named_reward_error():
    # sys.exit(3) inside a reward left the CLI with status 3, the status of a non-finite loss.
    def exits(prompts, responses, **_):
        raise SystemExit(3)

    with pytest.raises(RewardError, match=r"reward 'exits' on batch 7 of 1 responses raised SystemExit: 3"):
        evaluate(exits, ["q"], ["a"], batch=7)


def test_reprobe_a_base_exception_in_the_reward_thread_reaches_the_waiter_at_once():
    # A BaseException other than Exception ended the reward's thread without settling its
    # future: the trainer waited for the whole reward timeout (300 s by default).
    def interrupted(prompts, responses, **_):
        raise KeyboardInterrupt

    pool = RewardPool(interrupted, num_workers=0, timeout=600)
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.submit(["q"], ["a"], batch=0).result(timeout=120)
    finally:
        pool.close()


def test_reprobe30_numpy_scores_are_numbers():
    # numpy.bool_ was refused with "got bool ..., expected numbers or booleans".
    np = pytest.importorskip("numpy")

    def numpy_scores(prompts, responses, **_):
        return [np.bool_(True), np.bool_(False), np.float32(0.5), np.int64(2), np.array(1.5), np.array(True)]

    assert evaluate(numpy_scores, ["p"] * 6, ["r"] * 6).tolist() == [1.0, 0.0, 0.5, 2.0, 1.5, 1.0]
    for array in (np.array([True, False]), np.array([0.25, 2.0], dtype=np.float16), np.array([3, -1])):
        got = evaluate(lambda p, r, a=array: a, ["p"] * 2, ["r"] * 2)
        assert got.tolist() == [float(v) for v in array.tolist()] and got.dtype == torch.float32
    assert evaluate(lambda p, r: [torch.tensor(0.5), torch.tensor(True)], ["p"] * 2, ["r"] * 2).tolist() == [0.5, 1.0]


@pytest.mark.parametrize(
    "out",
    [
        torch.tensor([1.0 + 2.0j, 1.0]),
        torch.tensor([1.0 + 0.0j, 0.0]),
        [1.0, 2.0 + 1.0j],
        [1.0, torch.tensor(1.0 + 1.0j)],
    ],
    ids=["complex-tensor", "complex-tensor-real-valued", "complex-list", "complex-0d-tensor"],
)
def test_reprobe30_complex_scores_are_refused_naming_the_reward(out):
    # A complex tensor was accepted and its imaginary part dropped silently.
    def complex_reward(prompts, responses, **_):
        return out

    with pytest.raises(RewardError, match=r"reward 'complex_reward' on batch 2: got complex"):
        evaluate(complex_reward, ["p", "q"], ["a", "b"], batch=2)


def test_reprobe30_complex_numpy_scores_are_refused():
    np = pytest.importorskip("numpy")
    for out in (np.array([1 + 1j, 2]), [np.complex128(1), 1.0]):
        with pytest.raises(RewardError, match=r"reward '<lambda>': got complex"):
            evaluate(lambda p, r, o=out: o, ["p", "q"], ["a", "b"])


def test_reprobe30_odd_score_elements_are_named_by_their_full_type():
    for out, name in (([1.0, torch.ones(2)], "torch.Tensor of shape (2,)"), ([1.0, [1.0]], "list")):
        with pytest.raises(RewardError, match=rf"got {re.escape(name)} at index 1, expected numbers or booleans"):
            evaluate(lambda p, r, o=out: o, ["p", "q"], ["a", "b"])


@pytest.mark.parametrize("answers", [[torch.tensor(3.0), torch.tensor([7])], torch.tensor([3.0, 7.0])])
def test_reprobe30_tensor_answers_are_their_numbers(answers):
    # A tensor answer was read as the text "tensor(3.)".
    responses = ["it is 3", "#### 7.0"]
    assert AnswerMatch(numeric=True)(["q"] * 2, responses, answers=answers).tolist() == [1.0, 1.0]
    assert AnswerMatch()(["q"] * 2, ["it is 3", "#### 7"], answers=[torch.tensor(3), torch.tensor([7])]).tolist() == [
        1.0,
        1.0,
    ]


def test_reprobe30_a_tensor_answer_of_several_values_is_refused():
    with pytest.raises(ValueError, match=r"answers\[1\]: got a tensor of shape \(2,\), expected a string, a number"):
        AnswerMatch(numeric=True)(["q"] * 2, ["1", "2"], answers=[torch.tensor(1), torch.tensor([1, 2])])


@pytest.mark.parametrize("weight", [float("inf"), float("nan"), True])
def test_reprobe30_weighted_refuses_a_weight_that_is_not_a_finite_number(weight):
    # An infinite weight gave inf scores, silently, from Weighted's own call.
    with pytest.raises(ValueError, match=r"rewards\[0\]: got weight .*, expected a finite number"):
        Weighted([(weight, count_a)])


class _Unreadable(float):
    def __float__(self):
        raise RuntimeError("cannot read me")


def test_reprobe30_a_score_that_cannot_be_read_is_a_named_reward_error():
    # An element whose float() raised escaped as a raw RuntimeError, naming no reward.
    def unreadable(prompts, responses, **_):
        return [_Unreadable(1.0)] * len(responses)

    with pytest.raises(RewardError, match=r"reward 'unreadable' on batch 1: got a score .* that cannot be read"):
        evaluate(unreadable, ["p"], ["a"], batch=1)


def test_reprobe30_a_reward_whose_name_raises_is_still_named():
    # A name property that raised escaped as a raw RuntimeError from the error message's own making.
    class NoName:
        @property
        def name(self):
            raise RuntimeError("no name")

        def __call__(self, prompts, responses, **_):
            return []

    with pytest.raises(RewardError, match=r"reward 'NoName': got scores of shape \(0,\), expected \(1,\)"):
        evaluate(NoName(), ["p"], ["a"])


def test_reprobe30_an_async_reward_is_refused_clearly():
    async def coro_reward(prompts, responses, **_):
        return [1.0] * len(responses)

    with pytest.raises(RewardError, match=r"reward 'coro_reward'.*returned a coroutine.*async"):
        evaluate(coro_reward, ["p"], ["a"])


def test_reprobe30_list_answers_are_refused_by_answer_match():
    with pytest.raises(ValueError, match=r"answers\[0\]: got a list, expected a string, a number"):
        AnswerMatch()(["q"], ["#### 1"], answers=[["1", "2"]])


@pytest.mark.parametrize(
    "build, key",
    [
        (lambda: LengthReward(max_length=1, slack=float("nan")), "slack"),  # scored 0 for every miss, silently
        (lambda: LengthReward(max_length="3"), "max_length"),  # a raw TypeError
        (lambda: LengthReward(min_length=True), "min_length"),
        (lambda: LengthReward(max_length=2.5), "max_length"),
        (lambda: AnswerMatch(numeric=True, rel_tol=-1), "rel_tol"),  # a ValueError only at the first call
        (lambda: AnswerMatch(numeric=True, abs_tol=float("nan")), "abs_tol"),  # nothing ever matched
        (lambda: AnswerMatch(pattern=5), "pattern"),  # a raw TypeError
        (lambda: FormatMatch(None), "pattern"),
    ],
)
def test_reprobe30_rule_reward_arguments_at_their_edges_are_refused_naming_them(build, key):
    with pytest.raises(ValueError, match=rf"^{key}: got "):
        build()


def test_reprobe30_a_weight_beyond_float32_is_refused():
    """Before: 1e39 is a finite float, but inf in the float32 scores: 0 scores became nan, named only at step 0."""
    with pytest.raises(ValueError, match=r"rewards\[0\]: got weight 1e\+39, expected a finite number \(in float32"):
        Weighted([(1e39, count_a)])
    with pytest.raises(ValueError, match=r"rewards\[0\]\.weight: got 1e\+39, expected a finite number"):
        build_reward([{"reward": "length", "weight": 1e39}])


def test_reprobe30_a_weighted_sum_past_float32_is_a_named_reward_error():
    """Each weight fits float32, their sum does not: before, the total was inf, silently."""
    reward = Weighted([(3e38, count_a), (3e38, count_a)])
    with pytest.raises(RewardError, match=r"reward 'weighted' on batch 7: the weighted sum .* is inf at index 0"):
        reward(["q", "q"], ["a", "b"], batch=7)


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: bytearray(b"\x01\x02"), r"got bytearray, expected a tensor \[2\]"),
        (lambda: memoryview(b"\x01\x02"), r"got memoryview of shape \(2,\), expected a tensor \[2\]"),
        (lambda: np.ma.masked_array([1.0, 2.0], [True, False]), r"got a masked array with masked scores"),
    ],
)
def test_reprobe30_bytes_and_masked_scores_are_refused(make, pattern):
    """Before: the bytes were read as scores 1 and 2, and a masked score as the data under its mask."""
    with pytest.raises(RewardError, match=pattern):
        evaluate(lambda prompts, responses, **_: make(), ["q", "q"], ["a", "b"])


def test_reprobe30_sparse_and_unmasked_scores_are_read():
    """Before: a sparse tensor of scores raised a raw NotImplementedError from the finiteness check."""
    sparse = torch.tensor([0.0, 2.0]).to_sparse()
    assert evaluate(lambda p, r, **_: sparse, ["q", "q"], ["a", "b"]).tolist() == [0.0, 2.0]
    unmasked = np.ma.masked_array([1.0, 2.0], [False, False])
    assert evaluate(lambda p, r, **_: unmasked, ["q", "q"], ["a", "b"]).tolist() == [1.0, 2.0]


def test_reprobe30_a_reward_raising_generator_exit_is_a_named_reward_error():
    def closes(prompts, responses, **_):
        raise GeneratorExit("closed")

    with pytest.raises(RewardError, match=r"reward 'closes' of 2 responses raised GeneratorExit: closed"):
        evaluate(closes, ["q", "q"], ["a", "b"])
