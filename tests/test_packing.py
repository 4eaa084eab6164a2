import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.dataflow import Packed, pack, pack_to_budget, shift_labels, unpack
from rlcore.pytree import tree_leaves, tree_map
from rlcore.testing import assert_no_host_sync
from rlcore.testing.reference import (
    first_fit_decreasing_ref,
    min_bins_ref,
    pack_ref,
    shift_labels_ref,
    unpack_ref,
)
from rlcore.testing.token_strategies import ragged_token_batches, token_lengths


@given(ragged_token_batches())
def test_pack_matches_loop_reference(batch):
    packed = pack(batch)
    want = pack_ref(batch["input_ids"], batch["attention_mask"])
    assert packed.input_ids.tolist() == want["input_ids"]
    assert packed.position_ids.tolist() == want["position_ids"]
    assert packed.cu_seqlens.tolist() == want["cu_seqlens"]
    assert packed.indices.tolist() == want["indices"]
    assert packed.cu_seqlens.dtype == torch.int32 and packed.input_ids.dtype == torch.int64
    lengths = batch["attention_mask"].sum(1)
    assert packed.max_seqlen == int(lengths.max())
    assert packed.padded_shape == tuple(batch["input_ids"].shape)


@given(ragged_token_batches(), st.sampled_from([torch.float32, torch.bfloat16]), st.floats(-5, 5))
def test_unpack_inverts_pack(batch, dtype, fill):
    packed = pack(batch)
    n = packed.input_ids.shape[0]
    values = torch.arange(n, dtype=torch.float64).to(dtype) + 0.5
    got = unpack(values, packed, fill=fill)
    assert got.shape == batch["input_ids"].shape and got.dtype == dtype
    want = unpack_ref(values.tolist(), batch["attention_mask"], fill=torch.tensor(fill, dtype=dtype).item())
    assert got.tolist() == want
    # Token ids make the round trip exactly, at the real positions.
    ids = unpack(packed.input_ids, packed, fill=-1)
    real = batch["attention_mask"].bool()
    assert torch.equal(ids[real], batch["input_ids"][real]) and torch.all(ids[~real] == -1)


@given(ragged_token_batches())
def test_shift_labels_never_cross_a_boundary(batch):
    packed = pack(batch)
    labels, mask = shift_labels(packed)
    want_labels, want_mask = shift_labels_ref(batch["input_ids"], batch["attention_mask"])
    assert labels.tolist() == want_labels and mask.tolist() == want_mask
    # Exactly one unlabelled token per non-empty sequence: its last.
    lengths = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist()
    assert int((~mask).sum()) == sum(1 for x in lengths if x > 0)


@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.integers(0, 2**16))
def test_ragged_equals_padded(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 50, (x,), generator=g) for x in lengths]
    t = max(lengths)
    ids = torch.zeros(len(seqs), t, dtype=torch.int64)
    mask = torch.zeros(len(seqs), t, dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : s.shape[0]] = s
        mask[b, : s.shape[0]] = 1
    a, b = pack(seqs), pack({"input_ids": ids, "attention_mask": mask})
    for x, y in zip(tree_leaves(a), tree_leaves(b)):
        assert torch.equal(x, y)
    assert (a.max_seqlen, a.padded_shape) == (b.max_seqlen, b.padded_shape)


def test_hand_written_example():
    batch = {
        "input_ids": torch.tensor([[0, 0, 11, 12, 13], [21, 22, 0, 0, 0], [0, 0, 0, 0, 0]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]),
    }
    p = pack(batch)
    assert p.input_ids.tolist() == [11, 12, 13, 21, 22]
    assert p.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 5]
    assert p.indices.tolist() == [2, 3, 4, 5, 6]
    assert p.max_seqlen == 3
    labels, mask = shift_labels(p)
    assert labels.tolist() == [12, 13, 0, 22, 0] and mask.tolist() == [True, True, False, True, False]


def test_packed_is_a_pytree_container():
    p = pack([torch.tensor([1, 2]), torch.tensor([3])])
    moved = tree_map(lambda t: t.clone(), p)
    assert isinstance(moved, Packed) and moved.max_seqlen == 2 and moved.padded_shape == (2, 2)
    assert torch.equal(moved.input_ids, p.input_ids)


def test_unpack_gradient():
    p = pack([torch.tensor([1, 2, 3]), torch.tensor([4])])
    v = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: unpack(x, p, fill=1.5), (v,))


def test_unpack_and_shift_labels_have_no_host_sync():
    p = pack([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    assert_no_host_sync(lambda v, q: unpack(v, q), torch.randn(5), p)
    assert_no_host_sync(shift_labels, p)


@pytest.mark.parametrize("method", ["kk", "lpt"])
@given(token_lengths(max_len=10, max_batch=8), st.integers(10, 25))
def test_pack_to_budget_partitions_within_budget(method, lengths, budget):
    plan = pack_to_budget(lengths, budget, method=method)
    flat = sorted(i for mb in plan for i in mb)
    assert flat == list(range(len(lengths)))
    assert all(mb == sorted(mb) and mb for mb in plan)
    loads = [sum(lengths[i] for i in mb) for mb in plan]
    assert all(load <= budget for load in loads)
    total = sum(lengths)
    assert len(plan) >= math.ceil(total / budget)
    assert len(plan) <= max(1, first_fit_decreasing_ref(lengths, budget))
    # First-fit-decreasing's bound against the exhaustive optimum.
    assert len(plan) <= max(1, math.floor(11 / 9 * min_bins_ref(lengths, budget) + 6 / 9))
    # Balanced within one sequence length, unless the plan fell back to first-fit-decreasing.
    if len(plan) > 1 and max(loads) - min(loads) > max(lengths):
        assert len(plan) == first_fit_decreasing_ref(lengths, budget)


def test_pack_to_budget_examples():
    assert pack_to_budget([5, 1, 4, 2, 3], max_tokens=8) == [[0, 3], [1, 2, 4]]
    assert pack_to_budget([5, 1, 4, 2, 3], max_tokens=8, method="lpt") == [[0, 1, 3], [2, 4]]
    assert pack_to_budget(torch.tensor([8, 8, 8]), max_tokens=8) == [[0], [1], [2]]
    assert pack_to_budget([], max_tokens=4) == []
    # Many short sequences: balanced loads, fewest micro-batches the budget allows.
    plan = pack_to_budget([3] * 10, max_tokens=12)
    assert sorted(len(mb) for mb in plan) == [3, 3, 4]


@settings(max_examples=20)
@given(ragged_token_batches(max_batch=4, max_len=8))
def test_pack_on_int32_inputs(batch):
    b32 = {k: v.int() for k, v in batch.items()}
    a, b = pack(batch), pack(b32)
    assert torch.equal(a.input_ids, b.input_ids) and b.input_ids.dtype == torch.int64


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: pack({"input_ids": torch.zeros(2, 3, dtype=torch.long)}),
            r"batch: got keys \['input_ids'\], expected 'input_ids' and 'attention_mask'",
        ),
        (
            lambda: pack({"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 4)}),
            r"attention_mask: got shape \(2, 4\), expected \(2, 3\)",
        ),
        (
            lambda: pack({"input_ids": torch.zeros(2, 3), "attention_mask": torch.ones(2, 3)}),
            r"input_ids: got dtype torch.float32, expected an integer",
        ),
        (lambda: pack([]), r"batch: got list, expected a mapping"),
        (lambda: pack([torch.zeros(2, 2, dtype=torch.long)]), r"batch\[0\]: got shape \(2, 2\) \(2-D\), expected 1-D"),
        (
            lambda: unpack(torch.zeros(3), pack([torch.tensor([1, 2])])),
            r"values: got shape \(3,\), expected \(2, \.\.\.\)",
        ),
        (
            lambda: unpack(torch.zeros(2), {"input_ids": torch.zeros(2)}),
            r"packed: got dict, expected an rlcore.ops.Packed",
        ),
        (lambda: pack_to_budget([3, 9], max_tokens=8), r"lengths: got 9 at index 1, expected token counts in \[0, 8\]"),
        (lambda: pack_to_budget([3], max_tokens=0), r"max_tokens: got 0, expected a positive int"),
        (lambda: pack_to_budget(torch.tensor([1.0]), max_tokens=4), r"lengths: got dtype torch.float32"),
        (lambda: pack_to_budget([1], max_tokens=4, method="ffd"), r"method: got .ffd., expected one of .kk., .lpt."),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
