"""The pipeline scheduler: exactly-once processing, the staleness bound, blocking = the synchronous loop, faults."""

import dataclasses
import threading
import time

import pytest
import torch
from hypothesis import given, settings

from rlcore.dataflow import HandBack, SchedulerCore, StageGraph, StageTimeout, run_pipeline, stage
from rlcore.testing.pipeline_strategies import pipeline_specs, spec_stages
from rlcore.testing.reference import synchronous_loop_ref


def _loader(spec):
    cap = spec["num_prompts"] * spec["n_samples"]
    return lambda j: {"prompts": torch.arange(cap, dtype=torch.int64) // spec["n_samples"] + 7 * j}


def _run(spec, **kw):
    graph = StageGraph(spec_stages(spec))
    columns = [s["output"] for s in spec["stages"]]
    kw.setdefault("staleness", spec["staleness"])
    res = run_pipeline(
        graph,
        _loader(spec),
        num_prompts=spec["num_prompts"],
        n_samples=spec["n_samples"],
        num_iterations=spec["num_iterations"],
        collect=columns,
        **kw,
    )
    return graph, res


def _ref(spec):
    graph = StageGraph(spec_stages(spec, sleep=False))
    return synchronous_loop_ref(
        graph,
        _loader(spec),
        num_prompts=spec["num_prompts"],
        n_samples=spec["n_samples"],
        num_iterations=spec["num_iterations"],
    )


def _rows_of(batch, column):
    """Per-row tensors of a collected (padded) column."""
    x = batch[column]
    mask = batch.get(f"{column}_mask")
    return list(x.unbind(0)) if mask is None else [r[m] for r, m in zip(x, mask)]


def _assert_same(batches, ref, columns):
    assert len(batches) == len(ref)
    for j, (batch, table) in enumerate(zip(batches, ref)):
        for c in [*columns, "policy_version"]:
            got, want = _rows_of(batch, c), table[c]
            assert len(got) == len(want)
            for i, (g, w) in enumerate(zip(got, want)):
                torch.testing.assert_close(g, w.to(g.dtype), rtol=0, atol=0, msg=f"iteration {j} column {c} row {i}")


def _no_worker_threads(deadline=5.0):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if not [t for t in threading.enumerate() if t.name.startswith("rlcore-pipeline-")]:
            return True
        time.sleep(0.01)
    return False


@settings(max_examples=20)
@given(pipeline_specs())
def test_every_row_once_per_stage_and_staleness_bound(spec):
    graph, res = _run(spec, blocking=False)
    cap = spec["num_prompts"] * spec["n_samples"]
    for j in range(spec["num_iterations"]):
        for name in graph.names:
            rows = torch.cat([t.rows for t in res.tasks if t.stage == name and t.iteration == j])
            assert sorted(rows.tolist()) == list(range(cap)), (name, j)
        version = res.batches[j]["policy_version"]
        lag = j - version
        assert bool(((lag >= 0) & (lag <= spec["staleness"])).all()), (j, version.tolist())
    for t in res.tasks:
        if t.stage == "s0":
            assert 0 <= t.iteration - t.version <= spec["staleness"]
            # the version a row records is the one its rollout call ran with
            assert bool((res.batches[t.iteration]["policy_version"][t.rows] == t.version).all())
        if graph.stages[t.stage].micro_batch is not None:
            assert t.rows.numel() <= graph.stages[t.stage].micro_batch


@settings(max_examples=20)
@given(pipeline_specs(max_staleness=0))
def test_blocking_is_the_synchronous_loop(spec):
    _, res = _run(spec, blocking=True)
    _assert_same(res.batches, _ref(spec), [s["output"] for s in spec["stages"]])


@settings(max_examples=15)
@given(pipeline_specs(max_staleness=0))
def test_nonblocking_on_policy_gives_the_synchronous_values_of_order_free_stages(spec):
    _, res = _run(spec, blocking=False)
    _assert_same(res.batches, _ref(spec), [s["output"] for s in spec["stages"] if s["role"] != "update"])


def _two_stage(delay_roll, delay_upd, *, resources=("gen", "train"), timeout=None):
    def rollout(b):
        time.sleep(delay_roll)
        return {"responses": b["prompts"].double() + b["policy_version"]}

    def update(b):
        time.sleep(delay_upd)
        return {"loss": b["responses"] * 2}

    return StageGraph(
        [
            stage(
                rollout, inputs=["prompts"], outputs=["responses"], role="rollout", micro_batch=2, resource=resources[0]
            ),
            stage(
                update,
                inputs=["responses"],
                outputs=["loss"],
                role="update",
                micro_batch=2,
                resource=resources[1],
                timeout=timeout,
            ),
        ]
    )


@pytest.mark.parametrize("staleness", [0, 1])
def test_rollout_overlaps_the_update_only_under_staleness(staleness):
    # the update is 10x slower than the rollout, so scheduling jitter cannot hide the overlap
    res = run_pipeline(
        _two_stage(0.005, 0.05),
        lambda j: {"prompts": torch.arange(4)},
        num_prompts=4,
        num_iterations=3,
        staleness=staleness,
    )
    start = {j: min(t.start for t in res.tasks if t.stage == "rollout" and t.iteration == j) for j in range(3)}
    end = {j: max(t.end for t in res.tasks if t.stage == "update" and t.iteration == j) for j in range(3)}
    if staleness == 0:
        assert all(start[j] >= end[j - 1] for j in (1, 2))
    else:
        # iteration 1's rollout never waits for update 0; iteration 2's waits for it
        assert start[1] < end[0]
        assert start[2] >= end[0]


def test_colocated_resource_switches_phase_once_per_direction_per_iteration():
    calls = []
    graph = StageGraph(
        [
            stage(
                lambda b: {"responses": b["prompts"] * 1.0},
                inputs=["prompts"],
                outputs=["responses"],
                name="rollout",
                role="rollout",
                micro_batch=1,
            ),
            stage(
                lambda b: {"scores": b["responses"] + 1},
                inputs=["responses"],
                outputs=["scores"],
                name="reward",
                micro_batch=1,
            ),
            stage(
                lambda b: {"old_logp": b["responses"] - 1},
                inputs=["responses"],
                outputs=["old_logp"],
                name="old",
                micro_batch=1,
                phase="train",
            ),
            stage(
                lambda b: {"loss": b["scores"] * b["old_logp"]},
                inputs=["scores", "old_logp"],
                outputs=["loss"],
                name="update",
                role="update",
                micro_batch=1,
            ),
        ]
    )
    res = run_pipeline(
        graph,
        lambda j: {"prompts": torch.arange(4)},
        num_prompts=4,
        num_iterations=3,
        switch=lambda r, a, b: calls.append((r, a, b)),
    )
    assert res.switches == [("device", "rollout", "train"), ("device", "train", "rollout")] * 2 + [
        ("device", "rollout", "train")
    ]
    assert calls == [("device", None, "rollout"), *res.switches]
    # a micro-batch-by-micro-batch interleaving would switch on every row: 2 * 4 per iteration
    assert len(res.switches) == 2 * 3 - 1


def test_a_raising_stage_stops_the_pipeline_with_its_error_and_no_threads_left():
    def reward(b):
        if int(b["responses"].sum()) > 4:
            raise ZeroDivisionError("bad reward")
        return {"scores": b["responses"]}

    graph = StageGraph(
        [
            stage(
                lambda b: {"responses": b["prompts"] * 1.0},
                inputs=["prompts"],
                outputs=["responses"],
                name="rollout",
                role="rollout",
                micro_batch=1,
                resource="gen",
            ),
            stage(reward, inputs=["responses"], outputs=["scores"], micro_batch=1, resource="cpu"),
            stage(
                lambda b: {"loss": b["scores"]},
                inputs=["scores"],
                outputs=["loss"],
                name="update",
                role="update",
                resource="train",
            ),
        ]
    )
    with pytest.raises(ZeroDivisionError, match="bad reward") as info:
        run_pipeline(graph, lambda j: {"prompts": torch.arange(8)}, num_prompts=8, num_iterations=2)
    assert any("in stage 'reward' at iteration 0" in n for n in info.value.__notes__)
    assert _no_worker_threads()


def test_a_stage_timeout_is_reported_with_its_name():
    graph = _two_stage(0.0, 0.3, timeout=0.05)
    t0 = time.monotonic()
    with pytest.raises(StageTimeout, match="stage 'update' timed out after 0.05 s at iteration 0") as info:
        run_pipeline(graph, lambda j: {"prompts": torch.arange(4)}, num_prompts=4, num_iterations=2)
    assert info.value.stage == "update"
    assert time.monotonic() - t0 < 0.3 + 10  # returned without waiting for the pipeline to finish
    assert _no_worker_threads()


def test_output_and_loader_errors_name_the_culprit():
    bad = StageGraph([stage(lambda b: {"wrong": b["prompts"]}, inputs=["prompts"], outputs=["x"], name="roll")])
    with pytest.raises(
        ValueError, match=r"stage 'roll': returned \['wrong'\], expected a dict with its outputs \['x'\]"
    ):
        run_pipeline(bad, lambda j: {"prompts": torch.arange(2)}, num_prompts=2)
    short = StageGraph([stage(lambda b: {"x": b["prompts"][:1]}, inputs=["prompts"], outputs=["x"], name="roll")])
    with pytest.raises(ValueError, match="got 1 rows, expected 2") as info:
        run_pipeline(short, lambda j: {"prompts": torch.arange(2)}, num_prompts=2)
    assert any("output of stage 'roll'" in n for n in info.value.__notes__)
    ok = StageGraph([stage(lambda b: {"x": b["prompts"]}, inputs=["prompts"], outputs=["x"], name="roll")])
    with pytest.raises(
        ValueError, match=r"loader\(0\): got \['ids'\], expected a dict with the source columns \['prompts'\]"
    ):
        run_pipeline(ok, lambda j: {"ids": torch.arange(2)}, num_prompts=2)
    with pytest.raises(ValueError, match="staleness: got -1"):
        run_pipeline(ok, lambda j: {"prompts": torch.arange(2)}, num_prompts=2, staleness=-1)
    with pytest.raises(ValueError, match=r"slots: got resource\(s\) \['gpu'\] no stage runs on"):
        run_pipeline(ok, lambda j: {"prompts": torch.arange(2)}, num_prompts=2, slots={"gpu": 2})
    with pytest.raises(ValueError, match=r"slots\['device'\]: got 0"):
        run_pipeline(ok, lambda j: {"prompts": torch.arange(2)}, num_prompts=2, slots={"device": 0})
    with pytest.raises(ValueError, match="collect: got unknown column"):
        run_pipeline(ok, lambda j: {"prompts": torch.arange(2)}, num_prompts=2, collect=["y"])
    group = StageGraph(
        [
            stage(
                lambda b: {"x": b["prompts"]},
                inputs=["prompts"],
                outputs=["x"],
                name="adv",
                by_group=True,
                micro_batch=3,
            )
        ]
    )
    with pytest.raises(
        ValueError, match="stage 'adv': micro_batch 3 with by_group, expected a multiple of n_samples=2"
    ):
        run_pipeline(group, lambda j: {"prompts": torch.arange(4)}, num_prompts=2, n_samples=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_columns_keep_their_dtype_through_the_pipeline(dtype):
    graph = StageGraph(
        [
            stage(
                lambda b: {"logp": [torch.full((i % 3 + 1,), -0.5 * i, dtype=dtype) for i in b["prompts"].tolist()]},
                inputs=["prompts"],
                outputs=["logp"],
                name="rollout",
                role="rollout",
                micro_batch=2,
            ),
            stage(
                lambda b: {"seq": (b["logp"] * b["logp_mask"]).sum(1)},
                inputs=["logp"],
                outputs=["seq"],
                name="sum",
                micro_batch=3,
            ),
        ]
    )
    res = run_pipeline(graph, lambda j: {"prompts": torch.arange(5)}, num_prompts=5, collect=["logp", "seq"])
    batch = res.batches[0]
    assert batch["logp"].dtype == batch["seq"].dtype == dtype
    want = torch.tensor([-0.5 * i * (i % 3 + 1) for i in range(5)], dtype=torch.float64)
    torch.testing.assert_close(batch["seq"].double(), want, rtol=0, atol=0)


def test_a_stall_is_an_error_not_a_hang(monkeypatch):
    from rlcore.dataflow import scheduler

    monkeypatch.setattr(scheduler.SchedulerCore, "pick", lambda self, resource: None)
    with pytest.raises(
        RuntimeError,
        match=r"pipeline stalled: no stage can take rows and none is running; stages with rows left: \['rollout@0', 'update@0'\]",
    ):
        run_pipeline(_two_stage(0.0, 0.0), lambda j: {"prompts": torch.arange(4)}, num_prompts=4)
    assert _no_worker_threads()


def test_the_next_iterations_prompts_are_loaded_while_the_current_one_runs():
    """Prefetch: loader(j + 1) runs during iteration j, once per iteration, in order; its error surfaces at j + 1."""
    calls, seen_at_update, threads = [], [], set()

    def loader(j):
        calls.append(j)
        if j:  # iteration 0 is loaded where the pipeline starts; the rest on its loader thread
            threads.add(threading.get_ident())
        return {"prompts": torch.arange(4) + j}

    def update(b):
        time.sleep(0.05)  # the prefetch thread has long finished by the end of this call
        seen_at_update.append(list(calls))
        return {"loss": b["responses"]}

    graph = StageGraph(
        [
            stage(
                lambda b: {"responses": b["prompts"] * 1.0},
                inputs=["prompts"],
                outputs=["responses"],
                name="rollout",
                role="rollout",
            ),
            stage(update, inputs=["responses"], outputs=["loss"], name="update", role="update"),
        ]
    )
    res = run_pipeline(graph, loader, num_prompts=4, num_iterations=3, blocking=True, collect=["loss"])
    assert calls == [0, 1, 2] and seen_at_update == [[0, 1], [0, 1, 2], [0, 1, 2]]
    assert len(threads) == 1 and threading.get_ident() not in threads  # one loader thread for every prefetch
    assert [b["loss"].tolist() for b in res.batches] == [[float(i + j) for i in range(4)] for j in range(3)]
    assert _no_worker_threads()

    def failing(j):
        if j == 1:
            raise KeyError("no prompts for iteration 1")
        return {"prompts": torch.arange(4)}

    with pytest.raises(KeyError, match="no prompts for iteration 1"):
        run_pipeline(graph, failing, num_prompts=4, num_iterations=3, blocking=True)
    assert _no_worker_threads()


def test_the_prefetch_starts_beside_the_update_call_not_at_admission_nor_beside_the_rollout():
    """The loader (Python, competing for the GIL) is handed the next iteration when the update's call starts."""
    calls = []
    graph = StageGraph(
        [
            stage(
                lambda b: {"responses": b["prompts"] * 1.0},
                inputs=["prompts"],
                outputs=["responses"],
                name="rollout",
                role="rollout",
            ),
            stage(
                lambda b: {"loss": b["responses"]}, inputs=["responses"], outputs=["loss"], name="update", role="update"
            ),
        ]
    )
    core = SchedulerCore(
        graph,
        lambda j: calls.append(j) or {"prompts": torch.arange(4) + j},
        num_prompts=4,
        n_samples=1,
        num_iterations=3,
        staleness=0,
        blocking=True,
        slots=None,
        collect=["loss"],
        prefetch=True,
    )
    try:
        time.sleep(0.2)  # a prefetch started at admission would have run by now
        assert calls == [0]
        task = core.pick("device")
        assert task is not None and task.stage.name == "rollout"
        core.started(task.stage.name)
        time.sleep(0.2)  # a prefetch started beside the rollout would have run by now
        assert calls == [0]
        core.release(task, 0.0, core.complete(task, task.stage.fn(task.batch)))
        task = core.pick("device")
        assert task is not None and task.stage.name == "update"
        core.started(task.stage.name)
        deadline = time.monotonic() + 30
        while calls != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls == [0, 1]
    finally:
        core.close(30)


def _losing_every(k, graph):
    """``graph`` with every stage's calls numbered per stage: the first and each k-th after it lose their work (HandBack)."""
    lock, calls, lost = threading.Lock(), {}, []

    def losing(s):
        def fn(batch):
            with lock:
                calls[s.name] = n = calls.get(s.name, 0) + 1
            if n % k == 1:
                lost.append(s.name)
                raise HandBack(s.name, "its worker died")
            return s.fn(batch)

        return dataclasses.replace(s, fn=fn)

    return StageGraph([losing(s) for s in graph.order]), lost


@settings(max_examples=15)
@given(pipeline_specs(max_staleness=0))
def test_rows_handed_back_are_redone_once_blocking_equals_the_synchronous_loop(spec):
    graph, lost = _losing_every(3, StageGraph(spec_stages(spec)))
    res = run_pipeline(
        graph,
        _loader(spec),
        num_prompts=spec["num_prompts"],
        n_samples=spec["n_samples"],
        num_iterations=spec["num_iterations"],
        collect=[s["output"] for s in spec["stages"]],
        blocking=True,
    )
    _assert_same(res.batches, _ref(spec), [s["output"] for s in spec["stages"]])
    for name in graph.names:  # calls 1, 4, 7, ... of each stage lost, and redone by the next
        calls = sum(t.stage == name for t in res.tasks) + lost.count(name)
        assert lost.count(name) == (calls + 2) // 3, name


@settings(max_examples=15)
@given(pipeline_specs())
def test_rows_handed_back_are_processed_exactly_once_under_staleness(spec):
    graph, lost = _losing_every(2, StageGraph(spec_stages(spec)))
    res = run_pipeline(
        graph,
        _loader(spec),
        num_prompts=spec["num_prompts"],
        n_samples=spec["n_samples"],
        num_iterations=spec["num_iterations"],
        staleness=spec["staleness"],
        collect=[s["output"] for s in spec["stages"]],
    )
    cap = spec["num_prompts"] * spec["n_samples"]
    for j in range(spec["num_iterations"]):
        for name in graph.names:
            rows = torch.cat([t.rows for t in res.tasks if t.stage == name and t.iteration == j])
            assert sorted(rows.tolist()) == list(range(cap)), (name, j)
    assert lost and _no_worker_threads()
