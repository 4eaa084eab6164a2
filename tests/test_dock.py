"""The Transfer Dock: one behavioural suite run on the embedded dock and on the Ray-backed dock.

Checked: values round-trip (padded, masked, dtypes kept); rows come whole by group and
only when every requested column is ready; a get never returns a row twice to one
consumer and loses none, under random thread interleavings; explicit indexes block
until ready; fifo selection equals the loop model in ``rlcore.testing.reference``;
partial rollouts age and come first; bad input raises ValueError and changes nothing.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.dataflow import DockController, RayTransferDock, TransferDock, Warehouse
from rlcore.testing.dataflow_strategies import dock_interleavings, dock_programs
from rlcore.testing.reference import TransferDockRef

BACKENDS = ["embedded", "ray"]


@pytest.fixture(scope="module")
def ray_session():
    import ray  # the test extra installs Ray: a missing Ray is a failure, not a skip

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


class _RayDocks:
    """Actor processes take seconds to start: every Ray dock of the suite lives on three shared hosts."""

    def __init__(self) -> None:
        self.hosts = RayTransferDock.start_hosts(3)
        self.docks: list[RayTransferDock] = []

    def make(self, num_prompts: int, n_samples: int, **kw) -> RayTransferDock:
        while self.docks:
            self.docks.pop().close()
        dock = RayTransferDock(num_prompts, n_samples, hosts=self.hosts, **kw)
        self.docks.append(dock)
        return dock


@pytest.fixture(scope="module")
def ray_docks(ray_session):
    pool = _RayDocks()
    yield pool
    for host in pool.hosts:
        ray_session.kill(host)


@pytest.fixture(params=BACKENDS)
def make_dock(request):
    if request.param == "embedded":
        return TransferDock
    return request.getfixturevalue("ray_docks").make


def tokens(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert a[key].keys() == b[key].keys(), key
            for name in a[key]:
                va, vb = a[key][name], b[key][name]
                assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, (key, name)
        else:
            assert torch.equal(a[key], b[key]), key


# ---------------------------------------------------------------------------- behaviour


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_round_trip_padded_with_masks(make_dock, dtype):
    dock = make_dock(2, 2, consumers=["train"], num_warehouses=2, pad_value=-1)
    responses = [tokens(5, 6, 7), tokens(8), tokens(9, 10), tokens(11, 12, 13, 14)]
    logp = [torch.tensor([0.5, -1.5, 2.25], dtype=dtype), torch.tensor([0.125], dtype=dtype)]
    logp += [torch.tensor([-0.25, 4.0], dtype=dtype), torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype)]
    scores = torch.tensor([1.0, 0.0, 0.5, -2.0], dtype=dtype)
    dock.put({"responses": responses, "logp": logp}, [0, 1, 2, 3])
    dock.put({"scores": scores}, torch.tensor([0, 1, 2, 3]))
    batch, idx = dock.get("train", ["responses", "logp", "scores"], 4, balance="fifo")
    assert idx.tolist() == [0, 1, 2, 3]
    assert batch["responses"].tolist() == [[5, 6, 7, -1], [8, -1, -1, -1], [9, 10, -1, -1], [11, 12, 13, 14]]
    assert batch["responses_mask"].tolist() == [
        [True, True, True, False],
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, True],
    ]
    assert batch["logp"].dtype == dtype and batch["scores"].dtype == dtype
    assert batch["logp"][0].tolist() == [0.5, -1.5, 2.25, -1.0]
    assert batch["logp"][3].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert batch["scores"].tolist() == [1.0, 0.0, 0.5, -2.0]
    assert set(batch) == {"responses", "responses_mask", "logp", "logp_mask", "scores"}


def test_rows_that_require_grad_are_kept_detached(make_dock):
    dock = make_dock(1, 2, consumers=["train"])
    logp = [torch.tensor([0.5, -1.5], requires_grad=True), torch.tensor([2.0])]
    dock.put({"logp": [x * 2 for x in logp]}, [0, 1])
    batch, _ = dock.get("train", ["logp"], 2, balance="fifo")
    assert not batch["logp"].requires_grad
    assert batch["logp"].tolist() == [[1.0, -3.0], [4.0, 0.0]]


def test_one_tensor_given_for_several_rows_is_stored_for_each(make_dock):
    dock = make_dock(2, 2, consumers=["train"])
    shared, other = tokens(4, 5), tokens(6)
    dock.put({"answers": [shared, shared, other, other]}, [0, 1, 2, 3])
    batch, _ = dock.get("train", ["answers"], 4, balance="fifo")
    assert batch["answers"].tolist() == [[4, 5], [4, 5], [6, 0], [6, 0]]
    with pytest.raises(ValueError, match=r"columns\['answers'\]\[2\]"):
        dock.put({"answers": [shared, shared, torch.zeros(1, 2, dtype=torch.int64), other]}, [0, 1, 2, 3])


def test_packed_batches(make_dock):
    dock = make_dock(2, 2, consumers=["train", "other"], num_warehouses=2)
    responses = [tokens(5, 6, 7), tokens(8), tokens(9, 10), tokens(11, 12, 13, 14)]
    logp = [
        torch.tensor([0.5, -1.5, 2.25]),
        torch.tensor([0.125]),
        torch.tensor([-0.25, 4.0]),
        torch.tensor([1.0, 2.0, 3.0, 4.0]),
    ]
    dock.put({"responses": responses, "logp": logp, "scores": torch.tensor([1.0, 0.0, 0.5, -2.0])}, [0, 1, 2, 3])
    batch, idx = dock.get("train", ["responses", "logp", "scores"], 4, balance="fifo", packed=True)
    assert idx.tolist() == [0, 1, 2, 3]
    packed = batch["responses"]
    assert packed.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 6, 10] and packed.cu_seqlens.dtype == torch.int32
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 0, 1, 2, 3]
    assert batch["logp"].tolist() == [0.5, -1.5, 2.25, 0.125, -0.25, 4.0, 1.0, 2.0, 3.0, 4.0]
    assert batch["logp_cu_seqlens"].tolist() == [0, 3, 4, 6, 10]
    assert batch["scores"].tolist() == [1.0, 0.0, 0.5, -2.0]
    # Rows in any order across warehouses: packed and padded agree row by row.
    batch, idx = dock.get("other", ["logp"], 4, packed=True)
    cu = batch["logp_cu_seqlens"].tolist()
    for b, row in enumerate(idx.tolist()):
        assert torch.equal(batch["logp"][cu[b] : cu[b + 1]], logp[row])


def test_groups_come_whole_and_only_when_all_columns_are_ready(make_dock):
    dock = make_dock(3, 2, consumers=["reward", "ref"])
    dock.put({"responses": [tokens(1)] * 3}, [0, 1, 2])  # group 0 whole, group 1 half
    _batch, idx = dock.get("reward", ["responses"], 2)
    assert idx.tolist() == [0, 1]
    assert dock.get("reward", ["responses"], 2)[1].numel() == 0  # row 2 alone is not a group
    dock.put({"responses": [tokens(2)]}, [3])
    assert dock.get("reward", ["responses"], 2)[1].tolist() == [2, 3]
    # "ref" also needs "prompts", which only group 2 has.
    dock.put({"prompts": [tokens(7), tokens(7)]}, [4, 5])
    assert dock.get("ref", ["responses", "prompts"], 2, by_group=False)[1].numel() == 0
    dock.put({"responses": [tokens(3), tokens(4)]}, [4, 5])
    assert sorted(dock.get("ref", ["responses", "prompts"], 2)[1].tolist()) == [4, 5]


def test_by_group_false_takes_single_rows(make_dock):
    dock = make_dock(2, 3, consumers=["c"])
    dock.put({"x": torch.arange(2.0)}, [1, 5])
    batch, idx = dock.get("c", ["x"], 1, by_group=False, balance="fifo")
    assert idx.tolist() == [1] and batch["x"].tolist() == [0.0]
    assert dock.get("c", ["x"], 1, by_group=False)[1].tolist() == [5]
    assert dock.get("c", ["x"], 1, by_group=False)[1].numel() == 0


def test_too_few_ready_rows_return_empty_and_take_nothing(make_dock):
    dock = make_dock(4, 1, consumers=["c"])
    dock.put({"x": torch.zeros(2)}, [0, 3])
    before = dock.state()
    batch, idx = dock.get("c", ["x"], 3)
    assert batch == {} and idx.numel() == 0 and idx.dtype == torch.int64
    assert_state_equal(before, dock.state())
    assert sorted(dock.get("c", ["x"], 2)[1].tolist()) == [0, 3]


def test_consumers_are_independent_and_all_consumed(make_dock):
    dock = make_dock(2, 2, consumers=["a", "b"])
    dock.put({"x": torch.arange(4.0)}, range(4))
    assert not dock.all_consumed("a")
    for _ in range(2):
        dock.get("a", ["x"], 2)
    assert dock.all_consumed("a") and not dock.all_consumed("b")
    assert dock.get("a", ["x"], 2)[1].numel() == 0
    assert sorted(dock.get("b", ["x"], 4)[1].tolist()) == [0, 1, 2, 3]
    assert dock.all_consumed("b")


def test_explicit_indexes_wait_until_ready(make_dock):
    dock = make_dock(2, 2, consumers=["c"])
    dock.put({"x": torch.zeros(2)}, [0, 1])
    result = {}

    def consume():
        start = time.monotonic()
        result["got"] = dock.get("c", ["x"], indexes=[2, 3])
        result["waited"] = time.monotonic() - start

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()
    dock.put({"x": torch.tensor([5.0, 6.0])}, [2, 3])
    thread.join(60)
    batch, idx = result["got"]
    assert idx.tolist() == [2, 3] and batch["x"].tolist() == [5.0, 6.0]
    assert result["waited"] >= 0.25
    # Already taken by this consumer: refused; within the timeout but never ready: empty.
    with pytest.raises(ValueError, match="already taken"):
        dock.get("c", ["x"], indexes=[2, 3])
    dock.add_consumer("d")
    dock.put({"y": torch.zeros(1)}, [0])
    start = time.monotonic()
    assert dock.get("d", ["y"], indexes=[2, 3], timeout=0.2)[1].numel() == 0
    assert time.monotonic() - start >= 0.2


def test_timeout_waits_for_enough_rows(make_dock):
    dock = make_dock(4, 1, consumers=["c"])
    dock.put({"x": torch.zeros(1)}, [0])
    timer = threading.Timer(0.3, lambda: dock.put({"x": torch.ones(2)}, [1, 2]))
    timer.start()
    start = time.monotonic()
    _batch, idx = dock.get("c", ["x"], 3, timeout=10, balance="fifo")
    timer.join()
    assert idx.tolist() == [0, 1, 2] and 0.25 <= time.monotonic() - start < 60
    # Nothing left to come: empty after the timeout, having slept rather than spun.
    start, cpu = time.monotonic(), time.thread_time()
    assert dock.get("c", ["x"], 1, timeout=0.5)[1].numel() == 0
    assert time.monotonic() - start >= 0.5 and time.thread_time() - cpu < 0.25


def test_tokens_balance_pairs_long_with_short(make_dock):
    dock = make_dock(8, 1, consumers=["c"])
    dock.put({"responses": [torch.zeros(n) for n in (3, 8, 1, 5, 2, 7, 4, 6)]}, range(8))
    totals, seen = [], []
    for _ in range(4):
        batch, idx = dock.get("c", ["responses"], 2, balance="tokens")
        totals.append(int(batch["responses_mask"].sum()))
        seen += idx.tolist()
    # Lengths 8+1, 7+2, 6+3, 5+4: every get carries 9 tokens.
    assert totals == [9, 9, 9, 9] and sorted(seen) == list(range(8))


def test_partial_rollouts_age_and_come_first(make_dock):
    dock = make_dock(4, 2, consumers=["rollout"])
    dock.put({"prompts": [tokens(p) for p in range(8)], "responses": [tokens(1, 2)] * 8}, range(8))
    # Group 2 did not finish generating: it resumes next iteration.
    dock.set_completed([4, 5], torch.tensor([False, False]))
    assert dock.completed.tolist() == [True] * 4 + [False] * 2 + [True] * 2
    dock.reset(keep=["prompts"])
    assert dock.age.tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    assert dock.completed.all()
    assert dock.free_rows().tolist() == [0, 1, 2, 3, 6, 7]
    dock.put({"prompts": [tokens(10 + p) for p in range(6)]}, [0, 1, 2, 3, 6, 7])
    for balance in ("random", "fifo", "tokens"):
        dock.add_consumer(balance)
        batch, idx = dock.get(balance, ["prompts"], 2, balance=balance)
        assert idx.tolist() == [4, 5], balance
        assert batch["prompts"].flatten().tolist() == [4, 5]
    # The partial responses were dropped (not in keep), so a stage needing them waits.
    assert dock.get("rollout", ["responses"], 2)[1].numel() == 0
    dock.reset()
    assert dock.age.tolist() == [0] * 8 and dock.free_rows().tolist() == list(range(8))


# ---------------------------------------------------------------------------- bad input


BAD_CALLS = {
    "put index out of range": (lambda d: d.put({"x": torch.zeros(2)}, [3, 8]), "indexes"),
    "put negative index": (lambda d: d.put({"x": torch.zeros(1)}, [-1]), "indexes"),
    "put repeated index": (lambda d: d.put({"x": torch.zeros(2)}, [1, 1]), "indexes"),
    "put column of wrong length": (
        lambda d: d.put({"x": torch.zeros(2), "y": torch.zeros(3)}, [4, 5]),
        "columns\\['y'\\]",
    ),
    "put column of wrong dtype": (
        lambda d: d.put({"x": torch.zeros(2, dtype=torch.int32)}, [4, 5]),
        "columns\\['x'\\]",
    ),
    "put rows of mixed dtype": (
        lambda d: d.put({"z": [torch.zeros(2), torch.zeros(2, dtype=torch.int64)]}, [4, 5]),
        "columns\\['z'\\]",
    ),
    "put non-tensor row": (lambda d: d.put({"z": [torch.zeros(2), [1.0]]}, [4, 5]), "columns\\['z'\\]"),
    "put float indexes": (lambda d: d.put({"x": torch.zeros(1)}, torch.tensor([1.0])), "indexes"),
    "get undeclared column": (lambda d: d.get("c", ["x", "nope"], 2), "columns"),
    "get column as a string": (lambda d: d.get("c", "x", 2), "columns"),
    "get unregistered consumer": (lambda d: d.get("nobody", ["x"], 2), "consumer"),
    "get bad balance": (lambda d: d.get("c", ["x"], 2, balance="lpt"), "balance"),
    "get count not a group multiple": (lambda d: d.get("c", ["x"], 3), "count"),
    "get count zero": (lambda d: d.get("c", ["x"], 0), "count"),
    "get count over capacity": (lambda d: d.get("c", ["x"], 10), "count"),
    "get partial group by index": (lambda d: d.get("c", ["x"], indexes=[0]), "indexes"),
    "get index out of range": (lambda d: d.get("c", ["x"], indexes=[8, 9]), "indexes"),
    "get count disagrees with indexes": (lambda d: d.get("c", ["x"], 4, indexes=[0, 1]), "count"),
    "set_completed wrong shape": (lambda d: d.set_completed([0, 1], torch.tensor([False])), "completed"),
    "reset keeps undeclared column": (lambda d: d.reset(keep=["nope"]), "keep"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_and_changes_nothing(make_dock, case):
    call, argument = BAD_CALLS[case]
    dock = make_dock(4, 2, consumers=["c"], num_warehouses=2)
    dock.put({"x": torch.arange(4.0)}, [0, 1, 2, 3])
    before = dock.state()
    with pytest.raises(ValueError, match=argument):
        call(dock)
    assert_state_equal(before, dock.state())
    # The data is intact too: the consumer still gets every stored row, once.
    batch, idx = dock.get("c", ["x"], 4, balance="fifo")
    assert idx.tolist() == [0, 1, 2, 3] and batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_ray_dock_travels_to_a_remote_task(ray_docks, ray_session):
    dock = ray_docks.make(2, 2, consumers=["reward"], num_warehouses=2)

    @ray_session.remote(num_cpus=1)
    def rollout(dock):
        # Another process puts straight into the warehouses through the pickled client.
        dock.put({"responses": [torch.arange(n + 1) for n in range(4)]}, range(4))
        return dock.get("reward", ["responses"], 2, balance="fifo")[1]

    assert ray_session.get(rollout.remote(dock)).tolist() == [0, 1]
    batch, idx = dock.get("reward", ["responses"], 2)
    assert idx.tolist() == [2, 3] and batch["responses_mask"].sum(1).tolist() == [3, 4]


def test_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError, match="n_samples"):
        TransferDock(4, 0)
    with pytest.raises(ValueError, match="num_warehouses"):
        TransferDock(2, 2, num_warehouses=5)
    with pytest.raises(ValueError, match="num_prompts"):
        DockController(2.5)


def test_warehouses_hold_disjoint_ranges():
    dock = TransferDock(5, 2, consumers=["c"], num_warehouses=3)
    assert [(h.start, h.stop) for h in dock.warehouses] == [(0, 3), (3, 7), (7, 10)]
    perm = torch.randperm(10)
    dock.put({"x": torch.arange(10.0)}, perm)
    value_at = torch.empty(10).index_copy_(0, perm, torch.arange(10.0))  # row perm[i] holds i
    for house in dock.warehouses:
        stored, lengths = house.get(["x"], torch.arange(house.start, house.stop))["x"]
        assert lengths is None and torch.equal(stored, value_at[house.start : house.stop])
    batch, _idx = dock.get("c", ["x"], 10)
    assert sorted(batch["x"].tolist()) == [float(i) for i in range(10)]


def _traced_lines(capacity: int, balance: str) -> int:
    dock = TransferDock(capacity // 8, 8, columns=["r"], consumers=["c"])
    dock.put({"r": torch.zeros(capacity, 3)}, torch.arange(capacity))
    lines = 0

    def tracer(frame, event, arg):
        nonlocal lines
        if event == "line" and "rlcore" in frame.f_code.co_filename:
            lines += 1
        return tracer

    sys.settrace(tracer)
    try:
        _, idx = dock.get("c", ["r"], 256, balance=balance)
    finally:
        sys.settrace(None)
    assert idx.numel() == 256
    return lines


@pytest.mark.parametrize("balance", ["random", "fifo", "tokens"])
def test_get_runs_no_python_loop_over_the_table(balance):
    # The same Python lines run for a table of 1,024 rows and one of 32,768: the work that
    # grows with capacity happens inside tensor ops, never row by row in Python.
    assert _traced_lines(1024, balance) == _traced_lines(32768, balance)


# ---------------------------------------------------------------------------- properties


def _run_against_model(dock, model_ops) -> None:
    model = TransferDockRef(4, 3, ["c0", "c1"])
    counter = 0
    for op in model_ops:
        if op[0] == "put":
            _, column, rows = op
            values = []
            for _ in rows:
                counter += 1
                values.append(torch.arange(counter % 4 + 1) + counter)
            try:
                model.put({column: values}, rows)
            except ValueError:
                with pytest.raises(ValueError, match="already ready"):
                    dock.put({column: values}, rows)
            else:
                dock.put({column: values}, rows)
        elif op[0] == "nack":
            _, consumer, rows = op
            try:
                model.nack(consumer, rows)
            except ValueError:
                with pytest.raises(ValueError, match="not taken"):
                    dock.nack(consumer, rows)
            else:
                dock.nack(consumer, rows)
        elif op[0] == "get":
            _, consumer, columns, units, by_group = op
            count = units * 3 if by_group else units
            batch, idx = dock.get(consumer, list(columns), count, by_group=by_group, balance="fifo")
            want = model.get(consumer, columns, count, by_group=by_group)
            assert idx.tolist() == want
            for pos, row in enumerate(want):
                for column in columns:
                    value = model.value(row, column)
                    assert torch.equal(batch[column][pos, : value.numel()], value)
                    assert int(batch[f"{column}_mask"][pos].sum()) == value.numel()
        elif op[0] == "incomplete":
            flags = [False] * len(op[1])
            dock.set_completed(op[1], torch.tensor(flags))
            model.set_completed(op[1], flags)
        else:
            dock.reset(keep=list(op[1]))
            model.reset(op[1])
            assert dock.age.tolist() == model.age
        for consumer in ("c0", "c1"):
            assert dock.all_consumed(consumer) == (len(model.taken[consumer]) == model.capacity)


@given(model_ops=dock_programs())
@settings(max_examples=40)
def test_fifo_matches_loop_model_embedded(model_ops):
    _run_against_model(TransferDock(4, 3, columns=["a", "b"], consumers=["c0", "c1"], num_warehouses=2), model_ops)


@given(model_ops=dock_programs())
@settings(max_examples=15)
def test_fifo_matches_loop_model_ray(ray_docks, model_ops):
    _run_against_model(ray_docks.make(4, 3, columns=["a", "b"], consumers=["c0", "c1"], num_warehouses=2), model_ops)


def _exactly_once(dock, case) -> None:
    n, capacity = case["n_samples"], case["num_prompts"] * case["n_samples"]
    consumers = ["reward", "update"]
    unit = n if case["by_group"] else 1
    count = min(case["units"], capacity // unit) * unit
    received = {c: [] for c in consumers}
    errors = []

    def produce(chunks):
        for rows in chunks:
            dock.put({"responses": [torch.full((row % 3 + 1,), row) for row in rows], "row": torch.tensor(rows)}, rows)

    def consume(consumer):
        try:
            while not dock.all_consumed(consumer):
                # A short timeout: when the rows left are fewer than count, give up on them.
                batch, idx = dock.get(
                    consumer,
                    ["responses", "row"],
                    count,
                    by_group=case["by_group"],
                    balance=case["balance"],
                    timeout=0.05,
                )
                if idx.numel() == 0:
                    if producers_done.is_set() and capacity - len(received[consumer]) < count:
                        return
                    time.sleep(0.001)
                    continue
                assert batch["row"].tolist() == idx.tolist()
                assert (batch["responses"][:, 0] == idx).all()
                received[consumer].extend(idx.tolist())
        except Exception as err:  # surfaced in the main thread
            errors.append(err)

    producers_done = threading.Event()
    producers = [
        threading.Thread(target=produce, args=(case["chunks"][k :: case["producers"]],))
        for k in range(case["producers"])
    ]
    workers = [
        threading.Thread(target=consume, args=(c,)) for c in consumers for _ in range(case["threads_per_consumer"])
    ]
    for thread in workers + producers:
        thread.start()
    for thread in producers:
        thread.join()
    producers_done.set()
    for thread in workers:
        thread.join(60)
    assert not errors, errors
    for consumer in consumers:
        got = received[consumer]
        assert len(got) == len(set(got)), f"{consumer} got a row twice"
        if capacity % count == 0:
            assert sorted(got) == list(range(capacity)), f"{consumer} lost rows"
        if case["by_group"]:
            groups = torch.bincount(torch.tensor(got, dtype=torch.int64) // n, minlength=case["num_prompts"])
            assert ((groups == 0) | (groups == n)).all()


@given(case=dock_interleavings())
@settings(max_examples=25)
def test_threads_deliver_each_row_exactly_once_embedded(case):
    _exactly_once(
        TransferDock(
            case["num_prompts"],
            case["n_samples"],
            columns=["responses", "row"],
            consumers=["reward", "update"],
            seed=case["seed"],
        ),
        case,
    )


@given(case=dock_interleavings())
@settings(max_examples=10)
def test_threads_deliver_each_row_exactly_once_ray(ray_docks, case):
    _exactly_once(
        ray_docks.make(
            case["num_prompts"], case["n_samples"], columns=["responses", "row"], consumers=["reward", "update"]
        ),
        case,
    )


# ---------------------------------------------------------------------------- defect 9: races and semantics


def _slow(house, method, delay, *, after=False):
    """Make ``house.method`` sleep ``delay`` s before (or after) doing its work: a fetch or store in flight."""
    inner = getattr(house, method)

    def slow(*args, **kwargs):
        if not after:
            time.sleep(delay)
        out = inner(*args, **kwargs)
        if after:
            time.sleep(delay)
        return out

    setattr(house, method, slow)


def test_defect9_reset_waits_for_a_get_in_flight():
    dock = TransferDock(2, 2, consumers=["c"], num_warehouses=2)
    dock.put({"x": torch.arange(4.0)}, range(4))
    for house in dock.warehouses:
        _slow(house, "get", 0.3)  # the rows are picked, their payloads not yet read
    got, errors = {}, []

    def consume():
        try:
            got["batch"] = dock.get("c", ["x"], 4, balance="fifo")
        except Exception as err:  # surfaced below
            errors.append(err)

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(0.1)
    dock.reset()  # concurrent with the get: waits for it instead of clearing its rows under it
    thread.join(60)
    assert not errors, errors
    batch, idx = got["batch"]
    assert idx.tolist() == [0, 1, 2, 3] and batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert dock.free_rows().tolist() == [0, 1, 2, 3] and not dock.state()["consumed"]["c"].any()


def test_defect9_reset_waits_for_a_put_in_flight():
    dock = TransferDock(2, 1, consumers=["c"])
    _slow(dock.warehouses[0], "put", 0.3, after=True)  # stored, not yet marked ready
    thread = threading.Thread(target=lambda: dock.put({"x": torch.tensor([1.0, 2.0])}, [0, 1]))
    thread.start()
    time.sleep(0.1)
    dock.reset()
    thread.join(60)
    # The put finished before the reset started its work: the reset cleared it whole, so no row is
    # marked ready without its data.
    assert dock.free_rows().tolist() == [0, 1]
    assert dock.get("c", ["x"], 1, by_group=False)[1].numel() == 0
    dock.put({"x": torch.tensor([3.0, 4.0])}, [0, 1])
    assert dock.get("c", ["x"], 2, by_group=False, balance="fifo")[0]["x"].tolist() == [3.0, 4.0]


def test_defect9_reset_concurrent_with_gets_and_puts_never_crashes(make_dock):
    dock = make_dock(8, 1, columns=["x"], consumers=["c"])
    errors, stop = [], threading.Event()

    def consume():
        try:
            while not stop.is_set():
                batch, idx = dock.get("c", ["x"], 2, by_group=False, timeout=0.01)
                if idx.numel():
                    assert batch["x"].tolist() == idx.to(torch.float32).tolist()
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=consume) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(15):
            dock.put({"x": torch.arange(8.0)}, range(8))
            dock.reset()
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not errors, errors


def test_defect9_reset_refuses_after_its_timeout_and_changes_nothing():
    dock = TransferDock(2, 1, consumers=["c"])
    dock.put({"x": torch.arange(2.0)}, [0, 1])
    _slow(dock.warehouses[0], "get", 1.0)
    thread = threading.Thread(target=lambda: dock.get("c", ["x"], 2, by_group=False))
    thread.start()
    time.sleep(0.1)
    before = dock.state()
    with pytest.raises(RuntimeError, match="reset: .*still in progress"):
        dock.reset(timeout=0.2)
    assert_state_equal(before, dock.state())
    thread.join(60)
    dock.reset()
    assert dock.free_rows().tolist() == [0, 1]


@pytest.mark.parametrize("mode", ["indexes", "count", "count by group", "tokens packed"])
def test_defect9_get_of_a_declared_column_waits_for_its_first_put(make_dock, mode):
    dock = make_dock(2, 2, columns=["x"], consumers=["c"])
    kwargs = {
        "indexes": dict(indexes=[2, 3], by_group=False, timeout=10),
        "count": dict(count=2, by_group=False, timeout=10),
        "count by group": dict(count=2, timeout=10),
        "tokens packed": dict(count=2, timeout=10, balance="tokens", packed=True),
    }[mode]
    result, errors = {}, []

    def consume():
        try:
            result["got"] = dock.get("c", ["x"], **kwargs)
        except Exception as err:  # surfaced below
            errors.append(err)

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and not errors, errors
    dock.put({"x": [tokens(7), tokens(8, 9)]}, [2, 3])
    thread.join(60)
    assert not errors, errors
    _batch, idx = result["got"]
    assert sorted(idx.tolist()) == [2, 3]


def test_defect9_first_put_of_new_columns_races_no_reader():
    # Readers iterate the column table while puts add columns to it.
    dock = TransferDock(4, 1, consumers=["c"])
    errors, stop = [], threading.Event()

    def read():
        try:
            while not stop.is_set():
                dock.free_rows()
                dock.state()
        except Exception as err:  # surfaced below
            errors.append(err)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for k in range(300):
            dock.put({f"col{k}": torch.zeros(1)}, [k % 4])
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors


def test_defect9_second_put_to_a_ready_row_raises_and_changes_nothing(make_dock):
    dock = make_dock(2, 2, consumers=["c"], num_warehouses=2)
    dock.put({"x": torch.arange(4.0)}, range(4))
    before = dock.state()
    with pytest.raises(ValueError, match=r"indexes: got row\(s\) \[1, 3\] whose column 'x' is already ready"):
        dock.put({"y": torch.zeros(2), "x": torch.full((2,), 9.0)}, [1, 3])
    assert_state_equal(before, dock.state())
    batch, _idx = dock.get("c", ["x"], 4, balance="fifo")
    assert batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    # After a reset the cells are free again.
    dock.reset()
    dock.put({"x": torch.full((4,), 5.0)}, range(4))
    dock.add_consumer("d")
    assert dock.get("d", ["x"], 4)[0]["x"].tolist() == [5.0] * 4


def test_defect9_nack_returns_rows_for_delivery_again(make_dock):
    dock = make_dock(3, 2, consumers=["c", "other"])
    dock.put({"x": torch.arange(6.0)}, range(6))
    _batch, idx = dock.get("c", ["x"], 2, balance="fifo")
    assert idx.tolist() == [0, 1]
    dock.nack("c", idx)  # the consumer could not process them
    assert not dock.state()["consumed"]["c"].any()
    batch, again = dock.get("c", ["x"], 6, balance="fifo")
    assert sorted(again.tolist()) == list(range(6)) and dock.all_consumed("c")
    assert batch["x"].tolist() == again.to(torch.float32).tolist()
    # Only rows this consumer holds can go back; a bad nack changes nothing.
    before = dock.state()
    for bad, match in (
        (lambda: dock.nack("other", [0, 1]), r"indexes: got row\(s\) \[0, 1\] not taken by 'other'"),
        (lambda: dock.nack("c", [0, 7]), "indexes"),
        (lambda: dock.nack("nobody", [0]), "consumer"),
        (lambda: dock.nack("c", [0, 0]), "indexes"),
    ):
        with pytest.raises(ValueError, match=match):
            bad()
        assert_state_equal(before, dock.state())


def test_defect9_nack_wakes_a_waiting_get(make_dock):
    dock = make_dock(2, 1, consumers=["c"])
    dock.put({"x": torch.arange(2.0)}, [0, 1])
    dock.get("c", ["x"], 2, by_group=False)
    result = {}
    # Every row is taken: only a nack can satisfy this get.
    thread = threading.Thread(
        target=lambda: result.setdefault("got", dock.get("c", ["x"], 1, by_group=False, timeout=10))
    )
    thread.start()
    time.sleep(0.2)
    assert thread.is_alive()
    dock.nack("c", [1])
    thread.join(60)
    batch, idx = result["got"]
    assert idx.tolist() == [1] and batch["x"].tolist() == [1.0]


# ---------------------------------------------------------------------------- defect 2: many waiting clients


def test_defect2_ray_dock_200_waiters_do_not_deadlock(ray_docks):
    # Gets with explicit indexes wait inside the controller's host; waiting must not hold
    # what writers need. 200 clients wait at once, then one put makes every row ready.
    waiters = 200
    dock = ray_docks.make(waiters, 1, columns=["x"], consumers=["c"])
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def wait_for(row: int) -> None:
        try:
            batch, idx = dock.get("c", ["x"], indexes=[row], timeout=60)
            got[row] = [idx.tolist(), batch["x"].tolist()]
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=wait_for, args=(r,), daemon=True) for r in range(waiters)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the clients are now waiting in the host
    put = threading.Thread(target=lambda: dock.put({"x": torch.arange(float(waiters))}, range(waiters)), daemon=True)
    put.start()
    put.join(60)
    assert not put.is_alive(), "the put never got through: the waiting clients hold the host"
    deadline = time.monotonic() + 15
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not errors, errors[:3]
    assert sorted(got) == list(range(waiters))
    assert all(got[r] == [[r], [float(r)]] for r in range(waiters))


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, "1", True])
def test_reset_and_get_reject_bad_timeouts(make_dock, timeout):
    dock = make_dock(2, 1, columns=["x"], consumers=["c"])
    with pytest.raises(ValueError, match="timeout"):
        dock.reset(timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        dock.get("c", ["x"], 1, by_group=False, timeout=timeout)


def test_infinite_timeout_waits_without_overflow(make_dock):
    dock = make_dock(2, 1, columns=["x"], consumers=["c"])
    timer = threading.Timer(0.2, lambda: dock.put({"x": torch.ones(1)}, [1]))
    timer.start()
    _batch, idx = dock.get("c", ["x"], 1, by_group=False, timeout=float("inf"))
    timer.join()
    assert idx.tolist() == [1]
    dock.reset(timeout=float("inf"))


# ---------------------------------------------------------------------------- re-probe of issue 18


def test_reprobe_index_beyond_int64_names_indexes(make_dock):
    # torch's "Overflow when unpacking long long", naming nothing.
    dock = make_dock(1, 2, columns=["a"], consumers=["c"])
    with pytest.raises(ValueError, match=r"indexes: got .*expected a 1-D integer tensor or a sequence of ints"):
        dock.put({"a": torch.ones(1)}, [2**70])
    with pytest.raises(ValueError, match=r"indexes: got"):
        dock.nack("c", [-(2**70)])


def test_reprobe_ray_dock_use_after_close_raises_naming_the_closed_dock(ray_docks):
    # Use after close gave a raw KeyError of the part's key (or Ray's ActorDiedError), and a
    # get waiting on explicit indexes when the dock closed waited for ever.
    dock = ray_docks.make(1, 2, columns=["a"], consumers=["c"])
    copy = pickle.loads(pickle.dumps(dock))  # another client, e.g. in a Ray task
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            dock.get("c", ["a"], indexes=[0, 1])
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(1.0)
    dock.close()
    thread.join(60)
    assert not thread.is_alive(), "a get waiting when the dock closed never returned"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError) and "closed" in str(outcome[0])
    for client in (dock, copy):
        with pytest.raises(RuntimeError, match="closed"):
            client.get("c", ["a"], 2)
        with pytest.raises(RuntimeError, match="closed"):
            client.put({"a": torch.ones(2)}, [0, 1])
    dock.close()  # twice: nothing more to do


def test_reprobe_ray_dock_hosts_must_be_host_actors(ray_docks):
    with pytest.raises(ValueError, match=r"hosts: got \[1\], expected a non-empty list of actors from start_hosts"):
        RayTransferDock(1, 2, hosts=[1])


@st.composite
def _warehouse_ops(draw):
    """Puts (a block tensor or a list of rows, at a run or scattered rows) and gets (a run or a tensor)."""
    ops = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            if draw(st.booleans()):
                a = draw(st.integers(2, 13))
                rows = list(range(a, draw(st.integers(a + 1, 14))))
            else:
                rows = draw(st.lists(st.integers(2, 13), min_size=1, max_size=6, unique=True))
            ops.append(("put", rows, draw(st.booleans()), draw(st.integers(0, 10**6))))
        else:
            a = draw(st.integers(2, 13))
            b = draw(st.integers(a, 14))
            ops.append(("get", range(a, b) if draw(st.booleans()) else torch.randperm(b - a) + a))
    return ops


@settings(max_examples=120, deadline=None)
@given(ops=_warehouse_ops())
def test_warehouse_gets_of_runs_and_rows_match_a_dict_of_rows(ops) -> None:
    # A run of rows inside one block's run is read as a slice; any other get row by row.
    house, ref = Warehouse(2, 14), {}
    for op in ops:
        if op[0] == "put":
            _, rows, as_block, seed = op
            values = torch.randint(0, 100, (len(rows), 3), generator=torch.Generator().manual_seed(seed))
            index = range(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else torch.tensor(rows)
            house.put({"x": values if as_block else list(values)}, index)
            ref.update({r: values[i] for i, r in enumerate(rows)})
            continue
        index = op[1]
        wanted = list(index) if isinstance(index, range) else index.tolist()
        if not wanted or any(r not in ref for r in wanted):
            continue
        rows, lengths = house.get(["x"], index)["x"]
        # A block's rows come as they are (lengths: their width), others flattened (lengths per row).
        assert lengths == 3 if isinstance(lengths, int) else lengths == [3] * len(wanted)
        assert torch.equal(rows.view(len(wanted), 3), torch.stack([ref[r] for r in wanted]))
        rows.fill_(-1)  # a fresh copy: the next get is unchanged
        assert torch.equal(house.get(["x"], index)["x"][0].view(len(wanted), 3), torch.stack([ref[r] for r in wanted]))


def test_a_run_out_of_range_is_refused_from_its_bounds():
    dock = TransferDock(2, 2, consumers=["c"], columns=["x"])  # capacity 4
    with pytest.raises(ValueError, match=r"indexes: got row\(s\) \[4, 5, 6, 7, 8\], expected indexes in \[0, 4\)"):
        dock.get("c", ["x"], indexes=range(2, 10**15))  # not walked element by element
    with pytest.raises(ValueError, match=r"got row\(s\) \[-2, -1\]"):
        dock.get("c", ["x"], indexes=range(-2, 3))
