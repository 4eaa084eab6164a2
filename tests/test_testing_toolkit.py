import subprocess
import sys

import torch
from hypothesis import given

from rlcore.testing import group_ids, grouped_scores, logits_and_labels, masks, token_batches


@given(masks(6, 12, interior_zeros=False, allow_empty=False))
def test_masks_are_right_padded(m):
    assert m.dtype == torch.bool and m.shape == (6, 12)
    lengths = m.sum(1)
    assert torch.all(lengths >= 1)
    for row, n in zip(m, lengths):
        assert row[: int(n)].all() and not row[int(n) :].any()


@given(token_batches(min_len=6, max_len=12))
def test_token_batches_pad_with_nan_outside_the_mask(batch):
    v, m = batch["values"], batch["mask"]
    assert torch.isnan(v[~m]).all()
    assert not torch.isnan(v[m]).any()


def test_interior_zeros_do_occur():
    from hypothesis import find

    found = find(masks(1, 10), lambda m: bool(m[0, 0]) and not bool(m[0, 1]) and bool(m[0, 2]))
    assert found[0, :3].tolist() == [True, False, True]


@given(group_ids(min_size=1, max_size=5))
def test_group_ids_cover_every_group(ids):
    counts = torch.bincount(ids)
    assert ids.dtype == torch.int64 and torch.all(counts >= 1) and torch.all(counts <= 5)


@given(grouped_scores())
def test_grouped_scores_align(data):
    scores, ids = data
    assert scores.shape == ids.shape and scores.dtype == torch.float32


@given(logits_and_labels(max_vocab=20))
def test_labels_within_vocab(data):
    logits, labels = data
    assert labels.min() >= 0 and labels.max() < logits.shape[1]


def test_import_rlcore_does_not_need_the_test_extra():
    code = "import sys, rlcore; assert 'hypothesis' not in sys.modules; print(rlcore.ops.masked_mean.__name__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "masked_mean"


def test_testing_without_the_test_extra_names_the_extra():
    # Issue 18, defect 15: a bare "No module named 'hypothesis'" did not say what to install.
    code = "import sys; sys.modules['hypothesis'] = None; import rlcore.testing"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("ModuleNotFoundError: rlcore.testing needs hypothesis") and 'pip install "rlcore[test]"' in last
    )


def test_testing_docs_carry_the_hypothesis_deadline_note():
    import rlcore.testing

    doc = rlcore.testing.__doc__
    assert "deadline=None" in doc and "DeadlineExceeded" in doc and 'pip install "rlcore[test]"' in doc
