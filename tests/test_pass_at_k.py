"""pass_at_k: the unbiased pass@k estimator against exact binomials, its identities and bounds, no host sync."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.algos import pass_at_k
from rlcore.testing import assert_no_host_sync
from rlcore.testing.reference import pass_at_k_ref
from rlcore.testing.strategies import grouped_scores


@settings(max_examples=40)
@given(batch=grouped_scores(), k=st.integers(1, 9), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_matches_exact_binomials(batch, k, dtype):
    scores, ids = batch
    scores = scores.to(dtype)
    g = int(ids.max()) + 1
    got = pass_at_k(scores, ids, k=k, num_groups=g + 1)  # one empty group at the end
    torch.testing.assert_close(got, pass_at_k_ref(scores, ids, k=k, num_groups=g + 1), atol=1e-6, rtol=0)
    assert got[-1] == 0.0
    assert ((got >= 0) & (got <= 1)).all()
    # pass@1 is the fraction correct; pass@k grows with k
    correct = (scores > 0).float()
    frac = torch.zeros(g).index_add_(0, ids, correct) / torch.zeros(g).index_add_(0, ids, torch.ones_like(correct))
    torch.testing.assert_close(pass_at_k(scores, ids, k=1, num_groups=g), frac, atol=1e-6, rtol=0)
    assert (pass_at_k(scores, ids, k=k + 1, num_groups=g) >= pass_at_k(scores, ids, k=k, num_groups=g) - 1e-6).all()


def test_hand_values_threshold_and_no_host_sync():
    # n = 4, c = 1: pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    ids = torch.zeros(4, dtype=torch.long)
    assert pass_at_k(scores, ids, k=2, num_groups=1).tolist() == [0.5]
    assert pass_at_k(torch.tensor([0.4, 0.6]), torch.tensor([0, 0]), k=1, threshold=0.5, num_groups=1).tolist() == [0.5]
    assert_no_host_sync(lambda s, i: pass_at_k(s, i, k=3), scores, ids)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="k: got 0"):
        pass_at_k(torch.ones(2), torch.zeros(2, dtype=torch.long), k=0)
    with pytest.raises(ValueError, match="group_ids"):
        pass_at_k(torch.ones(2), torch.zeros(3, dtype=torch.long), k=1)


@pytest.mark.parametrize("threshold", [float("nan"), "0.5", None])
def test_reprobe_bad_threshold_is_rejected(threshold):
    # A NaN threshold counted nothing as correct: pass@k 0 for every prompt, silently.
    with pytest.raises(ValueError, match="threshold: got"):
        pass_at_k(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), k=1, threshold=threshold)
