"""Simulation mode: the scheduler's rules on a virtual clock, against hand numbers and the critical-path bound."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.dataflow import StageGraph, critical_path_bound, fit_costs, run_pipeline, simulate, stage
from rlcore.testing.pipeline_strategies import pipeline_specs, spec_stages, stage_costs


def _s(name, inputs, outputs, **kw):
    return stage(print, inputs=inputs, outputs=outputs, name=name, **kw)


def _seven(mb, *, by_group=False, shared=False):
    """Rollout, four scorers, advantages, update: the seven models of an RL iteration."""
    res = (lambda i: "device") if shared else (lambda i: f"r{i}")
    return StageGraph(
        [
            _s("rollout", ["prompts"], ["responses"], role="rollout", micro_batch=mb, resource=res(0)),
            _s("reward", ["responses"], ["scores"], micro_batch=mb, resource=res(1)),
            _s("ref", ["responses"], ["ref_logp"], micro_batch=mb, resource=res(2)),
            _s("old", ["responses"], ["old_logp"], micro_batch=mb, resource=res(3)),
            _s("values", ["responses"], ["values"], micro_batch=mb, resource=res(4)),
            _s("adv", ["scores", "values"], ["advantages"], micro_batch=mb, by_group=by_group, resource=res(5)),
            _s(
                "update",
                ["advantages", "old_logp", "ref_logp"],
                ["loss"],
                role="update",
                micro_batch=mb,
                resource=res(6),
            ),
        ]
    )


def test_hand_computed_two_stage_pipeline():
    graph = StageGraph(
        [
            _s("rollout", ["prompts"], ["responses"], role="rollout", micro_batch=1, resource="gen"),
            _s("update", ["responses"], ["loss"], role="update", micro_batch=1, resource="train"),
        ]
    )
    cost = {"rollout": 2.0, "update": 1.0}
    # k=1: rollout runs back to back (8 rows * 2 s), the update trails by its last row: 17 s.
    rep = simulate(graph, cost, num_prompts=4, num_iterations=2, staleness=1)
    assert rep.makespan == 17.0
    assert rep.utilisation == {"rollout": 16 / 17, "update": 8 / 17}
    assert rep.bubble_fraction == pytest.approx(1 - 24 / 34)
    # k=0: iteration 1's rollout waits for update 0 (ends at 9): 9 + 9 = 18 s.
    rep = simulate(graph, cost, num_prompts=4, num_iterations=2, staleness=0)
    assert rep.makespan == 18.0
    assert critical_path_bound(graph, cost, num_prompts=4, num_iterations=2, staleness=0) == 18.0
    # blocking: each stage waits for the whole batch: 8 + 4 per iteration.
    rep = simulate(graph, cost, num_prompts=4, num_iterations=2, blocking=True)
    assert rep.makespan == 24.0


@settings(max_examples=12)
@given(
    costs=stage_costs(["rollout", "reward", "ref", "old", "values", "adv", "update"]),
    mb=st.sampled_from([2, 4, 8]),
    by_group=st.booleans(),
    staleness=st.integers(0, 2),
)
def test_seven_stage_makespan_within_5_percent_of_the_critical_path_bound(costs, mb, by_group, staleness):
    graph = _seven(mb, by_group=by_group)
    kw = dict(num_prompts=16, n_samples=2, num_iterations=3)
    rep = simulate(graph, costs, staleness=staleness, **kw)
    bound = critical_path_bound(graph, costs, staleness=staleness, **kw)
    assert bound * (1 - 1e-9) <= rep.makespan <= 1.05 * bound, (rep.makespan, bound)


@settings(max_examples=25)
@given(spec=pipeline_specs(), data=st.data())
def test_the_bound_is_a_lower_bound_and_reports_are_consistent(spec, data):
    graph = StageGraph(spec_stages(spec, sleep=False))
    costs = data.draw(stage_costs(list(graph.names)))
    slots = {r: data.draw(st.integers(1, 3)) for r in graph.resources}
    blocking = data.draw(st.booleans())
    kw = dict(
        num_prompts=spec["num_prompts"], n_samples=spec["n_samples"], num_iterations=spec["num_iterations"], slots=slots
    )
    rep = simulate(graph, costs, staleness=spec["staleness"], blocking=blocking, **kw)
    assert rep.makespan >= critical_path_bound(graph, costs, staleness=spec["staleness"], **kw) * (1 - 1e-9)
    busy = {n: sum(t.end - t.start for t in rep.tasks if t.stage == n) for n in graph.names}
    for n in graph.names:
        assert rep.utilisation[n] == pytest.approx(busy[n] / (rep.makespan * slots[graph.stages[n].resource]))
        assert 0 <= rep.utilisation[n] <= 1 + 1e-9
    total = sum(slots.values())
    assert rep.bubble_fraction == pytest.approx(1 - sum(busy.values()) / (rep.makespan * total))
    # at no instant does a resource run more calls than it has slots
    for r in graph.resources:
        spans = [(t.start, t.end) for t in rep.tasks if t.resource == r and t.end > t.start]
        for a, _ in spans:
            assert sum(s <= a < e for s, e in spans) <= slots[r]


@settings(max_examples=15)
@given(pipeline_specs(resources=("device",), max_delay=0.0))
def test_simulation_takes_the_same_decisions_as_the_threaded_scheduler(spec):
    kw = dict(
        num_prompts=spec["num_prompts"],
        n_samples=spec["n_samples"],
        num_iterations=spec["num_iterations"],
        staleness=spec["staleness"],
    )
    cap = spec["num_prompts"] * spec["n_samples"]
    real = run_pipeline(
        StageGraph(spec_stages(spec, sleep=False)), lambda j: {"prompts": torch.arange(cap) // spec["n_samples"]}, **kw
    )
    sim = simulate(StageGraph(spec_stages(spec, sleep=False)), lambda s, rows: 1.0, **kw)
    key = lambda res: [(t.stage, t.iteration, t.rows.tolist(), t.version) for t in res.tasks]  # noqa: E731
    assert key(real) == key(sim)
    assert real.switches == sim.switches


def test_switch_cost_is_paid_per_phase_switch_on_a_shared_resource():
    graph = _seven(8, shared=True)
    costs = dict.fromkeys(graph.names, 1.0)
    kw = dict(num_prompts=4, n_samples=4, num_iterations=3, staleness=0)
    base = simulate(graph, costs, **kw)
    paid = simulate(graph, costs, switch_cost=5.0, **kw)
    assert base.switches == paid.switches
    # rollout -> train and back each iteration, nothing else: the shared device never idles
    assert len(paid.switches) == 2 * 3 - 1
    assert base.makespan == 7 * 16 * 3
    assert paid.makespan == base.makespan + 5.0 * len(paid.switches)


def test_random_cost_model_and_hundreds_of_slots():
    rng = random.Random(0)
    graph = _seven(4)
    costs = {n: rng.uniform(0.5, 5) for n in graph.names}
    noisy = lambda s, rows: costs[s.name] * rows * rng.uniform(0.8, 1.2)  # noqa: E731
    slots = {f"r{i}": 64 for i in range(7)}
    rep = simulate(graph, noisy, num_prompts=64, n_samples=8, num_iterations=2, staleness=1, slots=slots)
    assert rep.makespan > 0 and 0 <= rep.bubble_fraction < 1
    assert len(rep.tasks) == 7 * 2 * 64 * 8 // 4


def test_cost_errors_name_the_stage():
    graph = _seven(4)
    with pytest.raises(ValueError, match=r"no per-row cost for stage\(s\) \['update'\]"):
        simulate(graph, {n: 1.0 for n in graph.names if n != "update"}, num_prompts=4)
    with pytest.raises(ValueError, match=r"cost\('rollout', 4\): got -1.0, expected a duration >= 0"):
        simulate(graph, lambda s, rows: -1.0, num_prompts=4)
    with pytest.raises(ValueError, match="cost: got int"):
        simulate(graph, 3, num_prompts=4)


def test_a_stalled_simulation_is_an_error(monkeypatch):
    from rlcore.dataflow import scheduler

    monkeypatch.setattr(scheduler.SchedulerCore, "pick", lambda self, resource: None)
    with pytest.raises(RuntimeError, match="simulation stalled: no stage can take rows"):
        simulate(_seven(4), dict.fromkeys(_seven(4).names, 1.0), num_prompts=4)


def _rec(stage_name, rows, seconds):
    from rlcore.dataflow import TaskRecord

    return TaskRecord(stage_name, "r", 0, torch.arange(rows), 0, 1.0, 1.0 + seconds)


def test_fit_costs_by_hand():
    # t = 0.5 + 0.25 * rows exactly; one size only: all per-row; a negative intercept refits through 0;
    # a negative slope keeps the mean as a fixed cost
    tasks = [
        _rec("a", 2, 1.0),
        _rec("a", 6, 2.0),
        _rec("b", 4, 2.0),
        _rec("b", 4, 2.0),
        _rec("c", 1, 0.0),
        _rec("c", 3, 4.0),
        _rec("d", 1, 3.0),
        _rec("d", 3, 1.0),
    ]
    cost = fit_costs(tasks)
    assert cost.fixed["a"] == pytest.approx(0.5) and cost.per_row["a"] == pytest.approx(0.25)
    assert cost.fixed["b"] == 0 and cost.per_row["b"] == pytest.approx(0.5)
    assert cost.fixed["c"] == 0 and cost.per_row["c"] == pytest.approx(12 / 10)
    assert cost.fixed["d"] == pytest.approx(2.0) and cost.per_row["d"] == 0
    assert cost(stage(print, inputs=["x"], outputs=["y"], name="a"), 10) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="tasks: got no calls"):
        fit_costs([])


def test_simulating_fitted_costs_reproduces_the_fitted_run():
    graph = _seven(4)
    truth = {n: 0.1 * (i + 1) for i, n in enumerate(graph.names)}
    kw = dict(num_prompts=8, n_samples=2, num_iterations=2, staleness=1)
    rep = simulate(graph, truth, **kw)
    again = simulate(graph, fit_costs(rep.tasks), **kw)
    assert again.makespan == pytest.approx(rep.makespan)


@settings(max_examples=30)
@given(
    durations=st.lists(st.floats(0.1, 5.0), min_size=2, max_size=7),
    mb=st.integers(1, 4),
    calls=st.integers(1, 4),
    num_iterations=st.integers(1, 3),
)
def test_chain_pipeline_matches_the_flow_shop_recurrence(durations, mb, calls, num_iterations):
    from rlcore.testing.reference import flow_shop_makespan_ref

    names = [f"s{i}" for i in range(len(durations))]
    cols = ["prompts", *[f"c{i}" for i in range(len(durations))]]
    roles = ["rollout", *["compute"] * (len(durations) - 2), "update"]
    graph = StageGraph(
        [_s(n, [cols[i]], [cols[i + 1]], role=roles[i], micro_batch=mb, resource=n) for i, n in enumerate(names)]
    )
    # each call costs the stage's duration, whatever its size, so every job is alike
    cost = lambda s, rows: durations[names.index(s.name)]  # noqa: E731
    rep = simulate(graph, cost, num_prompts=mb * calls, num_iterations=num_iterations, staleness=num_iterations)
    jobs = num_iterations * calls
    assert rep.makespan == pytest.approx(flow_shop_makespan_ref(durations, jobs))
