import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import device as rdevice
from rlcore.dataflow.layout import decoder_layout, param_meta
from rlcore.dataflow.reshard import plan_reshard
from rlcore.memory import (
    AllGatherSwapPlan,
    MemoryPlan,
    StateGroup,
    TrainState,
    allgather_swap_plan,
    colocated_plan,
    enter_rollout,
    enter_train,
)
from rlcore.testing.reference.resharding import local_shard_ref, transition_peak_ref, unshard_ref
from test_reshard import assert_ok, shared_group, tiny_decoder

# --------------------------------------------------------------------------- plan arithmetic


def _train_rollout(params=100, grads=100, optimizer=400, weights=200, kv=300, chunks=()):
    groups = (
        StateGroup("params", params),
        StateGroup("grads", grads),
        StateGroup("optimizer", optimizer),
        StateGroup("weights", weights, source="params", chunks=chunks),
        StateGroup("kv", kv),
    )
    t, r = {"train": "device", "rollout": "host"}, {"train": "none", "rollout": "device"}
    return MemoryPlan(groups, {"params": t, "grads": t, "optimizer": t, "weights": r, "kv": r})


def test_hand_computed_peaks_train_to_rollout():
    plan = _train_rollout(chunks=((100, 10, 50), (100, 10, 50)))
    assert plan.resident_bytes("train") == 600 and plan.resident_bytes("rollout") == 500
    swap = plan.transition("train", "rollout")
    # offload grads (500), optimizer (100); build bucket 1: 100 + 100 + 10 -> 210, keep 200 - 50 = 150;
    # bucket 2: 150 + 100 + 10 = 260, end 200; allocate kv: 500.
    assert [(s.action, s.group, s.device_bytes, s.peak_bytes) for s in swap.steps] == [
        ("offload", "grads", 500, 600),
        ("offload", "optimizer", 100, 500),
        ("build", "weights", 200, 260),
        ("alloc", "kv", 500, 500),
    ]
    assert swap.peak_bytes == 600 and swap.redundancy_bytes == 0
    naive = plan.transition("train", "rollout", order="naive")
    # build with everything resident: 600 + 100 + 10, then 700 + 100 + 10 = 810; kv: 1100.
    assert naive.peak_bytes == 1100 and naive.redundancy_bytes == 500


def test_hand_computed_peaks_rollout_to_train():
    plan = _train_rollout()
    swap = plan.transition("rollout", "train")
    assert [s.action for s in swap.steps] == ["free", "free", "reload", "reload", "reload"]
    assert swap.peak_bytes == 600 and swap.redundancy_bytes == 0
    assert plan.transition("rollout", "train", order="naive").peak_bytes == 1100


@st.composite
def memory_plans(draw):
    n = draw(st.integers(1, 4))
    sizes = [draw(st.integers(0, 1000)) for _ in range(n)]
    groups = [StateGroup(f"g{i}", s) for i, s in enumerate(sizes)]
    residency = {
        g.name: {
            "a": draw(st.sampled_from(("device", "host", "none"))),
            "b": draw(st.sampled_from(("device", "host", "none"))),
        }
        for g in groups
    }
    if draw(st.booleans()):
        k = draw(st.integers(1, 3))
        built = [draw(st.integers(0, 300)) for _ in range(k)]
        src_size = sizes[0]
        consumed = [src_size // k] * (k - 1) + [src_size - src_size // k * (k - 1)]
        chunks = tuple((b, draw(st.integers(0, 50)), c) for b, c in zip(built, consumed))
        groups.append(StateGroup("built", sum(built), source="g0", chunks=chunks))
        residency["g0"]["a"] = "device"
        residency["built"] = {"a": "none", "b": "device"}
    return MemoryPlan(tuple(groups), residency)


@settings(max_examples=60)
@given(memory_plans())
def test_swap_order_is_never_worse_than_any_whole_group_order(plan):
    for src, dst in (("a", "b"), ("b", "a")):
        try:
            swap = plan.transition(src, dst)
        except ValueError:
            continue
        naive = plan.transition(src, dst, order="naive")
        assert swap.steps[-1].device_bytes == plan.resident_bytes(dst) if swap.steps else True
        assert swap.end_bytes == plan.resident_bytes(dst)
        assert swap.peak_bytes <= transition_peak_ref(plan, src, dst) <= naive.peak_bytes
        assert swap.peak_bytes >= max(plan.resident_bytes(src), plan.resident_bytes(dst))
        if all(g.source is None for g in plan.groups):
            assert swap.peak_bytes == transition_peak_ref(plan, src, dst)


def test_colocated_plan_counts_the_rank_bytes():
    meta = param_meta(tiny_decoder())
    rplan = plan_reshard(meta, decoder_layout(meta, tp=2, dp=2), decoder_layout(meta, dp=4), bucket_bytes=16 << 10)
    plan = colocated_plan(rplan, rank=1, kv_cache_bytes=1000)
    params = sum(t.numel() * t.element_size() for t in meta.values())
    sharded = sum(
        local_shard_ref(torch.zeros(t.shape, dtype=t.dtype), rplan.src, n, 1).numel() * t.element_size()
        for n, t in meta.items()
    )
    assert plan.group("params").nbytes == plan.group("grads").nbytes == sharded
    assert plan.group("optimizer").nbytes == 2 * sharded
    assert plan.group("inference_weights").nbytes == params
    assert plan.resident_bytes("rollout") == params + 1000
    swap = plan.transition("train", "rollout")
    assert swap.redundancy_bytes <= rplan.bucket_bytes
    assert plan.transition("train", "rollout", order="naive").redundancy_bytes > rplan.bucket_bytes


def test_plan_validation_names_what_is_wrong():
    g = (StateGroup("p", 1), StateGroup("w", 1, source="p"))
    with pytest.raises(
        ValueError, match=r"residency\['p'\]\['train'\]: got 'gpu', expected one of 'device', 'host', 'none'"
    ):
        MemoryPlan(g, {"p": {"train": "gpu"}, "w": {"train": "none"}})
    with pytest.raises(ValueError, match=r"residency: got groups \['p'\], expected \['p', 'w'\]"):
        MemoryPlan(g, {"p": {"train": "device"}})
    plan = MemoryPlan(g, {"p": {"a": "host", "b": "host"}, "w": {"a": "none", "b": "device"}})
    with pytest.raises(ValueError, match="w: built from 'p', which is 'host' in phase 'a', expected it on the device"):
        plan.transition("a", "b")
    with pytest.raises(ValueError, match="order: got 'fast', expected one of 'swap', 'naive'"):
        plan.transition("b", "a", order="fast")
    with pytest.raises(ValueError, match="w: chunks build 5 bytes, expected nbytes=1"):
        StateGroup("w", 1, source="p", chunks=((5, 0, 1),))


def _one_rank_plan(memory=None):
    w = {"lm_head.weight": torch.ones(4, 2)}
    lay = decoder_layout(w)
    plan = allgather_swap_plan(plan_reshard(w, lay, lay), mesh=None, device="cpu", rank=0)
    return plan if memory is None else AllGatherSwapPlan(plan.reshard, memory, None, plan.device)


def test_enter_rollout_rejects_bad_params_before_moving_anything():
    optimizer = [torch.ones(3)]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(
            ValueError, match=r"params\['lm_head.weight'\]: got shape \(2, 4\) torch.float32, expected \(4, 2\)"
        ):
            enter_rollout(TrainState({"lm_head.weight": torch.ones(2, 4)}, optimizer=optimizer), _one_rank_plan())
    finally:
        dist.destroy_process_group()
    assert optimizer[0].untyped_storage().nbytes() == 12


def test_enter_rollout_rejects_steps_it_cannot_run():
    base = _one_rank_plan().memory
    residency = {k: dict(v) for k, v in base.residency.items()}
    residency["grads"]["rollout"] = "none"
    grads = [torch.ones(2)]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(
            ValueError, match="plan: got step 'free' of 'grads' in train -> rollout, expected only: offload of"
        ):
            enter_rollout(
                TrainState({"lm_head.weight": torch.ones(4, 2)}, grads=grads),
                _one_rank_plan(MemoryPlan(base.groups, residency)),
            )
    finally:
        dist.destroy_process_group()
    assert grads[0].untyped_storage().nbytes() == 8


# --------------------------------------------------------------------------- AllGather-Swap on gloo


def _snapshot(params, opt):
    return (
        {n: p.detach().clone() for n, p in params.items()},
        {n: p.grad.clone() for n, p in params.items()},
        {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()},
    )


def _train(rank, src, dst, rplan, mesh, steps, switch):
    full = tiny_decoder()
    params = {n: torch.nn.Parameter(local_shard_ref(t, src, n, rank)) for n, t in full.items() if src.holds(n, rank)}
    opt = torch.optim.AdamW(params.values(), lr=1e-2, foreach=False)
    plan = allgather_swap_plan(rplan, mesh=mesh, device="cpu", rank=rank)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _step in range(steps):
        targets = {n: torch.randn(t.shape, generator=g).to(t.dtype) for n, t in full.items()}
        opt.zero_grad(set_to_none=False)
        local = sum(
            ((p.float() - local_shard_ref(targets[n], src, n, rank).float()) ** 2).sum() for n, p in params.items()
        )
        local.backward()
        opt.step()
        loss = local.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss)
        if not switch:
            continue
        params_before, grads_before, opt_before = _snapshot(params, opt)
        state = TrainState(params, grads=[p.grad for p in params.values()], optimizer=list(opt.state.values()))
        rollout = enter_rollout(state, plan)
        assert all(p.untyped_storage().nbytes() == 0 for p in params.values())
        assert all(v.untyped_storage().nbytes() == 0 for s in opt.state.values() for v in s.values())
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, params_before)
        for n, t in full.items():
            whole = unshard_ref({r: shards[n] for r, shards in enumerate(gathered) if n in shards}, src, n, t.shape)
            assert torch.equal(rollout.weights[n], local_shard_ref(whole, dst, n, rank)), n
        back = enter_train(rollout, plan)
        assert back is state and back.params is params
        params_after, grads_after, opt_after = _snapshot(params, opt)
        for n in params:
            assert torch.equal(params_after[n], params_before[n]) and torch.equal(grads_after[n], grads_before[n])
            for k in opt_before[n]:
                assert torch.equal(opt_after[n][k], opt_before[n][k])
    return torch.stack(losses), {n: p.detach().clone() for n, p in params.items()}


def check_allgather_swap_training(rank, src_kw, dst_kw):
    meta = param_meta(tiny_decoder())
    src, dst = decoder_layout(meta, **src_kw), decoder_layout(meta, **dst_kw)
    rplan = plan_reshard(meta, src, dst, bucket_bytes=16 << 10)
    mesh = src.device_mesh("cpu")
    la, pa = _train(rank, src, dst, rplan, mesh, 3, switch=False)
    lb, pb = _train(rank, src, dst, rplan, mesh, 3, switch=True)
    assert torch.equal(la, lb), (la, lb)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


SWAP_CASES = {
    "tp2dp2_to_tp1": (dict(tp=2, dp=2), dict(dp=4)),
    "pp2tp2_to_tp2dp2": (dict(pp=2, tp=2), dict(tp=2, dp=2)),
    "ep2dp2_to_ep4": (dict(ep=2, dp=2), dict(ep=4)),
}


@pytest.fixture(scope="module")
def swap_group(tmp_path_factory):
    return shared_group(4, tmp_path_factory)


@pytest.mark.parametrize("case", sorted(SWAP_CASES))
def test_layout_switch_every_step_keeps_loss_trajectory_and_state(swap_group, case):
    assert_ok(swap_group, f"swap:{case}")


# --------------------------------------------------------------------------- predicted vs measured


@pytest.mark.skipif(rdevice.device_kind() == "cpu", reason="needs an accelerator: the CPU does not track memory")
def test_predicted_peak_matches_measured_peak(tmp_path):
    dev = rdevice.get_device()
    meta = param_meta(tiny_decoder(layers=4, hidden=256, vocab=4096))
    lay = decoder_layout(meta)
    rplan = plan_reshard(meta, lay, lay, bucket_bytes=8 << 20)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = lay.device_mesh("cpu")
        full = tiny_decoder(layers=4, hidden=256, vocab=4096)
        params = {n: torch.nn.Parameter(t.to(dev)) for n, t in full.items()}
        opt = torch.optim.AdamW(params.values())
        sum((p.float() ** 2).sum() for p in params.values()).backward()
        opt.step()
        plan = allgather_swap_plan(rplan, mesh=mesh, device=dev, rank=0)
        for name, t in (
            ("params", params.values()),
            ("grads", [p.grad for p in params.values()]),
            ("optimizer", [v for s in opt.state.values() for v in s.values() if v.device == dev]),
        ):
            assert plan.memory.group(name).nbytes == sum(x.numel() * x.element_size() for x in t), name
        rdevice.synchronize(dev)
        base = rdevice.memory_stats(dev).allocated - plan.memory.resident_bytes("train")
        rdevice.reset_peak_memory_stats(dev)
        rollout = enter_rollout(TrainState(params, [p.grad for p in params.values()], list(opt.state.values())), plan)
        rdevice.synchronize(dev)
        stats = rdevice.memory_stats(dev)
        predicted = plan.memory.transition("train", "rollout").peak_bytes
        # The allocator rounds each block up to 512 bytes: allow that per tensor.
        slack = 512 * (3 * len(params) + len(rplan.buckets) + 8)
        assert abs(stats.allocated - base - plan.memory.resident_bytes("rollout")) <= slack
        assert abs(stats.peak_allocated - base - predicted) <= slack, (stats.peak_allocated - base, predicted)
        enter_train(rollout, plan)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad", [None, {"params": 1}, 3])
def test_reprobe_colocated_plan_names_a_reshard_plan_of_another_type(bad):
    # An AttributeError ("'NoneType' object has no attribute 'src_bytes'").
    with pytest.raises(ValueError, match="reshard_plan: got .*, expected a ReshardPlan"):
        colocated_plan(bad)
