"""A reward worker that dies or hangs is replaced and its rows scored again, up to max_restarts; then the named error."""

import multiprocessing

import pytest

import reward_helpers
from rlcore.rewards import RewardError, RewardPool


def test_a_dead_reward_worker_is_replaced_and_its_rows_scored_again(tmp_path):
    with (
        RewardPool(reward_helpers.FailsFirst(str(tmp_path), 2), num_workers=1, max_restarts=2) as pool,
        pytest.warns(
            RuntimeWarning, match=r"reward 'fails_first': its worker process died \(exit code 9\); restarting"
        ),
    ):
        assert pool.submit(["p", "q"], ["ab", "abc"], batch=0).result(timeout=120).tolist() == [2.0, 3.0]
        assert pool.restarts == 2 and pool.restart_causes == ["its worker process died (exit code 9)"] * 2
        assert pool(["p"], ["x"], batch=1).tolist() == [1.0]  # the replacement keeps scoring
    assert multiprocessing.active_children() == []


def test_a_reward_worker_past_the_timeout_is_replaced_and_its_rows_scored_again(tmp_path):
    with (
        RewardPool(
            reward_helpers.FailsFirst(str(tmp_path), 1, hang=True), num_workers=1, timeout=2, max_restarts=1
        ) as pool,
        pytest.warns(
            RuntimeWarning, match=r"its worker ran past the reward timeout \(2 s\) and was stopped; restarting"
        ),
    ):
        assert pool.submit(["p"], ["abcd"], batch=0).result(timeout=120).tolist() == [4.0]
        assert pool.restarts == 1
    assert multiprocessing.active_children() == []


def test_past_max_restarts_the_batch_fails_with_the_named_error(tmp_path):
    with (
        RewardPool(reward_helpers.FailsFirst(str(tmp_path), 2), num_workers=1, max_restarts=1) as pool,
        pytest.warns(RuntimeWarning, match=r"restarting it \(1 of at most 1\); its rows are scored again"),
    ):
        with pytest.raises(
            RewardError,
            match=r"reward 'fails_first' on batch 5: the reward's worker process died \(exit code 9\) "
            r"while scoring it \(after 1 restart, the most allowed\)",
        ):
            pool.submit(["p"], ["a"], batch=5).result(timeout=120)
        assert pool.restarts == 1
        assert pool(["p"], ["ab"], batch=6).tolist() == [2.0]  # the pool goes on
    with pytest.raises(ValueError, match=r"max_restarts: got -1, expected an int >= 0"):
        RewardPool(reward_helpers.count_chars, num_workers=1, max_restarts=-1)
