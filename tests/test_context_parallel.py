"""Context parallelism: ring and Ulysses attention, sharded log-probs and aggregation on real gloo groups.

One spawned group of 4 CPU processes runs every distributed check: the whole world
as a cp=4 group, two cp=2 groups side by side, and a dp=2 x cp=2 mesh. The
hypothesis examples are drawn here, in the parent, and shipped to the ranks, so
every rank runs the same examples.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.dataflow import Layout, infer_dp, pack_to_budget
from rlcore.models import plan_sequence_shards

WORLD = 4
VOCAB = 53
TINY = {
    "model_type": "qwen2",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}


# ---------------------------------------------------------------- the plan (host only)


@st.composite
def crossing_lengths(draw, cp):  # type: ignore[no-untyped-def]
    """Three uneven sequences; the middle one starts in the first chunk and ends in the last."""
    chunk = draw(st.integers(2, 5))
    first = draw(st.integers(1, chunk - 1))
    last = draw(st.integers(1, chunk - 1))
    pad = draw(st.integers(0, chunk - 1 - last))
    middle = 2 * cp * chunk - first - last - pad
    return [first, middle, last]


def _covered(shards_by_rank):  # type: ignore[no-untyped-def]
    """(query position, key position) pairs the tasks of all ranks attend, with multiplicity."""
    seen: dict[tuple[int, int], int] = {}
    for sh in shards_by_rank:
        for src in range(sh.world):
            q_pos, k_pos = sh.positions_of(sh.rank), sh.positions_of(src)
            for q_lo, q_hi, k_lo, k_hi, causal in sh.tasks(src):
                for i in range(q_lo, q_hi):
                    for j in range(k_lo, k_hi):
                        if not causal or j - k_lo <= i - q_lo:
                            key = (q_pos[i], k_pos[j])
                            seen[key] = seen.get(key, 0) + 1
    return seen


@settings(max_examples=40)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5).filter(lambda x: sum(x) > 0),
    world=st.sampled_from([1, 2, 3, 4]),
)
def test_plan_tasks_cover_exactly_the_causal_document_mask(lengths, world):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    shards = [plan_sequence_shards(bounds, world=world, rank=r) for r in range(world)]
    sh = shards[0]
    assert sh.padded_len % (2 * world) == 0 and sh.padded_len - sh.num_tokens < 2 * world
    held = sorted(p for s in shards for p in s.positions_of(s.rank))
    assert held == list(range(sh.padded_len))  # a partition of the padded row
    doc = [next(i for i in range(len(sh.bounds) - 1) if sh.bounds[i] <= p < sh.bounds[i + 1]) for p in held]
    want = {(i, j): 1 for i in held for j in held if j <= i and doc[i] == doc[j]}
    assert _covered(shards) == want


def test_plan_balances_causal_work():
    shards = [plan_sequence_shards([0, 64], world=4, rank=r) for r in range(4)]
    work = [sum(_covered([s]).values()) for s in shards]
    assert max(work) == min(work)


def test_zero_length_rows_and_shards_are_refused():
    with pytest.raises(ValueError, match="shard of zero length"):
        plan_sequence_shards([0, 0, 0], world=2, rank=0)
    with pytest.raises(ValueError, match="rank: got 2"):
        plan_sequence_shards([0, 5], world=2, rank=2)


def test_world_size_that_does_not_factor_is_refused():
    assert infer_dp(8, cp=2, tp=2) == 2
    with pytest.raises(ValueError, match=r"world_size: got 6, expected a multiple of .* = 4"):
        infer_dp(6, cp=2, tp=2)
    lay = Layout(placements={}, dp=2, cp=2)
    assert lay.coords(3) == {"pp": 0, "dp": 1, "ep": 0, "cp": 1, "tp": 0}


@settings(max_examples=40)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    max_tokens=st.integers(2, 12),
    cp=st.sampled_from([1, 2, 4]),
)
def test_pack_to_budget_rows_fit_each_cp_rank(lengths, max_tokens, cp):
    cap = max_tokens if cp == 1 else 2 * cp * (max_tokens // 2)
    lengths = [min(x, cap) for x in lengths]
    plan = pack_to_budget(lengths, max_tokens, cp=cp)
    assert sorted(i for row in plan for i in row) == list(range(len(lengths)))
    for row in plan:
        n = sum(lengths[i] for i in row)
        if cp > 1 and n:
            assert plan_sequence_shards([0, n], world=cp, rank=0).local_len <= max_tokens
        else:
            assert n <= max_tokens


# ---------------------------------------------------------------- the distributed checks


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))


def check_matches_single_process(rank, group_spec, examples):  # type: ignore[no-untyped-def]
    """Log-probs, entropies and every parameter's gradient equal the single-process computation."""
    from rlcore.models import from_hf, load_causal_lm, sharded_token_logprobs, token_logprobs

    group = _GROUPS[group_spec]
    model = load_causal_lm(TINY, seed=0)
    apply, params = from_hf(model)
    names = list(params)
    for lengths in examples:
        g = torch.Generator().manual_seed(sum(lengths))
        seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
        w = torch.randn(2, len(lengths), max(lengths), generator=g)
        logp, ent = token_logprobs(apply, params, seqs, with_entropy=True)
        want = torch.autograd.grad((w[0] * logp).sum() + (w[1] * ent).sum(), [params[n] for n in names])
        for mode in ("ring", "ulysses"):
            out = sharded_token_logprobs(apply, params, seqs, group=group, mode=mode, with_entropy=True)
            grads = torch.autograd.grad(
                (w[0] * out.logp).sum() + (w[1] * out.entropy).sum(), [params[n] for n in names]
            )
            summed = torch.stack([out.logp.detach(), out.entropy.detach(), out.mask.double()])
            dist.all_reduce(summed, group=group)
            ctx = f"{mode} lengths={lengths}"
            assert _rel_err(summed[0], logp.detach()) <= 1e-5, ctx
            assert _rel_err(summed[1], ent.detach()) <= 1e-5, ctx
            scored = torch.zeros_like(logp, dtype=torch.bool)
            for b, n in enumerate(lengths):
                scored[b, 1:n] = True
            assert torch.equal(summed[2], scored.double()), f"{ctx}: the masks do not partition the scored tokens"
            for name, got, ref in zip(names, grads, want):
                got = got.clone()
                dist.all_reduce(got, group=group)
                assert _rel_err(got, ref) <= 1e-5, f"{ctx}: gradient of {name}: {_rel_err(got, ref):.2e}"


def check_bad_input(rank, group_spec):  # type: ignore[no-untyped-def]
    from rlcore.dataflow import pack
    from rlcore.models import from_hf, load_causal_lm, ring_attention, sharded_token_logprobs

    group = _GROUPS[group_spec]
    apply, params = from_hf(load_causal_lm({**TINY, "num_key_value_heads": 2}, seed=0))
    seqs = [torch.arange(5), torch.arange(9)]
    with pytest.raises(ValueError, match=r"2 key/value heads, expected both divisible by the context-parallel size 4"):
        sharded_token_logprobs(apply, params, seqs, group=group, mode="ulysses")
    with pytest.raises(ValueError, match=r"world size: got 4 launched processes, expected 6"):
        Layout(placements={}, dp=2, cp=3).device_mesh("cpu")
    shards = plan_sequence_shards([0, 14], world=4, rank=rank)
    empty = torch.zeros(0, 2, 4)
    with pytest.raises(ValueError, match=r"query: got 0 tokens, expected 4"):
        ring_attention(empty, empty, empty, shards, group)
    with pytest.raises(ValueError, match="shard of zero length"):
        sharded_token_logprobs(apply, params, pack([torch.zeros(0, dtype=torch.long)]), group=group)


def check_aggregate_over_cp_and_dp(rank, examples):  # type: ignore[no-untyped-def]
    """Summed over a dp=2 x cp=2 mesh, the sharded aggregate of every mode equals the whole batch's."""
    from rlcore.algos import AGGREGATION_MODES, aggregate, sequence_sharded_aggregate, sequence_sharded_counts

    mesh = _GROUPS["mesh"]
    dp, cp = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    for seed in examples:
        g = torch.Generator().manual_seed(seed)
        loss_t = torch.randn(6, 9, generator=g, dtype=torch.float64)
        mask = torch.rand(6, 9, generator=g) < 0.6
        mask[1] = False  # a sequence with nothing counted
        owner = torch.randint(0, 2, (6, 9), generator=g)  # the cp rank scoring each token
        rows = slice(0, 4) if dp == 0 else slice(4, 6)  # uneven data-parallel shards
        local = mask[rows] & (owner[rows] == cp)
        counts = sequence_sharded_counts(local, cp_group=mesh["cp"], dp_group=mesh["dp"])
        for mode in AGGREGATION_MODES:
            got = sequence_sharded_aggregate(loss_t[rows], local, mode=mode, horizon=9, **counts)
            dist.all_reduce(got)
            want = aggregate(loss_t, mask, mode=mode, horizon=9)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{mode} seed={seed}")


def _metrics_algo():  # type: ignore[no-untyped-def]
    """Every metric kind: means, extremes, clip fractions, the KL / entropy / value terms, per-sequence normalised."""
    from functools import partial

    from rlcore import algos

    return algos.Algorithm(
        advantage_estimator=lambda b: {},
        policy_loss=partial(algos.ppo_clip_loss, clip_high=0.28, dual_clip=3.0),
        kl=partial(algos.kl_penalty, estimator="k3"),
        kl_coef=0.1,
        agg_mode="seq-mean-token-mean",
        entropy_coef=0.01,
        value_loss=algos.value_loss,
    )


def _metrics_batch(seed):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 9

    def rand(scale=1.0):  # type: ignore[no-untyped-def]
        return scale * torch.randn(b, t, generator=g)

    old_logp = -torch.rand(b, t, generator=g) * 3
    batch = {
        "logp": old_logp + rand(0.3),
        "old_logp": old_logp,
        "ref_logp": old_logp + rand(0.2),
        "advantages": rand(),
        "entropy": torch.rand(b, t, generator=g),
        "values": rand(),
        "old_values": rand(),
        "returns": rand(),
    }
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[1] = False  # a sequence with nothing counted
    owner = torch.randint(0, 2, (b, t), generator=g)  # the cp rank scoring each token
    return batch, mask, owner


def _assert_metrics_equal(got, want, ctx):  # type: ignore[no-untyped-def]
    assert sorted(got) == sorted(want), ctx
    for k in want:
        torch.testing.assert_close(got[k], want[k].float(), rtol=1e-5, atol=1e-7, msg=lambda m: f"{ctx} {k}: {m}")


def check_metrics_over_cp_and_dp(rank, examples):  # type: ignore[no-untyped-def]
    """Every metric of the recipe at cp=2, dp=2 and dp=2 x cp=2 equals the single-process metric of the whole batch."""
    from rlcore import algos
    from rlcore.train.context_parallel import ContextParallelRecipe, DataParallelRecipe

    mesh = _GROUPS["mesh"]
    dp, cp = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    algo = _metrics_algo()
    for seed in examples:
        batch, mask, owner = _metrics_batch(seed)
        want_loss, want = algo.loss({**batch, "mask": mask}, **algo.global_counts({"mask": mask}))
        rows = slice(0, 4) if dp == 0 else slice(4, 6)  # uneven data-parallel shards
        # cp = 2: both ranks of a pair hold every row and score their own tokens.
        recipe = ContextParallelRecipe(algo, _GROUPS["cp2"])
        local = {**batch, "mask": mask & (owner == rank % 2)}
        loss, got = recipe.loss(local, **recipe.global_counts(local))
        _assert_metrics_equal(got, want, f"cp=2 seed={seed}")
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-7)
        # dp = 2: uneven rows, every token of them (both cp ranks of the mesh do the same).
        dp_recipe = DataParallelRecipe(algo, mesh["dp"])
        part = {k: v[rows] for k, v in {**batch, "mask": mask}.items()}
        loss, got = dp_recipe.loss(part, **dp_recipe.global_counts(part, process_group=mesh["dp"]))
        _assert_metrics_equal(got, want, f"dp=2 seed={seed}")
        # dp = 2 x cp = 2.
        both = ContextParallelRecipe(algo, mesh["cp"], dp_group=mesh["dp"])
        part = {**part, "mask": mask[rows] & (owner[rows] == cp)}
        loss, got = both.loss(part, **both.global_counts(part, process_group=mesh["dp"]))
        _assert_metrics_equal(got, want, f"dp=2 x cp=2 seed={seed}")
        loss = loss.clone()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-7)
    # DPO at dp = 2: means over each rank's pairs become means over all pairs.
    g = torch.Generator().manual_seed(7)
    pairs = {k: -torch.rand(5, generator=g) * 4 for k in algos.PAIR_LOGP_COLUMNS}
    recipe = algos.dpo(beta=0.5)
    _, want = recipe.loss(pairs, **recipe.global_counts(pairs))
    part = {k: v[:3] if dp == 0 else v[3:] for k, v in pairs.items()}
    dp_recipe = DataParallelRecipe(recipe, mesh["dp"])
    _, got = dp_recipe.loss(part, **dp_recipe.global_counts(part, process_group=mesh["dp"]))
    _assert_metrics_equal(got, want, "dpo dp=2")


_GROUPS: dict = {}


def _make_groups(rank):  # type: ignore[no-untyped-def]
    _GROUPS["cp4"] = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _GROUPS["cp2"] = pairs[rank // 2]
    _GROUPS["mesh"] = Layout(placements={}, dp=2, cp=2).device_mesh("cpu")


def _worker(rank, tmp, checks):  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=90)
    )
    results = {}
    try:
        _make_groups(rank)
        for name, (fn, args) in checks.items():
            try:
                fn(rank, *args)
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
            with open(os.path.join(tmp, f"result_{rank}.json"), "w") as f:
                json.dump(results, f)
            if results[name] != "ok":
                os._exit(0)  # peers may wait in a collective this rank left: their timeout ends them
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _draw(strategy, n):  # type: ignore[no-untyped-def]
    out = []

    @settings(max_examples=n, database=None)
    @given(strategy)
    def collect(x):  # type: ignore[no-untyped-def]
        out.append(x)

    collect()
    return out[:n]


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("cp")
    checks = {
        "cp4": (check_matches_single_process, ("cp4", _draw(crossing_lengths(4), 3))),
        "cp2": (check_matches_single_process, ("cp2", _draw(crossing_lengths(2), 4) + [[1, 13, 3]])),
        "bad": (check_bad_input, ("cp4",)),
        "aggregate": (check_aggregate_over_cp_and_dp, (list(range(4)),)),
        "metrics": (check_metrics_over_cp_and_dp, (list(range(3)),)),
    }
    mp.spawn(_worker, args=(str(tmp), checks), nprocs=WORLD, join=True)
    out = {}
    for r in range(WORLD):
        path = tmp / f"result_{r}.json"
        out[r] = json.loads(path.read_text()) if path.exists() else {}
    return out


@pytest.mark.parametrize("check", ["cp4", "cp2", "bad", "aggregate", "metrics"])
def test_on_four_gloo_ranks(group_results, check):
    for rank, res in group_results.items():
        got = res.get(check, "not run: an earlier check failed on this rank")
        assert got == "ok", f"rank {rank}:\n{got}"


# ---------------------------------------------------------------- ranks that disagree fail fast


def _outcomes(cases, call):
    """Each case's outcome on this rank (``call(case)``, or the error's one line) and its seconds (``<name>_s``)."""
    got = {}
    for name, case in cases.items():
        t0 = datetime.datetime.now()
        try:
            got[name] = call(case)
        except Exception as err:
            got[name] = f"{type(err).__name__}: {err}"
        got[name + "_s"] = (datetime.datetime.now() - t0).total_seconds()
    return got


def _write_outcomes(tmp, name, rank, got):
    with open(os.path.join(tmp, f"{name}_{rank}.json"), "w") as f:
        json.dump(got, f)


def _outcomes_of_two_ranks(worker, tmp_path, name, *, timeout):
    """Run ``worker`` on 2 gloo ranks; each rank's outcomes as it wrote them (:func:`_write_outcomes`)."""
    from dist_helpers import spawn

    spawn(worker, (str(tmp_path),), 2, timeout=timeout)
    return [json.loads((tmp_path / f"{name}_{r}.json").read_text()) for r in range(2)]


def _disagree_ranks(rank, tmp):  # type: ignore[no-untyped-def]
    """Each case must raise the same named error on every rank within the short process-group timeout."""
    from dist_helpers import leave
    from rlcore.models import from_hf, load_causal_lm, sharded_token_logprobs

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=15)
    )
    apply, params = from_hf(load_causal_lm(TINY, seed=0))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 11)]
    oov = [s.clone() for s in seqs]
    oov[1][-1] = VOCAB + 3  # the last token of the long row: on one rank's shard only
    other = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 11)]
    cases = {
        "oov": oov,  # the same batch on both ranks, an id beyond the vocabulary
        "negative": [seqs[0], torch.cat([seqs[1][:-1], torch.tensor([-1])])],
        "lengths": seqs if rank == 0 else [seqs[0][:4], seqs[1]],  # different batches
        "ids": seqs if rank == 0 else other,  # same layout, different tokens
        "rejected": seqs if rank == 0 else [s.float() for s in seqs],  # one rank's own check fails
    }

    def score(batch):
        sharded_token_logprobs(apply, params, batch, group=dist.group.WORLD, mode="ring")
        return "no error"

    got = _outcomes(cases, score)
    # The group still works after every refusal: the ranks left no collective half-done.
    out = sharded_token_logprobs(apply, params, seqs, group=dist.group.WORLD, mode="ring")
    got["after"] = bool(torch.isfinite(out.logp).all())
    _write_outcomes(tmp, "disagree", rank, got)
    leave()


def test_reprobe30_cp_ranks_refuse_bad_or_different_batches_before_the_ring(tmp_path):
    got = _outcomes_of_two_ranks(_disagree_ranks, tmp_path, "disagree", timeout=150)
    for rank, res in enumerate(got):
        assert res["oov"].startswith("ValueError: input_ids: got token ids in [")
        assert f"expected ids in [0, {VOCAB})" in res["oov"], res["oov"]
        assert res["negative"].startswith("ValueError: input_ids: got token ids in [-1,"), res["negative"]
        for case in ("lengths", "ids"):
            assert res[case].startswith("ValueError: batch: the context-parallel ranks hold different batches"), (
                rank,
                case,
                res[case],
            )
        for case in ("oov", "negative", "lengths", "ids", "rejected"):
            assert res[case + "_s"] < 10, (rank, case, res[case + "_s"])  # not the 15 s process-group timeout
        assert res["after"]
    assert got[1]["rejected"].startswith("ValueError: batch[0]: got dtype torch.float32"), got[1]["rejected"]
    assert got[0]["rejected"].startswith("ValueError: batch: rank(s) [1] of the context-parallel group rejected")


@pytest.mark.parametrize("fn", ["ring_attention", "ulysses_attention"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.5, True, "0.5"])
def test_reprobe30_attention_refuses_a_bad_scale(fn, scale):
    import rlcore.models as models

    shards = plan_sequence_shards([0, 4], world=1, rank=0)
    q = torch.zeros(4, 2, 4)
    with pytest.raises(ValueError, match=r"scale: got .*, expected a number"):
        getattr(models, fn)(q, q, q, shards, None, scale=scale)


@pytest.mark.parametrize("seq_tokens", [[-2, 3], [float("nan"), 3], [1, 3]])
def test_reprobe30_sharded_aggregate_refuses_sequence_counts_below_the_local_ones(seq_tokens):
    # Each gave a number: a negative or NaN count was replaced by 1, a too small one over-weighted the sequence.
    from rlcore.algos import sequence_sharded_aggregate

    loss_t, mask = torch.tensor([[1.0, 2.0, 0.0], [1.0, 1.0, 1.0]]), torch.tensor([[1, 1, 0], [0, 1, 1]])
    with pytest.raises(ValueError, match=r"seq_tokens: got .* for sequence 0, which holds 2.0 counted tokens"):
        sequence_sharded_aggregate(
            loss_t, mask, seq_tokens=torch.tensor(seq_tokens), mode="seq-mean-token-mean", num_tokens=5, num_seqs=2
        )
    got = sequence_sharded_aggregate(
        loss_t, mask, seq_tokens=torch.tensor([2, 3]), mode="seq-mean-token-mean", num_tokens=5, num_seqs=2
    )
    torch.testing.assert_close(got, torch.tensor((3.0 / 2 + 2.0 / 3) / 2))


@pytest.mark.parametrize("bad", [4.5, True, "4"])
def test_reprobe30_plan_refuses_boundaries_that_are_not_ints(bad):
    # 4.5 was truncated to 4 silently.
    with pytest.raises(ValueError, match=r"cu_seqlens: got .* among the boundaries, expected ints"):
        plan_sequence_shards([0, 2, bad], world=2, rank=0)


def _disagree_metrics(rank, tmp):  # type: ignore[no-untyped-def]
    """Each case must raise a named ValueError on every rank, well within the short process-group timeout."""
    from dist_helpers import leave
    from rlcore.algos import reduce_metrics

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=15)
    )
    one = torch.tensor(1.0 + rank)
    cases = {
        "extra": ({"a": one, "b": one} if rank else {"a": one}, 1, None),
        "empty": ({"a": one} if rank == 0 else {}, 1, None),
        "renamed": ({"a" if rank == 0 else "b": one}, 1, None),
        "reduction": ({"a": one}, 1, {"a": "max"} if rank else None),
        "weight": ({"a": one}, 2 if rank == 0 else -1, None),
        "shape": ({"a": one if rank == 0 else torch.ones(3)}, 1, None),
    }
    got = _outcomes(
        cases,
        lambda case: repr(reduce_metrics(case[0], case[1], process_groups=[dist.group.WORLD], reductions=case[2])),
    )
    # The group still works after every refusal, and agreeing ranks get the weighted mean.
    got["after"] = float(reduce_metrics({"a": one}, 1 + rank, process_groups=[dist.group.WORLD])["a"])
    _write_outcomes(tmp, "metrics", rank, got)
    leave()


def test_reprobe30_reduce_metrics_ranks_with_other_names_or_bad_inputs_raise_on_every_rank(tmp_path):
    # Different names aborted inside gloo on one rank and mixed unrelated metrics on the other; a rank
    # without metrics, or whose own check failed, returned or raised alone and left its peer waiting.
    got = _outcomes_of_two_ranks(_disagree_metrics, tmp_path, "metrics", timeout=120)
    for rank, res in enumerate(got):
        for case in ("extra", "empty", "renamed", "reduction"):
            assert res[case].startswith("ValueError: metrics: got names and reductions"), (rank, case, res[case])
            assert "another rank holds others" in res[case]
        for case in ("extra", "empty", "renamed", "reduction", "weight", "shape"):
            assert res[case + "_s"] < 10, (rank, case, res[case + "_s"])  # not the 15 s process-group timeout
        assert res["after"] == pytest.approx((1 * 1 + 2 * 2) / 3)
    assert got[1]["weight"].startswith("ValueError: weight: got -1"), got[1]["weight"]
    assert got[0]["weight"].startswith("ValueError: metrics: another rank rejected its metrics or weight")
    assert got[1]["shape"].startswith("ValueError: metrics['a']: got shape (3,)"), got[1]["shape"]
    assert got[0]["shape"].startswith("ValueError: metrics: another rank rejected"), got[0]["shape"]
