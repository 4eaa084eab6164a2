"""Stage declarations and graph validation: every input produced, one writer per column, no cycles."""

import pytest
import torch

from rlcore.dataflow import PHASES, StageGraph, on_device, stage


def _s(name, inputs, outputs, **kw):
    def fn(batch):
        return {c: torch.zeros(1) for c in outputs}

    fn.__name__ = name
    return stage(fn, inputs=inputs, outputs=outputs, **kw)


def _mindspeed_graph():
    """The seven models of a PPO iteration, declared out of order."""
    return [
        _s("actor_update", ["responses", "advantages", "old_logp", "ref_logp"], ["actor_loss"], role="update"),
        _s("advantages", ["scores", "values"], ["advantages", "returns"]),
        _s("critic_update", ["returns", "values"], ["critic_loss"], role="update"),
        _s("reward", ["responses"], ["scores"], resource="cpu"),
        _s("ref", ["responses"], ["ref_logp"]),
        _s("old", ["responses"], ["old_logp"]),
        _s("values", ["responses"], ["values"]),
        _s("rollout", ["prompts"], ["responses"], role="rollout", micro_batch=4),
    ]


def test_topological_order_respects_every_edge_and_keeps_declaration_order_for_ties():
    graph = StageGraph(_mindspeed_graph())
    pos = {n: i for i, n in enumerate(graph.names)}
    for s in graph.order:
        for u in graph.upstream[s.name]:
            assert pos[u] < pos[s.name], (u, s.name)
    assert graph.names == ("rollout", "reward", "ref", "old", "values", "advantages", "actor_update", "critic_update")
    assert graph.resources == ("device", "cpu")
    assert graph.writer["scores"] == "reward"


def test_roles_set_the_default_phase():
    graph = StageGraph(_mindspeed_graph())
    assert graph.stages["rollout"].phase == PHASES["rollout"] == "rollout"
    assert graph.stages["actor_update"].phase == "train"
    assert graph.stages["reward"].phase is None
    assert _s("old", ["responses"], ["x"], phase="train").phase == "train"


def test_head_and_tail_paths_by_hand():
    graph = StageGraph(
        [_s("a", ["prompts"], ["x"]), _s("b", ["x"], ["y"]), _s("c", ["x"], ["z"]), _s("d", ["y", "z"], ["w"])]
    )
    head, tail = graph.downstream_paths({"a": 1.0, "b": 5.0, "c": 2.0, "d": 3.0})
    assert head == {"a": 0.0, "b": 1.0, "c": 1.0, "d": 6.0}
    assert tail == {"a": 8.0, "b": 3.0, "c": 3.0, "d": 0.0}


@pytest.mark.parametrize(
    "stages, match",
    [
        ([_s("a", ["prompts"], ["x"]), _s("a", ["x"], ["y"])], "two stages named 'a'"),
        (
            [_s("a", ["prompts"], ["x"]), _s("b", ["prompts"], ["x"])],
            "stage 'b': column 'x' is already written by stage 'a'",
        ),
        ([_s("a", ["x"], ["prompts"])], "column 'prompts' is already written by the prompt loader"),
        (
            [_s("a", ["prompts"], ["x"]), _s("b", ["nope"], ["y"])],
            "stage 'b': input column 'nope' is produced by no stage",
        ),
        (
            [_s("a", ["prompts", "z"], ["x"]), _s("b", ["x"], ["y"]), _s("c", ["y"], ["z"]), _s("d", ["x"], ["w"])],
            r"cycle within an iteration among stages \['a', 'b', 'c'\]",
        ),
        ([], "expected a non-empty list of Stage"),
    ],
)
def test_graph_validation_names_the_stage_and_column(stages, match):
    with pytest.raises(ValueError, match=match):
        StageGraph(stages)


def test_cycle_message_lists_the_edges():
    with pytest.raises(ValueError, match="b -> a"):
        StageGraph([_s("a", ["prompts", "y"], ["x"]), _s("b", ["x"], ["y"])])


def test_custom_sources():
    graph = StageGraph([_s("a", ["ids", "answers"], ["x"])], sources=["ids", "answers"])
    assert graph.sources == ("ids", "answers")
    with pytest.raises(ValueError, match="sources"):
        StageGraph([_s("a", ["prompts"], ["x"])], sources="prompts")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"inputs": "prompts", "outputs": ["x"]}, "inputs: got 'prompts', expected a list"),
        ({"inputs": ["prompts"], "outputs": []}, "expected at least one of each"),
        ({"inputs": ["x"], "outputs": ["x"]}, "both input and output"),
        ({"inputs": ["a", "a"], "outputs": ["x"]}, "distinct column names"),
        ({"inputs": ["prompts"], "outputs": ["policy_version"]}, "policy_version"),
        ({"inputs": ["prompts"], "outputs": ["x"], "micro_batch": 0}, "micro_batch"),
        ({"inputs": ["prompts"], "outputs": ["x"], "micro_batch": 2.0}, "micro_batch got 2.0"),
        (
            {"inputs": ["prompts"], "outputs": ["x"], "role": "actor"},
            "role: got 'actor', expected one of 'rollout', 'compute', 'update'",
        ),
        ({"inputs": ["prompts"], "outputs": ["x"], "timeout": -1}, "timeout"),
        ({"inputs": ["prompts"], "outputs": ["x"], "resource": ""}, "resource"),
    ],
)
def test_stage_declaration_errors(kwargs, match):
    def named(batch):
        return {}

    with pytest.raises(ValueError, match=match):
        stage(named, **kwargs)


def test_stage_needs_a_callable_and_a_name():
    with pytest.raises(ValueError, match="fn: got int"):
        stage(3, inputs=["prompts"], outputs=["x"], name="a")
    with pytest.raises(ValueError, match="lambda needs an explicit name"):
        stage(lambda b: b, inputs=["prompts"], outputs=["x"])
    assert stage(lambda b: b, inputs=["prompts"], outputs=["x"], name="ok").name == "ok"


def test_on_device_moves_the_batchs_tensors_before_the_call_and_nothing_else():
    seen = {}

    def fn(b):
        seen.update(b)
        return {"y": b["x"] * 2}

    s = stage(fn, inputs=["x", "tags"], outputs=["y"], name="double", micro_batch=2, role="update")
    placed = on_device(s, "meta")
    x, tags = torch.ones(3), ["a", "b", "c"]
    out = placed.fn({"x": x, "tags": tags})
    assert seen["x"].device.type == "meta" and seen["tags"] is tags  # a list passes as it is
    assert out["y"].device.type == "meta"  # the outputs stay where the stage made them
    assert x.device.type == "cpu"  # the caller's tensors are not changed
    assert (placed.name, placed.inputs, placed.outputs, placed.micro_batch, placed.role) == (
        s.name,
        s.inputs,
        s.outputs,
        s.micro_batch,
        s.role,
    )
    same = torch.ones(2)
    on_device(stage(fn, inputs=["x"], outputs=["y"], name="cpu_stage"), "cpu").fn({"x": same})
    assert seen["x"] is same  # already on the device: no copy
