import copy
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.memory import offload, reload
from rlcore.pytree import tree_leaves
from rlcore.testing.memory_strategies import tensor_trees
from rlcore.testing.reference.resharding import swap_roundtrip_ref


def _leaves(tree):
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


@given(tensor_trees())
def test_roundtrip_restores_same_objects_bit_identical(tree):
    leaves = _leaves(tree)
    want = swap_roundtrip_ref(tree)
    ids = [id(x) for x in leaves]
    meta = [(x.shape, x.stride(), x.storage_offset(), x.dtype) for x in leaves]
    handle = offload(tree)
    assert all(x.untyped_storage().nbytes() == 0 for x in leaves)
    back = reload(handle)
    assert back is tree
    got = _leaves(back)
    assert [id(x) for x in got] == ids
    assert [(x.shape, x.stride(), x.storage_offset(), x.dtype) for x in got] == meta
    for g, w in zip(got, _leaves(want)):
        assert torch.equal(g, w)


@given(tensor_trees())
def test_one_contiguous_bucket_per_dtype_holding_each_storage_once(tree):
    leaves = _leaves(tree)
    unique = {}
    for x in leaves:
        if x.untyped_storage().nbytes():
            unique.setdefault(x.untyped_storage().data_ptr(), x)
    want_bytes = sum(x.untyped_storage().nbytes() for x in unique.values())
    per_dtype = {}
    for x in unique.values():
        per_dtype[x.dtype] = per_dtype.get(x.dtype, 0) + x.untyped_storage().nbytes()
    handle = offload(tree)
    assert handle.nbytes == want_bytes
    assert set(handle.buckets) == set(per_dtype)
    for dt, b in handle.buckets.items():
        assert b.dtype == dt and b.is_contiguous() and b.dim() == 1
        assert b.numel() * b.element_size() == per_dtype[dt]
        assert b.is_pinned() == torch.accelerator.is_available()
    reload(handle)


def _train(model, opt, xs, swap_between):
    losses = []
    for x in xs:
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
        if swap_between:
            state = {
                "params": list(model.parameters()),
                "grads": [p.grad for p in model.parameters()],
                "optimizer": list(opt.state.values()),
            }
            handle = offload(state)
            assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
            reload(handle)
    return torch.stack(losses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_state_survives_swap_between_steps(dtype):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    swapped = copy.deepcopy(base)
    xs = [torch.randn(5, 8, dtype=dtype) for _ in range(4)]
    opt_a = torch.optim.AdamW(base.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(swapped.parameters(), lr=1e-2)
    la = _train(base, opt_a, xs, swap_between=False)
    lb = _train(swapped, opt_b, xs, swap_between=True)
    assert torch.equal(la, lb)
    for pa, pb in zip(base.parameters(), swapped.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa.grad, pb.grad)
        for k in opt_a.state[pa]:
            assert torch.equal(opt_a.state[pa][k], opt_b.state[pb][k])


def test_optimizer_keeps_references_to_the_same_tensors():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state_ids = {id(v) for s in opt.state.values() for v in s.values()}
    reload(offload([list(model.parameters()), list(opt.state.values())]))
    assert {id(v) for s in opt.state.values() for v in s.values()} == state_ids
    assert all(p in opt.state for p in model.parameters())


def test_non_tensor_leaves_are_ignored():
    t = torch.arange(3)
    handle = offload({"t": t, "lr": 0.1, "name": "w"})
    assert handle.nbytes == 24
    assert reload(handle)["lr"] == 0.1 and torch.equal(t, torch.arange(3))


def test_offloading_twice_is_rejected_and_moves_nothing():
    t = torch.ones(4)
    handle = offload([t])
    with pytest.raises(ValueError, match=r"tree: leaf 0 \(shape \(4,\)\) has an empty storage"):
        offload([t])
    reload(handle)
    assert torch.equal(t, torch.ones(4))


def test_reloading_twice_is_rejected():
    handle = offload([torch.ones(2)])
    reload(handle)
    with pytest.raises(ValueError, match="handle: got a handle that was reloaded already"):
        reload(handle)


def test_non_resizable_storage_is_rejected_before_anything_moves():
    import numpy as np  # a runtime dependency of rlcore

    ok = torch.ones(3)
    with pytest.raises(ValueError, match="cannot be resized"):
        offload([ok, torch.from_numpy(np.ones(2))])
    assert ok.untyped_storage().nbytes() == 12


def test_mixed_dtype_storage_aliasing_is_rejected():
    a = torch.zeros(4, dtype=torch.float32)
    with pytest.raises(ValueError, match="one dtype per storage"):
        offload([a, a.view(torch.int32)])
    assert a.untyped_storage().nbytes() == 16


def test_reload_rejects_other_objects():
    with pytest.raises(ValueError, match="handle: got dict, expected a SwapHandle"):
        reload({})


@settings(max_examples=10)
@given(st.integers(1, 4))
def test_parameters_of_a_module_keep_working_after_reload(width):
    model = torch.nn.Linear(width, width)
    x = torch.randn(2, width)
    want = model(x)
    reload(offload(dict(model.named_parameters())))
    assert torch.equal(model(x), want)
    assert isinstance(model.weight, torch.nn.Parameter)


# ---------------------------------------------------------------------------- defect 10: touching an offloaded tensor

_TOUCH_SCRIPT = r"""
import copy, io, json, sys
import torch
from rlcore.memory import offload, reload

torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
x = torch.randn(2, 4)
kept_graph = model(x).pow(2).sum()  # recorded before the offload: saves the weight
model(x).sum().backward()
grad_graph = model(x).sum()  # back-propagating it accumulates into the offloaded grads
opt = torch.optim.AdamW(model.parameters())
want = model(x).detach().clone()
one = torch.ones(())
w, g = model.weight, model.weight.grad
handle = offload({"params": list(model.parameters()), "grads": [p.grad for p in model.parameters()], "one": one})

touches = {
    "data": lambda: w.data,
    "arithmetic": lambda: w + 1,
    "reflected arithmetic": lambda: 1 - w,
    "torch function": lambda: torch.add(x[:, :3], g[:2, :3]),
    "in-place": lambda: w.add_(1),
    "indexing": lambda: w[0],
    "index assignment": lambda: w.__setitem__(0, 1.0),
    "numpy": lambda: w.detach().numpy(),
    "module": lambda: model(x),
    "functional": lambda: torch.nn.functional.linear(x, w),
    "sum": lambda: w.sum(),
    "clone": lambda: w.clone(),
    "tolist": lambda: w.tolist(),
    "item": lambda: one.item(),
    "float": lambda: float(one),
    "bool": lambda: bool(one),
    "comparison": lambda: w == 0,
    "iteration": lambda: list(w),
    "to": lambda: w.to(torch.float64),
    "cat": lambda: torch.cat([w, w]),
    "deepcopy": lambda: copy.deepcopy(w),
    "save": lambda: torch.save(w, io.BytesIO()),
    "state_dict": lambda: model.state_dict(),
    "optimizer step": lambda: opt.step(),
    "backward through a saved weight": lambda: kept_graph.backward(),
    "backward into an offloaded grad": lambda: grad_graph.backward(),
}
out = {}
for name, touch in touches.items():
    try:
        touch()
        out[name] = "no error"
    except Exception as err:
        out[name] = f"{type(err).__name__}: {err}"
out["repr"] = repr(w) + " " + str(one)
out["metadata"] = [list(w.shape), str(w.dtype), w.stride(), w.storage_offset(), w.is_contiguous(),
                   w.untyped_storage().nbytes(), w.requires_grad, isinstance(w, torch.nn.Parameter)]
reload(handle)
out["after"] = [type(w) is torch.nn.Parameter, type(one) is torch.Tensor, torch.equal(model(x), want),
                w.stride(), g.stride()]
print(json.dumps(out))
"""


def test_defect10_touching_an_offloaded_tensor_raises_naming_the_offloaded_state(tmp_path):
    # A child process: before the fix these touches segfault (or read freed memory).
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "touch.py"
    script.write_text(_TOUCH_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=dict(os.environ), timeout=120
    )
    assert proc.returncode == 0, f"child exited with {proc.returncode} (a segfault is -11):\n{proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    autograd = ("backward through a saved weight", "backward into an offloaded grad")
    for name, got in out.items():
        if name in ("repr", "metadata", "after"):
            continue
        assert got.startswith("RuntimeError"), (name, got)
        if name not in autograd:  # raised inside torch's autograd engine, which words its own message
            assert "offloaded" in got and "reload" in got, (name, got)
    assert "offloaded" in out["repr"] and "shape (3, 4)" in out["repr"]
    # Metadata stays readable and unchanged; the storage reads as freed.
    assert out["metadata"] == [[3, 4], "torch.float32", [4, 1], 0, True, 0, True, True]
    # After reload: the original classes and strides, and the module computes as before.
    assert out["after"] == [True, True, True, [4, 1], [4, 1]]


@pytest.mark.parametrize(
    "make, kind",
    [
        (lambda: torch.eye(3).to_sparse(), "sparse"),
        (lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    ],
)
def test_non_strided_leaves_are_rejected_before_anything_moves(make, kind):
    ok = torch.ones(3)
    with pytest.raises(ValueError, match=f"tree: leaf 1 is a .*{kind}.* tensor, expected dense strided"):
        offload([ok, make()])
    assert ok.untyped_storage().nbytes() == 12 and type(ok) is torch.Tensor and torch.equal(ok + 0, torch.ones(3))


def test_a_guard_that_fails_midway_leaves_the_tree_as_it_was(monkeypatch):
    import rlcore.memory.swap as swap

    first, second = torch.ones(2), torch.arange(3.0)
    real, calls = swap._guard, []

    def flaky(leaf, storage):
        calls.append(leaf)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(leaf, storage)

    monkeypatch.setattr(swap, "_guard", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        offload([first, second])
    assert type(first) is torch.Tensor and first.untyped_storage().nbytes() == 8
    assert torch.equal(first, torch.ones(2)) and torch.equal(second, torch.arange(3.0))


def test_reprobe_a_view_outside_the_tree_is_refused_before_anything_moves():
    # Offloading x while a view of it lived outside the tree freed the memory the view
    # reads: touching the view then segfaulted the process.
    x = torch.arange(4.0)
    view = x[1:]
    with pytest.raises(ValueError, match=r"held by 1 tensor\(s\) outside the tree"):
        offload({"x": x})
    assert type(x) is torch.Tensor and x.untyped_storage().nbytes() == 16
    assert torch.equal(view + 0, torch.tensor([1.0, 2.0, 3.0])) and torch.equal(x, torch.arange(4.0))
    alias = x.detach()  # an alias is a tensor on the same storage too
    del view
    with pytest.raises(ValueError, match="outside the tree"):
        offload([x])
    # Listed together they move, and come back.
    handle = offload([x, alias])
    assert x.untyped_storage().nbytes() == 0
    reload(handle)
    assert torch.equal(alias, torch.arange(4.0))
    # A listed view's own base is the documented exception: the view moves, the base is not guarded.
    base = torch.arange(6.0)
    handle = offload([base[:3]])
    reload(handle)


def test_reprobe_a_view_held_only_by_garbage_does_not_block_the_offload():
    # Unreachable cycles (a collective's temporaries) may still hold a view: nobody can read it.
    class Box:
        pass

    x = torch.arange(4.0)
    box = Box()
    box.self, box.view = box, x[1:]  # type: ignore[attr-defined]
    del box
    handle = offload({"x": x})
    assert x.untyped_storage().nbytes() == 0
    reload(handle)
    assert torch.equal(x, torch.arange(4.0))


def test_reprobe_a_hold_that_a_backend_thread_drops_a_moment_later_does_not_block_the_offload():
    # gloo's worker thread (NCCL's watchdog on a GPU) holds a collective's input or output
    # for a moment after the call returned; offload refused such a tensor at once.
    x = torch.arange(4.0)
    view = [x[1:]]
    started = threading.Event()

    def backend():
        started.set()
        time.sleep(0.2)
        view.clear()

    thread = threading.Thread(target=backend)
    thread.start()
    started.wait()
    try:
        handle = offload({"x": x})
    finally:
        thread.join()
    assert x.untyped_storage().nbytes() == 0
    reload(handle)
    assert torch.equal(x, torch.arange(4.0))


@settings(deadline=None)
@given(tensor_trees())
def test_host_copies_hold_each_leaf_as_offloaded_and_outlive_the_reload(tree):
    from rlcore.memory import host_copies

    leaves = [x for x in _leaves(tree) if x.untyped_storage().nbytes()]  # offload skips empty storages
    want = [x.clone() for x in leaves]
    handle = offload(tree)
    copies = host_copies(handle)
    assert [id(leaf) for leaf, _ in copies] == list(dict.fromkeys(id(x) for x in leaves))
    by_id = {id(leaf): host for leaf, host in copies}
    reload(handle)
    with torch.no_grad():  # training goes on after the reload: the copies keep the offloaded bytes
        for x in leaves:
            if x.numel():
                x.copy_(torch.ones_like(x) if x.dtype != torch.bool else ~x)
    for x, w in zip(leaves, want):
        host = by_id[id(x)]
        assert host.device.type == "cpu" and host.shape == x.shape and host.dtype == x.dtype
        assert torch.equal(host, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_copies_of_views_and_tied_leaves_share_one_host_copy(dtype):
    from rlcore.memory import host_copies

    base = torch.randn(4, 6).to(dtype)
    tree = {"w": base, "t": base.t(), "row": base[1], "tied": base}
    want = {k: v.clone() for k, v in tree.items()}
    handle = offload(tree)
    copies = host_copies(handle)
    assert len(copies) == 3  # "tied" is the same tensor as "w"
    for leaf, host in copies:
        name = next(k for k, v in tree.items() if v is leaf)
        assert host.stride() == want[name].stride() and torch.equal(host, want[name])
    storages = {host.untyped_storage().data_ptr() for _, host in copies}
    assert len(storages) == 1  # views into the one host bucket, nothing copied again
    reload(handle)
