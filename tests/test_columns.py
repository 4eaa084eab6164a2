"""The column schema: undeclared columns refused when a graph is built, wrong dtypes refused when a stage puts, and the
trainer's table covering exactly the columns the shipped configs' graphs exchange."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from rlcore.agent import STAGE_OUTPUTS, TRAJECTORY_KEYS
from rlcore.dataflow import Column, SchedulerCore, Schema, StageGraph, run_pipeline, simulate, stage
from rlcore.dataflow import scheduler as scheduler_module
from rlcore.train import (
    COLUMNS,
    PAIR_TOKEN_COLUMNS,
    PROMPT_COLUMNS,
    ROLLOUT_COLUMNS,
    DatasetPrompts,
    PreferencePrompts,
    load_config,
    train,
)
from tiny_runs import QUIET

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = [
    "grpo_tiny",
    "dapo_tiny",
    "ppo_tiny",
    "dpo_tiny",
    "dpo_offline_tiny",
    "agent_calc_tiny",
    "sft_tiny",
    "rm_tiny",
]
WHERE = "rlcore.train.columns.COLUMNS"


def _rollout(mask_dtype=torch.float32, name="rollout"):
    def rollout(b):
        n = b["prompts"].shape[0]
        return {
            "responses": torch.ones(n, 3, dtype=torch.int64),
            "mask": torch.ones(n, 3, dtype=mask_dtype),
            "version": b["policy_version"].clone(),
        }

    return stage(
        rollout, inputs=["prompts", "prompt_mask"], outputs=["responses", "mask", "version"], name=name, role="rollout"
    )


def _update():
    return stage(
        lambda b: {"loss": b["mask"].sum(-1)},
        inputs=["responses", "mask"],
        outputs=["loss"],
        name="update",
        role="update",
    )


def _loader(prompt_mask_dtype=torch.int64):
    def load(j):
        return {
            "prompts": torch.ones(4, 2, dtype=torch.int64),
            "prompt_mask": torch.ones(4, 2, dtype=prompt_mask_dtype),
        }

    return load


def test_one_name_and_one_dtype_per_mask():
    assert COLUMNS["mask"].dtype == torch.float32 and COLUMNS["mask"].shape == "token"
    assert COLUMNS["prompt_mask"].dtype == torch.int64 and COLUMNS["prompt_mask"].shape == "token"
    assert COLUMNS["trajectory_mask"].dtype == torch.float32
    assert not {"policy_mask", "prompts_mask", "responses_mask", "token_rewards"} & set(COLUMNS.names)


@pytest.mark.parametrize("layer", ["train", "agent"])
def test_the_old_mask_names_are_gone(layer):
    """No string literal of the trainer or the agent names a retired column."""
    old = {"policy_mask", "prompts_mask", "responses_mask", "token_rewards"}
    found = []
    for path in sorted((ROOT / "src" / "rlcore" / layer).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in old:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert not found, found


def test_name_lists_are_the_schemas():
    for names in (
        PROMPT_COLUMNS,
        PAIR_TOKEN_COLUMNS,
        ROLLOUT_COLUMNS,
        DatasetPrompts.columns,
        PreferencePrompts.columns,
        STAGE_OUTPUTS,
    ):
        COLUMNS.check_names("test", names)
    # The agent rollout's trajectory keys are dock columns where they share a name, with the declared dtype.
    assert {"mask", "trajectory_mask", "rewards", "rollout_logp", "scores"} <= set(TRAJECTORY_KEYS)
    with pytest.raises(ValueError, match=rf"select: column 'nope' is not a declared column.*{WHERE}"):
        COLUMNS.select("prompts", "nope")


def test_unknown_column_is_refused_when_the_graph_is_built():
    bad = stage(lambda b: {"policy_mask": b["responses"]}, inputs=["responses"], outputs=["policy_mask"], name="agent")
    with pytest.raises(
        ValueError, match=rf"stage 'agent': output column 'policy_mask' is not a declared column.*{WHERE}"
    ):
        StageGraph([_rollout(), bad], sources=("prompts", "prompt_mask"), schema=COLUMNS)
    reads = stage(lambda b: {"loss": b["mask"][:, 0]}, inputs=["prompts_mask"], outputs=["loss"], name="update")
    with pytest.raises(ValueError, match=r"stage 'update': input column 'prompts_mask' is not a declared column"):
        StageGraph([reads], sources=("prompts", "prompt_mask"), schema=COLUMNS)
    with pytest.raises(ValueError, match=r"the prompt loader: source column 'prompts_mask' is not a declared column"):
        StageGraph([_rollout()], sources=("prompts", "prompts_mask", "prompt_mask"), schema=COLUMNS)
    with pytest.raises(ValueError, match=r"schema: got dict, expected a rlcore.dataflow.Schema"):
        StageGraph([_rollout()], sources=("prompts", "prompt_mask"), schema={})
    # Without a schema a graph checks names only against each other, as before.
    StageGraph([_rollout(), bad], sources=("prompts", "prompt_mask"))


def test_wrong_dtype_is_refused_when_a_stage_puts():
    graph = StageGraph([_rollout(torch.int64), _update()], sources=("prompts", "prompt_mask"), schema=COLUMNS)
    msg = rf"stage 'rollout': column 'mask' got dtype torch.int64, expected torch.float32 \(declared in {WHERE}\)"
    with pytest.raises(ValueError, match=msg):
        run_pipeline(graph, _loader(), num_prompts=4, blocking=True)
    good = StageGraph([_rollout(), _update()], sources=("prompts", "prompt_mask"), schema=COLUMNS)
    res = run_pipeline(good, _loader(), num_prompts=4, blocking=True, collect=["loss"])
    assert res.batches[0]["loss"].tolist() == [3.0] * 4


def test_wrong_dtype_from_the_loader_is_refused():
    graph = StageGraph([_rollout(), _update()], sources=("prompts", "prompt_mask"), schema=COLUMNS)
    msg = r"the prompt loader: column 'prompt_mask' got dtype torch.bool, expected torch.int64"
    with pytest.raises(ValueError, match=msg):
        run_pipeline(graph, _loader(torch.bool), num_prompts=4, blocking=True)


def test_row_rank_and_dtype_kind():
    schema = Schema(
        [
            Column("scores", torch.float32, "scalar", "reward"),
            Column("ref", "float", "scalar", "summed log-prob"),
            Column("ids", torch.int64, "ragged", "token ids"),
        ],
        declared_in="here",
    )
    with pytest.raises(
        ValueError, match=r"stage 'r': column 'scores' got rows of 1 dims, expected 0 \(a scalar column"
    ):
        schema.check_put("stage 'r'", {"scores": torch.ones(2, 3)})
    schema.check_put(
        "stage 'r'", {"ref": torch.ones(2, dtype=torch.float64), "ids": [torch.ones(3, dtype=torch.int64)]}
    )
    with pytest.raises(ValueError, match=r"column 'ref' got dtype torch.int64, expected any floating-point dtype"):
        schema.check_put("stage 'r'", {"ref": torch.ones(2, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"column 'ids' got dtype torch.int32, expected torch.int64"):
        schema.check_put("stage 'r'", {"ids": [torch.ones(3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)]})
    with pytest.raises(ValueError, match=r"stage 'r': column 'other' is not a declared column"):
        schema.check_put("stage 'r'", {"other": torch.ones(2)})


@pytest.mark.parametrize(
    ("columns", "match"),
    [
        ([Column("a", torch.float32, "scalar", "x"), Column("a", torch.float32, "scalar", "y")], "got 'a' twice"),
        ([Column("a", "int", "scalar", "x")], r"columns\['a'\]: got dtype 'int', expected a torch.dtype or one of"),
        ([Column("a", torch.float32, "matrix", "x")], r"columns\['a'\]: got shape 'matrix', expected one of"),
        ([Column("a", torch.float32, "scalar", "")], r"columns\['a'\]: got meaning ''"),
    ],
)
def test_bad_declarations_are_refused(columns, match):
    with pytest.raises(ValueError, match=match):
        Schema(columns, declared_in="here")


def _state_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            assert x.keys() == y.keys(), key
            assert all(v == y[k] if not isinstance(v, torch.Tensor) else torch.equal(v, y[k]) for k, v in x.items()), (
                key
            )
        else:
            assert torch.equal(x, y), key


def test_a_refused_put_changes_nothing():
    graph = StageGraph([_rollout(), _update()], sources=("prompts", "prompt_mask"), schema=COLUMNS)
    core = SchedulerCore(
        graph,
        _loader(),
        num_prompts=4,
        n_samples=1,
        num_iterations=1,
        staleness=0,
        blocking=True,
        slots=None,
        collect=(),
    )
    task = core.pick("device")
    assert task is not None and task.stage.name == "rollout"
    dock = core.docks[0]
    before, left = dock.state(), dict(core.left)
    bad = {
        "responses": torch.ones(4, 3, dtype=torch.int64),
        "mask": torch.ones(4, 3, dtype=torch.bool),
        "version": torch.zeros(4, dtype=torch.int64),
    }
    with pytest.raises(
        ValueError, match=r"stage 'rollout': column 'mask' got dtype torch.bool, expected torch.float32"
    ):
        core.complete(task, bad)
    _state_equal(dock.state(), before)
    assert core.left == left
    # The cells were not reserved: the right put goes in.
    assert core.complete(task, {**bad, "mask": torch.ones(4, 3)})
    assert bool(dock.state()["ready"]["mask"].all())


def test_simulate_puts_placeholders_of_the_schemas_dtypes():
    graph = StageGraph([_rollout(), _update()], sources=("prompts", "prompt_mask"), schema=COLUMNS)
    assert simulate(graph, {"rollout": 2.0, "update": 1.0}, num_prompts=4).makespan == 12.0


def test_table_lists_every_column_and_the_docs_show_it():
    table = COLUMNS.table()
    rows = table.splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == list(COLUMNS.names)
    assert table in (ROOT / "docs" / "train.md").read_text(), "docs/train.md's table differs from COLUMNS.table()"


@pytest.fixture(scope="module")
def shipped_graphs(tmp_path_factory):
    """Each shipped config run for one tiny step: the graph the trainer built, and every column put into the dock."""
    graphs, puts = {}, {}
    real_init, real_put = SchedulerCore.__init__, scheduler_module.TransferDock.put
    current = [""]

    def init(self, graph, *args, **kwargs):
        graphs[current[0]] = graph
        real_init(self, graph, *args, **kwargs)

    def put(self, columns, indexes):
        puts[current[0]] |= set(columns)
        return real_put(self, columns, indexes)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SchedulerCore, "__init__", init)
        mp.setattr(scheduler_module.TransferDock, "put", put)
        for name in SHIPPED:
            current[0], puts[name] = name, set()
            out = tmp_path_factory.mktemp(name)
            cfg = load_config(
                ROOT / "configs" / f"{name}.yaml",
                [
                    "trainer.steps=1",
                    "trainer.warmup_steps=1",
                    "trainer.warmup_batch_size=4",
                    "trainer.save_every=0",
                    "trainer.log_ref_kl_every=1",
                    "rl.batch_size=2",
                    "rl.mini_batch_size=2",
                    "model.init_from=null",  # rm_tiny's SFT model first: its graph is sft_tiny's, checked here too
                    f"trainer.output_dir={out}",
                    *QUIET,
                ],
            )
            assert len(train(cfg).records) == 1  # every put of the step passed the schema's dtype check
    return graphs, puts


def _used(graph):
    return {*graph.sources, *(c for s in graph.order for c in (*s.inputs, *s.outputs))}


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_graph_passes_the_schema(shipped_graphs, name):
    graphs, puts = shipped_graphs
    graph = graphs[name]
    assert graph.schema is COLUMNS
    COLUMNS.check_names(name, _used(graph))
    COLUMNS.check_names(name, puts[name])  # policy_version, which the scheduler writes, included
    assert {"mask", "prompt_mask"} & _used(graph)


def test_the_schema_declares_what_the_graphs_use_and_nothing_else(shipped_graphs):
    graphs, puts = shipped_graphs
    used = set().union(*(_used(g) for g in graphs.values()), *puts.values())
    # rlcore.agent.multi_turn_stage also writes num_env_errors and truncated, which the trainer only logs.
    # prompt_step is written with deploy.carry_over only (no shipped config): tests/test_carry_over.py's run puts it.
    # score_parts (rl.algo gdpo) and sum_pi_squared (rl.advantage optimal_token_baseline) neither: the runs of
    # tests/test_gdpo_trainer.py and tests/test_token_baseline_trainer.py put them.
    declared = set(COLUMNS.names) - {"prompt_step", "score_parts", "sum_pi_squared"}
    assert used | set(STAGE_OUTPUTS) == declared, (
        sorted(declared - used - set(STAGE_OUTPUTS)),
        sorted(used - declared),
    )
