"""Deployment modes: co-located stages switching through AllGather-Swap; rollout disaggregated into a process."""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from rlcore.dataflow import RolloutWorker, StageGraph, StageTimeout, colocate, run_pipeline, stage
from rlcore.dataflow.layout import decoder_layout
from rlcore.dataflow.reshard import plan_reshard
from rlcore.memory import ColocatedSwitch, TrainState, allgather_swap_plan
from tiny_runs import SMALLEST_STEP, TINY_MODEL

# --------------------------------------------------------------------------- co-located


def _colocated_run(switching):
    """Rollout with the inference weights, SGD update with the training params; both on one device group."""
    w = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.zeros_like(w)
    seen = {"rollout_resident": [], "train_resident": []}
    if switching:
        plan = allgather_swap_plan(
            plan_reshard(
                {"lm_head.weight": w}, decoder_layout({"lm_head.weight": w}), decoder_layout({"lm_head.weight": w})
            ),
            mesh=None,
            device="cpu",
            rank=0,
        )
        switch = ColocatedSwitch(TrainState({"lm_head.weight": w}, grads=[w.grad], optimizer=opt.state), plan)
    else:
        switch = None

    def rollout(b):
        weights = switch.weights["lm_head.weight"] if switching else w.detach()
        seen["rollout_resident"].append(w.untyped_storage().nbytes())
        return {"responses": b["prompts"].double().unsqueeze(1) * weights.sum(0).double()}

    def update(b):
        seen["train_resident"].append(w.untyped_storage().nbytes())
        loss = (w.double().sum(0) * b["responses"]).sum() * 1e-3
        loss.backward()
        return {"loss": loss.detach().expand(b["responses"].shape[0]).clone()}

    def step(j):
        opt.step()
        opt.zero_grad(set_to_none=False)

    stages = colocate(
        [
            stage(rollout, inputs=["prompts"], outputs=["responses"], role="rollout", micro_batch=2, resource="gen"),
            stage(
                lambda b: {"scores": b["responses"].sum(1)},
                inputs=["responses"],
                outputs=["scores"],
                name="reward",
                micro_batch=1,
                resource="cpu",
            ),
            stage(
                update,
                inputs=["responses", "scores"],
                outputs=["loss"],
                role="update",
                micro_batch=2,
                resource="train",
                on_iteration_end=step,
            ),
        ]
    )
    res = run_pipeline(
        StageGraph(stages),
        lambda j: {"prompts": torch.arange(4) + j},
        num_prompts=4,
        num_iterations=3,
        collect=["responses", "loss"],
        switch=switch,
    )
    return res, switch, seen, w.detach().clone()


def test_colocated_switches_through_allgather_swap_and_matches_the_unswitched_run():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        res, switch, seen, w = _colocated_run(True)
    finally:
        dist.destroy_process_group()
    plain, _, plain_seen, plain_w = _colocated_run(False)
    assert [
        s.resource for s in StageGraph(colocate([stage(print, inputs=["prompts"], outputs=["x"], name="a")])).order
    ] == ["device"]
    # the training state is swapped out during every rollout call and resident during every update call
    assert set(seen["rollout_resident"]) == {0} and 0 not in seen["train_resident"]
    assert set(plain_seen["rollout_resident"]) == {16}
    assert switch.transitions == [("train", "rollout"), ("rollout", "train")] * 3
    assert res.switches == [("device", "rollout", "train"), ("device", "train", "rollout")] * 2 + [
        ("device", "rollout", "train")
    ]
    torch.testing.assert_close(w, plain_w, rtol=0, atol=0)
    for a, b in zip(res.batches, plain.batches):
        torch.testing.assert_close(a["responses"], b["responses"], rtol=0, atol=0)
        torch.testing.assert_close(a["loss"], b["loss"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="weights: the switch is in phase 'train', expected 'rollout'"):
        _ = switch.weights
    with pytest.raises(ValueError, match="got phase 'ref' on resource 'device'"):
        switch("device", "train", "ref")


# --------------------------------------------------------------------------- disaggregated


def make_generate(mode):
    """Runs in the worker process: responses = prompts * w + 0.5, failing or hanging on request."""

    def generate(batch, params):
        if mode == "raise" and int(batch["policy_version"].max()) >= 1:
            raise ValueError("boom in generate")
        if mode == "hang":
            time.sleep(30)
        if mode == "exit":
            os._exit(3)
        return {"responses": batch["prompts"].double() * params["w"] + 0.5}

    return generate


def _disaggregated(worker, *, staleness=1, timeout=None, iterations=4):
    w = torch.tensor(1.0, dtype=torch.float64)
    worker.publish(0, {"w": w})

    def update(b):
        time.sleep(0.01)
        return {"loss": b["responses"] * 2}

    def step(j):
        w.add_(1.0)
        worker.publish(j + 1, {"w": w})

    graph = StageGraph(
        [
            worker.stage(inputs=["prompts"], outputs=["responses"], micro_batch=2, timeout=timeout),
            stage(
                update,
                inputs=["responses"],
                outputs=["loss"],
                role="update",
                micro_batch=2,
                resource="train",
                on_iteration_end=step,
            ),
        ]
    )
    return run_pipeline(
        graph,
        lambda j: {"prompts": torch.arange(6) + 10 * j},
        num_prompts=6,
        num_iterations=iterations,
        staleness=staleness,
        collect=["prompts", "responses"],
        join_timeout=2.0,
    )


def test_disaggregated_rollout_generates_each_row_with_the_version_it_records():
    with RolloutWorker(make_generate, args=("ok",)) as worker:
        res = _disaggregated(worker)
        with pytest.raises(ValueError, match=r"version: got 4, expected 5 \(the next version after 4\)"):
            worker.publish(4, {"w": torch.tensor(0.0)})
        with pytest.raises(ValueError, match="version: got 7, expected 5"):
            worker.publish(7, {"w": torch.tensor(0.0)})
    assert not worker.process.is_alive()
    for j, b in enumerate(res.batches):
        v = b["policy_version"]
        assert bool(((j - v >= 0) & (j - v <= 1)).all())
        # version v means weights w = 1 + v, so the rows prove which weights generated them
        torch.testing.assert_close(b["responses"], b["prompts"].double() * (1 + v) + 0.5, rtol=0, atol=0)
    assert any(int(b["policy_version"][0]) < j for j, b in enumerate(res.batches))  # some rows were off-policy


def _no_worker_threads():
    end = time.monotonic() + 5
    while time.monotonic() < end and [t for t in threading.enumerate() if t.name.startswith("rlcore-pipeline-")]:
        time.sleep(0.01)
    return not [t for t in threading.enumerate() if t.name.startswith("rlcore-pipeline-")]


@pytest.mark.parametrize(
    "mode, error, match",
    [
        ("raise", ValueError, "boom in generate"),
        ("exit", RuntimeError, "stage 'rollout': rollout worker process exited with code 3"),
        ("hang", StageTimeout, "stage 'rollout' timed out after 0.5 s"),
    ],
)
def test_disaggregated_faults_stop_the_pipeline_and_leave_no_process_or_thread(mode, error, match):
    worker = RolloutWorker(make_generate, args=(mode,), join_timeout=2.0)
    try:
        with pytest.raises(error, match=match) as info:
            _disaggregated(worker, timeout=0.5 if mode == "hang" else None)
    finally:
        worker.close()
    assert not worker.process.is_alive()
    assert _no_worker_threads()
    if mode == "raise":
        assert any(n.startswith("in stage 'rollout' at iteration ") for n in info.value.__notes__)
        assert any("rollout worker process" in n for n in info.value.__notes__)


def test_worker_rejects_rows_stamped_with_an_unpublished_version():
    with RolloutWorker(make_generate, args=("ok",), start_method="fork") as worker:
        graph = StageGraph([worker.stage(inputs=["prompts"], outputs=["responses"])])
        with pytest.raises(ValueError, match="policy version 0, but only up to -1 was published"):
            run_pipeline(graph, lambda j: {"prompts": torch.arange(2)}, num_prompts=2)


def make_broken():
    raise OSError("no model here")


def test_wait_ready_raises_the_factory_error_and_returns_once_built():
    with (
        RolloutWorker(make_broken, start_method="fork") as worker,
        pytest.raises(OSError, match="no model here") as info,
    ):
        worker.wait_ready(timeout=120)
    assert any("rollout worker process" in n for n in info.value.__notes__)
    with RolloutWorker(make_generate, args=("ok",), start_method="fork") as worker:
        worker.wait_ready(timeout=120)
        worker.wait_ready(timeout=120)  # already ready: returns at once
        assert worker.process.is_alive()


# --------------------------------------------------------------------------- issue 30: no leak on kill -9

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _descendants(pid):
    """Live descendants of ``pid`` (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        children = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [pid]
        while todo:
            kids = children.get(todo.pop(), [])
            out += kids
            todo += kids
        return out
    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_9_and_wait_for(proc, pids, seconds):
    import signal

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:  # do not leak them into the next tests
        os.kill(p, 9)
    return left


_OWNER = """
import sys, time
from rlcore.dataflow import RolloutWorker
sys.path.insert(0, sys.argv[1])
from test_deploy import make_generate
worker = RolloutWorker(make_generate, args=("ok",))
worker.wait_ready(timeout=120)
print(worker.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_reprobe30_the_rollout_worker_dies_with_its_parent_on_kill_9():
    # The worker (and the resource tracker it holds open) lived on for minutes.
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, tests], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        worker = int(proc.stdout.readline())
        pids = _descendants(proc.pid)
        assert worker in pids and len(pids) >= 2, pids  # the worker and the resource tracker
    finally:
        pids = _descendants(proc.pid)
        left = _kill_9_and_wait_for(proc, pids, 5.0)
    assert not left, f"alive 5 s after the parent's kill -9: {left}"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_reprobe30_kill_9_of_a_disaggregated_trainer_leaves_no_process(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    overrides = [
        *TINY_MODEL,
        *SMALLEST_STEP,
        "trainer.progress=false",
        "trainer.plot=false",
        "trainer.steps=100000",
        "trainer.save_every=0",
        "deploy.mode=disaggregated",
        f"trainer.output_dir={out}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    config = str(ROOT / "configs" / "grpo_tiny.yaml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlcore.train", "--config", config, *overrides],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = out / "metrics.jsonl"
    try:
        end = time.monotonic() + 180
        while time.monotonic() < end and not (metrics.is_file() and metrics.stat().st_size > 0):
            assert proc.poll() is None, "the trainer exited before its first step"
            time.sleep(0.2)
        pids = _descendants(proc.pid)
        assert len(pids) >= 2, pids  # the rollout worker, the reward worker, the resource tracker
    finally:
        pids = _descendants(proc.pid)
        left = _kill_9_and_wait_for(proc, pids, 5.0)
    assert not left, f"alive 5 s after the trainer's kill -9: {left}"


# --------------------------------------------------------------------------- re-probe: workers that ignore or lie


def make_sigterm_deaf():
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def generate(batch, params):
        time.sleep(600)

    return generate


def make_unpicklable():
    def generate(batch, params):
        return {"responses": lambda: None}

    return generate


def test_reprobe30_close_kills_a_worker_that_ignores_sigterm():
    # close() terminated, waited, and returned with the worker still alive: a leaked process.
    worker = RolloutWorker(make_sigterm_deaf, join_timeout=0.5)
    try:
        worker.wait_ready(timeout=120)
        worker._jobs.put(({"prompts": torch.zeros(1)}, -1))
        time.sleep(0.3)
        worker.close()
        assert not worker.process.is_alive()
    finally:
        if worker.process.is_alive():
            worker.process.kill()


def test_reprobe30_an_unpicklable_rollout_result_raises_instead_of_hanging():
    # The queue's feeder thread printed the pickling error and dropped the result: the caller waited for ever.
    with RolloutWorker(make_unpicklable, join_timeout=2.0) as worker:
        worker.wait_ready(timeout=120)
        worker.publish(0, {"w": torch.zeros(2)})
        done: list = []

        def call():
            try:
                worker._call("rollout", {"policy_version": torch.tensor([0])})
            except Exception as err:
                done.append(err)

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the call is still waiting for a result that was dropped"
        assert isinstance(done[0], RuntimeError)
        assert "could not be sent to the trainer" in str(done[0]) and "pickle" in str(done[0])


def make_sys_exit():
    raise SystemExit(4)


def make_nothing():
    return None


def test_reprobe30_worker_exits_and_misuse_raise_named_errors():
    # A factory's SystemExit came back to the caller as a bare SystemExit (ending a trainer silently), a
    # factory returning no function failed later with "'NoneType' object is not callable", and a closed
    # worker answered "Queue <object at 0x...> is closed".
    with RolloutWorker(make_sys_exit, join_timeout=2.0) as worker, pytest.raises(RuntimeError, match="SystemExit: 4"):
        worker.wait_ready(timeout=120)
    with (
        RolloutWorker(make_nothing, join_timeout=2.0) as worker,
        pytest.raises(ValueError, match="factory: returned NoneType, expected a generate"),
    ):
        worker.wait_ready(timeout=120)
    worker = RolloutWorker(make_generate, args=("ok",), join_timeout=2.0)
    worker.close()
    worker.close()  # twice: nothing
    for call in (
        lambda: worker.publish(0, {"w": torch.zeros(1)}),
        lambda: worker._call("rollout", {"policy_version": torch.tensor([0])}),
    ):
        with pytest.raises(RuntimeError, match="rollout worker: already closed"):
            call()
    assert not worker.process.is_alive()
