"""Filter-and-refill (DAPO's dynamic sampling with redraws): the pick, and the sampling stage over the dock."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.algos import informative_groups, refill_groups
from rlcore.testing import assert_no_host_sync, grouped_scores
from rlcore.testing import reference as ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(scores_ids=grouped_scores(patterns=("binary", "constant", "normal")), wanted=st.integers(0, 10))
def test_refill_groups_matches_reference(dtype, scores_ids, wanted):
    scores, ids = scores_ids
    scores = scores.to(dtype)
    pick = refill_groups(scores, ids, wanted=wanted)
    picked, shortfall = ref.refill_groups_ref(scores, ids, wanted=wanted)
    assert pick.groups.shape == pick.valid.shape == (wanted,)
    assert pick.groups[pick.valid].tolist() == picked
    assert int(pick.shortfall) == shortfall
    assert bool((pick.groups[~pick.valid] == -1).all())


@given(
    scores_ids=grouped_scores(patterns=("binary", "constant", "normal")),
    wanted=st.integers(0, 10),
    spoil=st.booleans(),
)
def test_refill_never_picks_a_zero_variance_group_and_counts_the_shortfall(scores_ids, wanted, spoil):
    scores, ids = scores_ids
    if spoil:  # a failed reward (NaN) spoils its group
        scores = scores.clone()
        scores[0] = float("nan")
    pick = refill_groups(scores, ids, wanted=wanted)
    for g in pick.groups[pick.valid].tolist():
        s = scores[ids == g]
        assert bool(torch.isfinite(s).all()) and float(s.max()) != float(s.min())
    # Exactly ``wanted`` groups, or every informative group and the shortfall counted.
    available = int(informative_groups(scores, ids).sum())
    assert int(pick.valid.sum()) == min(wanted, available)
    assert int(pick.valid.sum()) + int(pick.shortfall) == wanted
    # The valid slots come first, in draw order.
    k = int(pick.valid.sum())
    assert bool(pick.valid[:k].all()) and pick.groups[:k].tolist() == sorted(pick.groups[:k].tolist())


def test_refill_groups_hand_computed_no_host_sync_and_bad_input():
    s = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    pick = refill_groups(s, ids, wanted=3, num_groups=4)
    assert pick.groups.tolist() == [1, 3, -1] and pick.valid.tolist() == [True, True, False]
    assert int(pick.shortfall) == 1
    assert refill_groups(s, ids, wanted=1).groups.tolist() == [1]
    assert informative_groups(s, ids, num_groups=5).tolist() == [False, True, False, True, False]
    assert_no_host_sync(lambda a, b: refill_groups(a, b, wanted=3, num_groups=4), s, ids)
    with pytest.raises(ValueError, match="wanted: got -1"):
        refill_groups(s, ids, wanted=-1)
    with pytest.raises(ValueError, match="group_ids"):
        refill_groups(s, ids[:3], wanted=1)
