"""rlcore.memory.EngineSwitch: a co-located engine that frees its own memory, in the memory plan's order.

The engine here records what it sees of the training state at each of its calls, so the
tests check the order (every release before any allocation) as well as the round trip.
"""

import pytest
import torch

from rlcore.memory import EngineSwitch, TrainState, host_copies


class _Engine:
    """Records, at each wake and sleep, whether the training state held device bytes then."""

    def __init__(self, state: dict[str, torch.Tensor], *, fail_wake: bool = False):
        self.state, self.fail_wake = state, fail_wake
        self.calls: list[tuple[str, bool]] = []

    def _resident(self) -> bool:
        return all(t.untyped_storage().nbytes() > 0 for t in self.state.values())

    def wake(self) -> None:
        if self.fail_wake:
            raise RuntimeError("no memory for the KV cache")
        self.calls.append(("wake", self._resident()))

    def sleep(self) -> None:
        self.calls.append(("sleep", self._resident()))


def _trained(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6, dtype=dtype)).square().sum().backward()
    opt.step()
    model(torch.randn(4, 6, dtype=dtype)).square().sum().backward()  # grads of a step not taken yet
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> TrainState:
    params = dict(model.named_parameters())
    return TrainState(params, [p.grad for p in params.values()], list(opt.state.values()))


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = p
        out[f"{name}.grad"] = p.grad
        for key, value in opt.state[p].items():
            out[f"{name}.{key}"] = value
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_state_is_on_the_host_while_the_engine_is_awake_and_back_bit_for_bit(dtype):
    model, opt = _trained(dtype)
    tensors = _flat(model, opt)
    before = {k: v.clone() for k, v in tensors.items()}
    engine = _Engine(tensors)
    handed: list = []
    switch = EngineSwitch(lambda: _state(model, opt), wake=engine.wake, sleep=engine.sleep, on_offload=handed.append)
    for _ in range(2):
        switch("device", switch.phase, "rollout")
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
        assert switch.offloaded_bytes == sum(t.untyped_storage().nbytes() for t in before.values())
        copies = {id(t): host for h in handed[-1] for t, host in host_copies(h)}
        for name, t in tensors.items():  # the offload's host copies hold the state (a background save reads them)
            assert torch.equal(copies[id(t)].view(before[name].shape), before[name])
        switch("device", "rollout", "train")
        for name, t in tensors.items():
            assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    # Woken only with the state away, put to sleep only with the state still away.
    assert engine.calls == [("wake", False), ("sleep", False)] * 2
    assert switch.transitions == [(None, "rollout"), ("rollout", "train"), ("train", "rollout"), ("rollout", "train")]
    model(torch.randn(4, 6, dtype=dtype)).sum().backward()  # the module and the optimizer carry on
    opt.step()


def test_an_engine_built_awake_is_not_woken_again_and_a_repeated_phase_moves_nothing():
    model, opt = _trained(torch.float32)
    tensors = _flat(model, opt)
    engine = _Engine(tensors)
    switch = EngineSwitch(lambda: _state(model, opt), wake=engine.wake, sleep=engine.sleep, awake=True)
    switch("device", None, "rollout")
    switch("device", "rollout", "rollout")
    assert engine.calls == [] and switch.awake
    switch("device", "rollout", "train")
    switch("device", "train", "train")
    assert engine.calls == [("sleep", False)] and not switch.awake
    switch("device", "train", "rollout")
    assert engine.calls == [("sleep", False), ("wake", False)]


def test_a_run_that_starts_training_puts_the_engine_to_sleep_first():
    model, opt = _trained(torch.float32)
    engine = _Engine(_flat(model, opt))
    switch = EngineSwitch(lambda: _state(model, opt), wake=engine.wake, sleep=engine.sleep, awake=True)
    switch("device", None, "train")
    assert engine.calls == [("sleep", True)] and switch.phase == "train"


def test_a_failed_wake_up_leaves_the_training_state_in_place():
    model, opt = _trained(torch.float32)
    tensors = _flat(model, opt)
    before = {k: v.clone() for k, v in tensors.items()}
    switch = EngineSwitch(lambda: _state(model, opt), wake=_Engine(tensors, fail_wake=True).wake, sleep=lambda: None)
    with pytest.raises(RuntimeError, match="KV cache"):
        switch("device", None, "rollout")
    assert switch.phase is None and not switch.awake and switch.transitions == []
    assert all(torch.equal(t, before[k]) for k, t in tensors.items())


def test_bad_phases_and_states_are_refused_before_anything_moves():
    model, opt = _trained(torch.float32)
    tensors = _flat(model, opt)
    engine = _Engine(tensors)
    switch = EngineSwitch(lambda: _state(model, opt), wake=engine.wake, sleep=engine.sleep)
    with pytest.raises(
        ValueError, match="switch: got phase 'decode' on resource 'device', expected 'rollout' or 'train'"
    ):
        switch("device", None, "decode")
    bad = EngineSwitch(lambda: dict(model.named_parameters()), wake=engine.wake, sleep=engine.sleep)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="state: returned dict, expected a TrainState"):
        bad("device", None, "rollout")
    assert engine.calls == [] and all(t.untyped_storage().nbytes() > 0 for t in tensors.values())
