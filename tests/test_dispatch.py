"""Sample-flow dispatch: balanced_partition against the exhaustive optimum, shard_samples on real gloo groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import dist_helpers
from rlcore.dataflow import balanced_partition, shard_samples
from rlcore.testing.dataflow_strategies import token_lengths
from rlcore.testing.reference import balanced_partition_ref


def loads(parts, lengths):
    return [int(lengths[p].sum()) for p in parts]


# ---------------------------------------------------------------------------- balanced_partition


def test_textbook_example_by_hand():
    lengths = torch.tensor([8, 7, 6, 5, 4])
    # Karmarkar-Karp: (8|7), (6|5), then 4 with (8|7) -> (11|8), then with (6|5) -> (16|14).
    kk = balanced_partition(lengths, 2, method="kk")
    assert [p.tolist() for p in kk] == [[1, 3, 4], [0, 2]] and loads(kk, lengths) == [16, 14]
    # LPT: 8->A, 7->B, 6->B (13), 5->A (13), 4->A (tie, first part): 17 / 13.
    lpt = balanced_partition(lengths, 2, method="lpt")
    assert [p.tolist() for p in lpt] == [[0, 3, 4], [1, 2]] and loads(lpt, lengths) == [17, 13]


@given(lengths=token_lengths(), k=st.integers(1, 6), method=st.sampled_from(["kk", "lpt"]))
def test_every_sample_lands_in_exactly_one_part(lengths, k, method):
    parts = balanced_partition(lengths, k, method=method)
    assert len(parts) == k
    assert all(p.dtype == torch.int64 and bool((p[1:] > p[:-1]).all()) for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(lengths.numel()))


@given(
    lengths=st.lists(st.integers(0, 50), min_size=1, max_size=7),
    k=st.integers(2, 3),
    method=st.sampled_from(["kk", "lpt"]),
)
@settings(max_examples=40)
def test_within_the_approximation_bound_of_the_exhaustive_optimum(lengths, k, method):
    best = balanced_partition_ref(lengths, k)
    got = max(loads(balanced_partition(torch.tensor(lengths), k, method=method), torch.tensor(lengths)))
    assert best <= got <= (4 / 3 - 1 / (3 * k)) * best + 1e-9


@given(lengths=token_lengths(max_size=24), k=st.integers(1, 6), method=st.sampled_from(["kk", "lpt"]), data=st.data())
def test_groups_stay_whole_and_equal_size_holds(lengths, k, method, data):
    group_ids = torch.tensor(
        data.draw(st.lists(st.integers(0, 5), min_size=lengths.numel(), max_size=lengths.numel())), dtype=torch.int64
    )
    parts = balanced_partition(lengths, k, group_ids=group_ids, method=method)
    owners = [set(group_ids[p].tolist()) for p in parts]
    assert all(not (a & b) for i, a in enumerate(owners) for b in owners[i + 1 :])
    assert sorted(torch.cat(parts).tolist()) == list(range(lengths.numel()))
    n = (lengths.numel() // k) * k
    if n:
        equal = balanced_partition(lengths[:n], k, method=method, equal_size=True)
        assert [p.numel() for p in equal] == [n // k] * k


def test_balances_heavy_tailed_lengths():
    g = torch.Generator().manual_seed(0)
    lengths = (torch.empty(1024).log_normal_(6.5, 1.0, generator=g).clamp(16, 16384)).to(torch.int64)
    mean = float(lengths.sum()) / 8
    for method in ("kk", "lpt"):
        assert max(loads(balanced_partition(lengths, 8, method=method), lengths)) / mean <= 1.02
    contiguous = max(int(p.sum()) for p in lengths.tensor_split(8)) / mean
    assert contiguous > 1.05  # the baseline this replaces is visibly worse on the same data


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"lengths": torch.tensor([1.0, 2.0]), "k": 2}, "lengths"),
        ({"lengths": torch.ones(2, 2, dtype=torch.int64), "k": 2}, "lengths"),
        ({"lengths": torch.tensor([3, -1]), "k": 2}, "lengths"),
        ({"lengths": torch.tensor([3, 1]), "k": 0}, "k"),
        ({"lengths": torch.tensor([3, 1]), "k": 2, "method": "greedy"}, "method"),
        ({"lengths": torch.tensor([3, 1, 2]), "k": 2, "equal_size": True}, "k"),
        ({"lengths": torch.tensor([3, 1]), "k": 2, "group_ids": torch.tensor([0, 1, 1])}, "group_ids"),
        ({"lengths": torch.tensor([3, 1]), "k": 2, "group_ids": torch.tensor([0.0, 1.0])}, "group_ids"),
    ],
)
def test_partition_bad_input(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        balanced_partition(**kwargs)


def test_shard_samples_bad_options():
    with pytest.raises(ValueError, match="group"):
        shard_samples(lambda b: b, DeviceMesh("cpu", torch.arange(4).reshape(2, 2), _init_backend=False))
    with pytest.raises(ValueError, match="balance"):
        shard_samples(lambda b: b, balance="random")
    with pytest.raises(ValueError, match="method"):
        shard_samples(lambda b: b, method="greedy")


# ---------------------------------------------------------------------------- shard_samples over gloo


def _batch(size: int) -> dict:
    g = torch.Generator().manual_seed(size)
    lengths = (torch.empty(size).log_normal_(3.0, 1.0, generator=g).clamp(1, 200)).to(torch.int64)
    width = int(lengths.max())
    return {
        "x": torch.randn(size, 3, generator=g),
        "half": torch.randn(size, generator=g).to(torch.bfloat16),
        "mask": torch.arange(width) < lengths[:, None],
        "group_ids": torch.arange(size) // 4,
    }


def _row_fn(batch):
    # Per-sample outputs, tagged with the rank that computed them.
    rank = dist.get_rank()
    n = batch["x"].shape[0]
    return {
        "y": batch["x"].sum(1) * 2,
        "half": batch["half"] + 1,
        "rank": torch.full((n,), rank),
        "tokens": batch["mask"].sum(1),
        "group_ids": batch["group_ids"],
    }


def _worker(rank, world, store_path, out_path):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    try:
        batch = _batch(64)
        for name, kwargs in {
            "tokens": {},
            "contiguous": {"balance": "contiguous"},
            "groups": {"group_key": "group_ids", "method": "lpt"},
            "src1": {"src": 1},
            "mesh": {"group": init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))["dp"], "equal_size": True},
        }.items():
            src = kwargs.get("src", 0)
            results[name] = shard_samples(_row_fn, **kwargs)(batch if rank == src else None)
        try:
            shard_samples(_row_fn, src=world)(batch)
        except ValueError as err:
            results["bad src"] = str(err)
    except BaseException:
        dist.destroy_process_group()
        raise
    finally:
        torch.save(results, f"{out_path}.{rank}")
    dist_helpers.leave()


@pytest.mark.parametrize("world", [2, 4])
def test_shard_samples_on_gloo(tmp_path, world):
    dist_helpers.spawn(_worker, (world, str(tmp_path / "store"), str(tmp_path / "out")), nprocs=world)
    outs = [torch.load(f"{tmp_path / 'out'}.{r}") for r in range(world)]
    batch = _batch(64)
    # The reference is fn on the unsharded batch: row-wise outputs must match row for row.
    want = {"y": batch["x"].sum(1) * 2, "half": batch["half"] + 1, "tokens": batch["mask"].sum(1)}
    for name in ("tokens", "contiguous", "groups", "src1", "mesh"):
        src = 1 if name == "src1" else 0
        got = outs[src][name]
        assert all(outs[r][name] is None for r in range(world) if r != src), name
        torch.testing.assert_close(got["y"], want["y"])
        assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], want["half"])
        assert torch.equal(got["tokens"], want["tokens"])
        assert sorted(set(got["rank"].tolist())) == list(range(world)), name
    per_rank = lambda res: [int(res["tokens"][res["rank"] == r].sum()) for r in range(world)]  # noqa: E731
    mean = float(want["tokens"].sum()) / world
    balanced, contiguous = max(per_rank(outs[0]["tokens"])) / mean, max(per_rank(outs[0]["contiguous"])) / mean
    assert balanced <= contiguous and balanced <= 1.1
    # contiguous: rank r computed the r-th contiguous piece.
    assert torch.equal(
        outs[0]["contiguous"]["rank"],
        torch.cat([torch.full((p.numel(),), r) for r, p in enumerate(torch.arange(64).tensor_split(world))]),
    )
    # group_key: every group was computed on one rank.
    grouped = outs[0]["groups"]
    for gid in grouped["group_ids"].unique():
        assert grouped["rank"][grouped["group_ids"] == gid].unique().numel() == 1
    assert all("src" in outs[r]["bad src"] for r in range(world))
    # equal_size over a DeviceMesh: every rank computed 64 / world samples.
    assert torch.bincount(outs[0]["mesh"]["rank"]).tolist() == [64 // world] * world
