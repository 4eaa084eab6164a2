import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import dist_helpers
from rlcore.algos import AGGREGATION_MODES, aggregate, dpo, global_counts, grpo
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.testing.loss_strategies import microbatch_splits
from rlcore.testing.strategies import token_batches


def _with_mask(batch, weighted, seed):
    if weighted:
        g = torch.Generator().manual_seed(seed)
        batch["mask"] = batch["mask"] * torch.rand(batch["mask"].shape, generator=g)
    return batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@settings(max_examples=20)
@given(
    batch=token_batches(max_batch=6, max_len=10, patterns=("normal", "constant", "binary")),
    counts=st.fixed_dictionaries(
        {
            "num_tokens": st.sampled_from([None, 7, 100.0]),
            "num_seqs": st.sampled_from([None, 3, 9]),
            "horizon": st.sampled_from([None, 16]),
        }
    ),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_loop_reference(mode, dtype, batch, counts, weighted, seed):
    batch = _with_mask(batch, weighted, seed)
    loss_t = batch["values"].to(dtype)
    got = aggregate(loss_t, batch["mask"], mode=mode, **counts)
    want = ref.aggregate_ref(loss_t, batch["mask"], mode=mode, **counts)
    assert got.dtype == dtype and got.dim() == 0
    assert_close(got, torch.tensor(want, dtype=torch.float64), dtype=dtype, scale=10.0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@settings(max_examples=25)
@given(batch=token_batches(min_batch=2, max_batch=8, max_len=12, dtype=torch.float64), data=st.data())
def test_sum_over_any_microbatch_split_equals_the_whole_batch(mode, batch, data):
    loss_t, mask = batch["values"], batch["mask"]
    parts = data.draw(microbatch_splits(loss_t.shape[0]), label="split")
    counts = global_counts(mask)
    whole = aggregate(loss_t, mask, mode=mode, **counts, horizon=12)
    total = torch.zeros((), dtype=torch.float64)
    for idx in parts:
        # Each micro-batch is padded only to its own longest row, as dynamic batching does.
        cols = torch.nonzero(mask[idx].any(0))
        width = int(cols.max()) + 1 if cols.numel() else 1
        total = total + aggregate(loss_t[idx, :width], mask[idx, :width], mode=mode, **counts, horizon=12)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)


def test_local_normalisation_is_not_split_invariant_but_global_counts_are():
    # One sequence of 3 tokens (loss 1 each) and one of 1 token (loss 4): the token mean
    # is 7 / 4. Two micro-batches normalised locally and averaged give (1 + 4) / 2.
    loss_t = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    whole = aggregate(loss_t, mask, mode="token-mean")
    assert float(whole) == 1.75
    local = [aggregate(loss_t[i : i + 1], mask[i : i + 1], mode="token-mean") for i in range(2)]
    assert float(sum(local) / 2) == 2.5
    counts = global_counts(mask)
    exact = [aggregate(loss_t[i : i + 1], mask[i : i + 1], mode="token-mean", **counts) for i in range(2)]
    assert float(sum(exact)) == 1.75


def test_hand_computed_modes():
    loss_t = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # Counted tokens: 1, 2, 3 | 4; the third sequence is fully masked and not counted.
    assert float(aggregate(loss_t, mask, mode="token-sum")) == 10.0
    assert float(aggregate(loss_t, mask, mode="token-mean")) == 2.5
    assert float(aggregate(loss_t, mask, mode="seq-mean-token-sum")) == 5.0
    assert float(aggregate(loss_t, mask, mode="seq-mean-token-mean")) == 3.0
    assert float(aggregate(loss_t, mask, mode="seq-mean-token-sum-norm")) == 10.0 / (2 * 4)
    assert float(aggregate(loss_t, mask, mode="seq-mean-token-sum-norm", horizon=10)) == 0.5
    assert float(aggregate(loss_t, mask, mode="token-mean", num_tokens=torch.tensor(8))) == 1.25


def test_gradient_of_token_mean_is_mask_over_count():
    loss_t = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    aggregate(loss_t, mask, mode="token-mean", num_tokens=10).backward()
    torch.testing.assert_close(loss_t.grad, mask.double() / 10)
    loss_t.grad = None
    aggregate(loss_t, mask, mode="seq-mean-token-mean").backward()
    want = torch.tensor([[1 / 4, 1 / 4, 0, 0], [1 / 8] * 4, [0.0] * 4], dtype=torch.float64)
    torch.testing.assert_close(loss_t.grad, want)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_empty_mask_and_zero_counts_give_zero_not_nan(mode):
    loss_t = torch.full((2, 3), float("nan"))
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert float(aggregate(loss_t, mask, mode=mode)) == 0.0
    assert float(aggregate(loss_t, mask, mode=mode, num_tokens=0, num_seqs=torch.tensor(0))) == 0.0


def test_global_counts_hand_computed():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, True]])
    counts = global_counts(mask)
    assert counts["num_tokens"].dtype == torch.int64
    assert int(counts["num_tokens"]) == 4 and int(counts["num_seqs"]) == 2
    weighted = global_counts(torch.tensor([[0.5, 0.25], [0.0, 0.0]]))
    assert float(weighted["num_tokens"]) == 0.75 and float(weighted["num_seqs"]) == 1.0


def _rank_main(rank, world, init_file, loss_t, mask, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # Rank 0 holds the first row, rank 1 the others: uneven token counts per rank.
        rows = slice(0, 1) if rank == 0 else slice(1, None)
        counts = global_counts(mask[rows], process_group=dist.group.WORLD)
        recipe_counts = grpo().global_counts({"mask": mask[rows]}, process_group=dist.group.WORLD)
        pairs = dpo().global_counts({"chosen_logps": torch.zeros(3 + 2 * rank)}, process_group=dist.group.WORLD)
        results = {}
        for mode in AGGREGATION_MODES:
            local = aggregate(loss_t[rows], mask[rows], mode=mode, **counts)
            dist.all_reduce(local)
            results[mode] = local
        out = {"counts": counts, "recipe_counts": recipe_counts, "pairs": pairs, "results": results}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    dist_helpers.leave()


def test_sum_over_data_parallel_ranks_equals_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    loss_t = torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        dist_helpers.spawn(_rank_main, (2, init_file, loss_t, mask, tmp), nprocs=2)
        outs = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    for out in outs:
        assert int(out["counts"]["num_tokens"]) == 8 and int(out["counts"]["num_seqs"]) == 3
        assert out["recipe_counts"] == out["counts"]
        assert out["pairs"] == {"num_pairs": torch.tensor(8)}  # 3 pairs on rank 0, 5 on rank 1
        for mode in AGGREGATION_MODES:
            whole = aggregate(loss_t, mask, mode=mode)
            torch.testing.assert_close(out["results"][mode], whole, rtol=1e-12, atol=1e-12, msg=mode)


def test_bad_inputs_raise_value_error():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="mode: got 'mean'.*'token-mean'.*'seq-mean-token-sum-norm'"):
        aggregate(x, m, mode="mean")
    with pytest.raises(ValueError, match="mask"):
        aggregate(x, torch.ones(3, 2))
    with pytest.raises(ValueError, match="loss_t"):
        aggregate(torch.zeros(6), torch.ones(6))
    with pytest.raises(ValueError, match="horizon"):
        aggregate(x, m, mode="seq-mean-token-sum-norm", horizon=0)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(x, m, num_tokens=-1)
    with pytest.raises(ValueError, match="num_seqs"):
        aggregate(x, m, num_seqs=torch.ones(2))
    with pytest.raises(ValueError, match="mask"):
        global_counts(torch.ones(4))


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_no_host_sync(mode):
    g = torch.Generator().manual_seed(2)
    loss_t = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.4
    fn = functools.partial(aggregate, mode=mode, horizon=8)
    assert_no_host_sync(fn, loss_t, mask)
    assert_no_host_sync(fn, loss_t, mask, **global_counts(mask))
