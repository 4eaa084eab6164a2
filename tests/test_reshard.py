import datetime
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import dist_helpers
from rlcore.dataflow.layout import Layout, Placement, decoder_layout, param_meta
from rlcore.dataflow.reshard import allocate_buckets, plan_reshard, reshard
from rlcore.testing.reference.resharding import local_shard_ref


def tiny_decoder(layers=2, hidden=16, vocab=64, experts=4, dtype=torch.bfloat16):
    """Full (unsharded) weights of a small MoE decoder, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(1234)
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (hidden // 2, hidden),
                p + "self_attn.v_proj.weight": (hidden // 2, hidden),
                p + "self_attn.q_proj.bias": (hidden,),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (2 * hidden, hidden),
                p + "mlp.up_proj.weight": (2 * hidden, hidden),
                p + "mlp.down_proj.weight": (hidden, 2 * hidden),
                p + "mlp.gate.weight": (experts, hidden),
                p + "mlp.experts.gate_up_proj": (experts, hidden, 4 * hidden),
                p + "mlp.experts.down_proj": (experts, 2 * hidden, hidden),
            }
        )
    return {
        n: torch.randn(s, generator=g).to(torch.float32 if n.endswith("norm.weight") else dtype)
        for n, s in shapes.items()
    }


RESHARD_CASES = {
    4: {
        "tp2dp2_to_tp1": (dict(tp=2, dp=2), dict(dp=4)),
        "tp2dp2_to_tp4": (dict(tp=2, dp=2), dict(tp=4)),
        "tp4_to_tp2dp2": (dict(tp=4), dict(tp=2, dp=2)),
        "pp2tp2_to_tp2dp2": (dict(pp=2, tp=2), dict(tp=2, dp=2)),
        "pp2dp2_to_dp4": (dict(pp=2, dp=2), dict(dp=4)),
        "pp2tp2_to_tp1": (dict(pp=2, tp=2), dict(dp=4)),
        "ep2dp2_to_ep4": (dict(ep=2, dp=2), dict(ep=4)),
        "ep2tp2_to_ep4": (dict(ep=2, tp=2), dict(ep=4)),
        "ep4_to_ep2dp2": (dict(ep=4), dict(ep=2, dp=2)),
    },
    2: {
        "tp1dp2_to_tp2": (dict(dp=2), dict(tp=2)),
        "tp2_to_tp1dp2": (dict(tp=2), dict(dp=2)),
        "pp2_to_dp2": (dict(pp=2), dict(dp=2)),
    },
}


def check_reshard(rank, src_kw, dst_kw):
    full = tiny_decoder()
    meta = param_meta(full)
    src, dst = decoder_layout(meta, **src_kw), decoder_layout(meta, **dst_kw)
    plan = plan_reshard(meta, src, dst, bucket_bytes=16 << 10)
    assert len(plan.buckets) > 2
    params = {n: local_shard_ref(t, src, n, rank) for n, t in full.items() if src.holds(n, rank)}
    before = {n: t.clone() for n, t in params.items()}
    out = allocate_buckets(plan, "cpu")
    weights = reshard(params, plan, mesh=src.device_mesh("cpu"), out=out)
    assert set(weights) == set(full)
    for n, w in weights.items():
        want = local_shard_ref(full[n], dst, n, rank)
        assert w.dtype == want.dtype and torch.equal(w, want), n
        assert any(w.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in out), n
    for n, t in params.items():
        assert torch.equal(t, before[n]), f"source {n} was modified"


def _worker(rank, world, tmp, checks):
    # A check that fails on one rank leaves its peers in a collective: time out instead of hanging.
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    results = {}
    for name, (fn, args) in checks.items():
        try:
            fn(rank, *args)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        with open(os.path.join(tmp, f"result_{rank}.json"), "w") as f:
            json.dump(results, f)
        if results[name] != "ok":
            # Peers may be waiting in a collective this rank left: stop rather than mismatch them.
            os._exit(0)
        dist.barrier()
    dist_helpers.leave()


def run_group(world, checks, tmp):
    """Run every check on one spawned gloo group of ``world`` CPU processes; rank -> {check: outcome}."""
    os.makedirs(tmp, exist_ok=True)
    # Every reshard check and swap run of the session in one group: beside the other multi-process files on 2 slow
    # cores it has taken over 300 s, so its bound is wider than a single check's.
    dist_helpers.spawn(_worker, (world, str(tmp), checks), nprocs=world, timeout=900)
    out = {}
    for r in range(world):
        path = os.path.join(tmp, f"result_{r}.json")
        out[r] = {}
        if os.path.exists(path):
            with open(path) as f:
                out[r] = json.load(f)
    return out


def assert_ok(results, name):
    for rank, res in results.items():
        got = res.get(name, "not run: an earlier check failed on this rank")
        assert got == "ok", f"rank {rank}:\n{got}"


def check_defect13_ranks_disagreeing_on_the_plan_all_raise(rank):
    # Rank 1 plans with another bucket size: same layouts, other buckets. Before any weight
    # moves, the ranks compare plan fingerprints and every rank raises, naming the mismatch.
    full = tiny_decoder()
    meta = param_meta(full)
    src, dst = decoder_layout(meta, tp=2), decoder_layout(meta, dp=2)
    plan = plan_reshard(meta, src, dst, bucket_bytes=(16 << 10) * (1 + rank))
    params = {n: local_shard_ref(t, src, n, rank) for n, t in full.items()}
    with pytest.raises(
        ValueError, match=r"plan: the ranks disagree on the resharding plan \(rank 1 differs from rank 0"
    ):
        reshard(params, plan, mesh=src.device_mesh("cpu"))
    # Another layout on one rank: the same.
    other = plan_reshard(meta, src, decoder_layout(meta, tp=2) if rank else dst, bucket_bytes=16 << 10)
    with pytest.raises(ValueError, match="plan: the ranks disagree"):
        reshard(params, other, mesh=src.device_mesh("cpu"))


def check_defect13_bad_input_on_one_rank_raises_on_every_rank(rank):
    full = tiny_decoder()
    meta = param_meta(full)
    src, dst = decoder_layout(meta, tp=2), decoder_layout(meta, dp=2)
    plan = plan_reshard(meta, src, dst, bucket_bytes=16 << 10)
    params = {n: local_shard_ref(t, src, n, rank) for n, t in full.items()}
    if rank == 1:
        params.pop("lm_head.weight")
        match = "params: rank 1 holds 'lm_head.weight'"
    else:
        match = r"params: rank\(s\) \[1\] rejected their input"
    with pytest.raises(ValueError, match=match):
        reshard(params, plan, mesh=src.device_mesh("cpu"))
    # One bucket at a time: ranks asked for different buckets.
    from rlcore.dataflow.reshard import reshard_bucket

    full_params = {n: local_shard_ref(t, src, n, rank) for n, t in full.items()}
    out = allocate_buckets(plan, "cpu")
    with pytest.raises(ValueError, match=r"index: the ranks disagree on the bucket \(rank 1 runs bucket 1, rank 0"):
        reshard_bucket(full_params, plan, rank, mesh=src.device_mesh("cpu"), out=out[rank])


def check_reshard_leaves_no_hold_on_the_training_storage(rank):
    # The 20-run loop caught the memory notebook's AllGather-Swap refusing to offload a
    # parameter "held by 1 tensor outside the tree": gloo's worker thread still held the
    # all-gather's input, the parameter itself, for a moment after the call returned (in
    # about one call in ten). The collectives now get a copy: once reshard returns, nothing
    # but the caller holds a training storage. Broadcast (pp) and all-gather (tp) moves.
    full = tiny_decoder()
    meta = param_meta(full)
    for src_kw in (dict(tp=2), dict(pp=2)):
        src, dst = decoder_layout(meta, **src_kw), decoder_layout(meta, dp=2)
        plan = plan_reshard(meta, src, dst, bucket_bytes=16 << 10)
        params = {n: local_shard_ref(t, src, n, rank) for n, t in full.items() if src.holds(n, rank)}
        out = allocate_buckets(plan, "cpu")
        held = {n: torch._C._storage_Use_Count(p.untyped_storage()._cdata) for n, p in params.items()}
        for attempt in range(100):
            reshard(params, plan, mesh=src.device_mesh("cpu"), out=out)
            now = {n: torch._C._storage_Use_Count(p.untyped_storage()._cdata) for n, p in params.items()}
            extra = {n: now[n] - held[n] for n in params if now[n] != held[n]}
            assert not extra, f"{src_kw}, reshard {attempt}: storages still held after the call {extra}"


DEFECT13_CHECKS = {
    "defect13:plans": (check_defect13_ranks_disagreeing_on_the_plan_all_raise, ()),
    "defect13:inputs": (check_defect13_bad_input_on_one_rank_raises_on_every_rank, ()),
}
REPROBE_CHECKS = {"reprobe:no-hold": (check_reshard_leaves_no_hold_on_the_training_storage, ())}


_GROUPS = {}


def shared_group(world, tmp_path_factory):
    """One spawned group per world size for the whole session: reshard checks plus AllGather-Swap runs."""
    if world not in _GROUPS:
        checks = {n: (check_reshard, args) for n, args in RESHARD_CASES[world].items()}
        if world == 2:
            checks.update(DEFECT13_CHECKS | REPROBE_CHECKS)
        if world == 4:
            from test_memory_plan import SWAP_CASES, check_allgather_swap_training

            checks.update({f"swap:{n}": (check_allgather_swap_training, args) for n, args in SWAP_CASES.items()})
        _GROUPS[world] = run_group(world, checks, tmp_path_factory.mktemp(f"group{world}"))
    return _GROUPS[world]


@pytest.fixture(scope="module")
def group4(tmp_path_factory):
    return shared_group(4, tmp_path_factory)


@pytest.fixture(scope="module")
def group2(tmp_path_factory):
    return shared_group(2, tmp_path_factory)


@pytest.mark.parametrize("case", sorted(RESHARD_CASES[4]))
def test_reshard_on_four_gloo_ranks_is_bit_identical(group4, case):
    assert_ok(group4, case)


@pytest.mark.parametrize("case", sorted(RESHARD_CASES[2]))
def test_reshard_on_two_gloo_ranks_is_bit_identical(group2, case):
    assert_ok(group2, case)


@pytest.mark.parametrize("case", sorted(DEFECT13_CHECKS))
def test_defect13_reshard_detects_ranks_that_disagree(group2, case):
    # Each check ends with the group's barrier: no rank was left inside a collective.
    assert_ok(group2, case)


def test_reprobe_reshard_leaves_no_hold_on_the_training_storage(group2):
    assert_ok(group2, "reprobe:no-hold")


# --------------------------------------------------------------------------- plans, no process group

META = param_meta(tiny_decoder(hidden=16))


def _index_set(layout, name, rank):
    shape = tuple(META[name].shape)
    numbered = torch.arange(torch.Size(shape).numel()).reshape(shape)
    shard = local_shard_ref(numbered, layout, name, rank)
    return set(shard.reshape(-1).tolist())


SIZES = st.sampled_from(
    [
        dict(tp=4),
        dict(tp=2, dp=2),
        dict(dp=4),
        dict(ep=4),
        dict(ep=2, dp=2),
        dict(ep=2, tp=2),
        dict(pp=2, tp=2),
        dict(pp=2, dp=2),
        dict(pp=2, ep=2),
    ]
)


def _after_broadcast(src):
    """The layout the ranks hold once the pipeline broadcast is done: same dp/ep/tp coordinates, no stages."""
    return Layout(
        {n: Placement(tp=p.tp, ep=p.ep) for n, p in src.placements.items()}, dp=src.dp * src.pp, ep=src.ep, tp=src.tp
    )


PROBED = [
    "model.embed_tokens.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.0.mlp.experts.down_proj",
    "model.norm.weight",
]


@settings(max_examples=25)
@given(SIZES, SIZES.filter(lambda kw: "pp" not in kw))
def test_plan_collectives_match_where_the_data_is(src_kw, dst_kw):
    src, dst = decoder_layout(META, **src_kw), decoder_layout(META, **dst_kw)
    plan = plan_reshard(META, src, dst, bucket_bytes=64 << 10)
    flat = _after_broadcast(src)
    for name in PROBED:
        kinds = {m.mesh_dim: m.collective for m in plan.params[name].moves}
        assert (kinds.get("pp") == "broadcast") == (src.pp > 1)
        for dim in ("tp", "ep"):
            if dim not in kinds:
                assert getattr(src.placements[name], dim) is None
                continue
            s, d = getattr(src, dim), getattr(dst, dim)
            local = []
            for r in range(4):
                want = _index_set(dst, name, r)
                others = [x for x in ("dp", "ep", "tp") if x != dim]
                group = [q for q in range(4) if all(flat.coords(q)[x] == flat.coords(r)[x] for x in others)]
                held = {q: _index_set(flat, name, q) for q in group}
                assert want <= set().union(*held.values())
                local.append(want <= held[r])
                if kinds[dim] == "all_to_all":
                    assert any(want <= h for h in held.values())
            if kinds[dim] == "split":
                assert all(local)
            elif kinds[dim] == "all_to_all":
                assert d % s == 0 and not all(local)
            else:
                assert kinds[dim] == "all_gather" and s % d == 0 and d < s


@settings(max_examples=25)
@given(SIZES, SIZES.filter(lambda kw: "pp" not in kw), st.integers(0, 32 << 10))
def test_buckets_are_one_dtype_bounded_and_cover_every_parameter_once(src_kw, dst_kw, slack):
    src, dst = decoder_layout(META, **src_kw), decoder_layout(META, **dst_kw)
    loose = plan_reshard(META, src, dst, bucket_bytes=1 << 30)
    need = max(p.dst_bytes + p.transient_bytes for p in loose.params.values())
    with pytest.raises(ValueError, match=f"bucket_bytes: got {need - 1}, expected at least {need}"):
        plan_reshard(META, src, dst, bucket_bytes=need - 1)
    plan = plan_reshard(META, src, dst, bucket_bytes=need + slack)
    names = [n for b in plan.buckets for n in b.names]
    assert names == list(META)
    for b in plan.buckets:
        assert {plan.params[n].dtype for n in b.names} == {b.dtype}
        assert b.nbytes == sum(plan.params[n].dst_bytes for n in b.names)
        assert b.nbytes + b.transient_bytes <= plan.bucket_bytes
    sizes = [t.numel() * t.element_size() for t in allocate_buckets(plan, "meta")]
    assert sizes == [b.nbytes for b in plan.buckets]


def test_hand_counted_plan_for_tp2_to_tp1():
    meta = {"model.layers.0.self_attn.o_proj.weight": torch.empty(8, 4, dtype=torch.bfloat16, device="meta")}
    plan = plan_reshard(meta, decoder_layout(meta, tp=2), decoder_layout(meta, dp=2), bucket_bytes=1024)
    pm = plan.params["model.layers.0.self_attn.o_proj.weight"]
    assert pm.src_shape == (8, 2) and pm.dst_shape == (8, 4)
    assert [(m.collective, m.mesh_dim, m.tensor_dim) for m in pm.moves] == [("all_gather", "tp", 1)]
    # 64 bytes of inference weights; in flight the gathered 8x4 bf16 tensor, 64 bytes.
    assert (pm.dst_bytes, pm.transient_bytes) == (64, 64)


def test_world_size_mismatch_names_both_sizes():
    with pytest.raises(
        ValueError, match=r"dst_layout: got world size 8 \(pp=1 × dp=2 × ep=1 × cp=1 × tp=4\), expected 4"
    ):
        plan_reshard(META, decoder_layout(META, tp=4), decoder_layout(META, tp=4, dp=2))


def test_sizes_that_do_not_divide_are_rejected():
    meta = {"w": torch.empty(12, 12, device="meta")}
    src = Layout({"w": Placement(tp=0)}, tp=2, dp=3)
    dst = Layout({"w": Placement(tp=0)}, tp=3, dp=2)
    with pytest.raises(
        ValueError, match="tp: got 2 in src_layout and 3 in dst_layout, expected one to divide the other"
    ):
        plan_reshard(meta, src, dst)


def test_placement_on_a_missing_dimension_is_rejected():
    meta = {"norm.weight": torch.empty(16, device="meta")}
    src = Layout({"norm.weight": Placement(tp=1)}, tp=2)
    with pytest.raises(
        ValueError,
        match=r"src_layout: parameter 'norm.weight' of shape \(16,\) is split over tp on dim 1, expected a dim < 1",
    ):
        plan_reshard(meta, src, Layout({"norm.weight": Placement(tp=1)}, dp=2))


def test_bucket_smaller_than_a_parameter_is_rejected():
    with pytest.raises(
        ValueError, match=r"bucket_bytes: got 1024, expected at least \d+: parameter 'model.embed_tokens.weight'"
    ):
        plan_reshard(META, decoder_layout(META, tp=2, dp=2), decoder_layout(META, dp=4), bucket_bytes=1024)


def test_inference_pipeline_is_rejected():
    with pytest.raises(ValueError, match=r"dst_layout: got pp=2, expected pp=1"):
        plan_reshard(META, decoder_layout(META, pp=2, dp=2), decoder_layout(META, pp=2, tp=2))


def test_changed_split_dim_is_rejected():
    meta = {"w": torch.empty(4, 4, device="meta")}
    with pytest.raises(ValueError, match=r"dst_layout: parameter 'w' is split as \(tp=1, ep=None\)"):
        plan_reshard(meta, Layout({"w": Placement(tp=0)}, tp=2), Layout({"w": Placement(tp=1)}, tp=2))


def test_reshard_rejects_missing_parameters_before_any_collective():
    from rlcore.dataflow.reshard import reshard_bucket

    meta = {"w": torch.empty(4, 4, device="meta")}
    lay = Layout({"w": Placement()})
    plan = plan_reshard(meta, lay, lay)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="params: rank 0 holds 'w' in src_layout"):
            reshard_bucket({}, plan, 0, mesh=None, out=allocate_buckets(plan, "cpu")[0])
    finally:
        dist.destroy_process_group()
