"""rlcore.train.parallel on a real 2-process gloo group: FSDP2 and tensor parallelism match one process, DCP across sizes.

One launch of two processes runs every distributed check (each launch costs seconds):
training with FSDP2 at dp=2 and with tensor parallelism at tp=2 against the same steps
on one process with the whole batch, the gathered state dict, the size errors, and
DCP checkpoints saved at 2 ranks (loaded here at 1) and at 1 rank (loaded there at 2).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
STEPS = 5
TOL = 1e-4
# Tiny Qwen2 with grouped-query attention: 4 heads, 2 KV heads, untied output embedding.
CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 48,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def _model(seed: int = 0, **extra):  # type: ignore[no-untyped-def]
    from rlcore.models import load_causal_lm

    return load_causal_lm({**CONFIG, **extra}, seed=seed)


def _batches(batch: int = 4, width: int = 7) -> list[dict[str, torch.Tensor]]:
    """The global batches: uneven lengths, the first two tokens of each row unscored (a prompt)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, CONFIG["vocab_size"], (batch, width), generator=g)
        lengths = torch.randint(3, width + 1, (batch,), generator=g)
        attention = (torch.arange(width)[None] < lengths[:, None]).long()
        mask = attention.clone()
        mask[:, :2] = 0
        out.append({"input_ids": ids, "attention_mask": attention, "mask": mask})
    return out


def _train(model, rows, group) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    """STEPS AdamW steps of token-mean NLL (global counts) on ``rows`` of each batch: (loss, grad norm) per step."""
    from rlcore import algos
    from rlcore.models import from_hf, token_logprobs
    from rlcore.train import clip_grad_norm

    apply, params = from_hf(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for full in _batches():
        batch = {k: v[rows] for k, v in full.items()}
        logp = token_logprobs(apply, params, batch)
        counts = algos.global_counts(batch["mask"], process_group=group)
        loss = algos.aggregate(-logp, batch["mask"], mode="token-mean", num_tokens=counts["num_tokens"])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # no hand-written all-reduce: FSDP / DTensor reduce the gradients
        norm = clip_grad_norm(model.parameters(), 0.5)  # clips on every step (the norms are about 2)
        opt.step()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)  # the global loss, for the comparison only
        out.append((float(total), float(norm)))
    return out


def _assert_close_sd(got, want, what: str) -> None:  # type: ignore[no-untyped-def]
    assert want and sorted(got) == sorted(want), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{what} {k}: {m}")


def _full_optim(model, opt):  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {f"{p}.{k}": v for p, s in sd["state"].items() for k, v in s.items()}


def _plain_optim(model, opt):  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, opt)
    return {f"{p}.{k}": v for p, s in sd["state"].items() for k, v in s.items()}


def _one_step(model, opt, seed: int) -> None:  # type: ignore[no-untyped-def]
    from rlcore.models import from_hf, token_logprobs

    apply, params = from_hf(model)
    batch = _batches()[seed]
    rank = dist.get_rank() if dist.is_initialized() else None
    if rank is not None and any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()):
        batch = {k: v[rank * 2 : rank * 2 + 2] for k, v in batch.items()}
    loss = -(token_logprobs(apply, params, batch) * batch["mask"]).sum() / 20
    opt.zero_grad()
    loss.backward()
    opt.step()


def _worker(rank: int, init_file: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from rlcore.models import from_hf
        from rlcore.train import device_mesh, full_state_dict, load_checkpoint, parallelize, save_checkpoint

        reference_model = _model()
        reference = _train(reference_model, slice(None), None)
        want = {k: v.detach() for k, v in reference_model.state_dict().items()}

        # FSDP2, dp=2: each rank half the global batch.
        mesh = device_mesh(2, 1)
        model = parallelize(_model(), mesh)
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
        got = _train(model, slice(2 * rank, 2 * rank + 2), mesh["dp"].get_group())
        for (a, na), (b, nb) in zip(got, reference):
            assert abs(a - b) <= TOL and abs(na - nb) <= TOL, ("dp=2", got, reference)
        _assert_close_sd(full_state_dict(model), want, "dp=2 parameters")

        # Tensor parallel, tp=2: every rank the whole batch, half the heads.
        mesh = device_mesh(1, 2)
        model = parallelize(_model(), mesh)
        q = model.model.layers[0].self_attn.q_proj.weight
        assert q.to_local().shape[0] == CONFIG["hidden_size"] // 2
        got = _train(model, slice(None), None)
        for (a, na), (b, nb) in zip(got, reference):
            assert abs(a - b) <= TOL and abs(na - nb) <= TOL, ("tp=2", got, reference)
        _assert_close_sd(full_state_dict(model), want, "tp=2 parameters")

        # Errors: the product of the sizes, the heads, foreign weights on a sharded model.
        with pytest.raises(ValueError, match=r"'parallel.data_parallel' \(2\) x 'parallel.tensor_parallel' \(2\) = 4"):
            device_mesh(2, 2)
        odd = _model(hidden_size=24, num_attention_heads=3, num_key_value_heads=3)
        before = {k: v.clone() for k, v in odd.state_dict().items()}
        with pytest.raises(ValueError, match=r"'parallel.tensor_parallel': got 2, expected a divisor of"):
            parallelize(odd, device_mesh(1, 2))
        assert all(torch.equal(v, before[k]) for k, v in odd.state_dict().items())  # left as it was
        apply, params = from_hf(model)
        with pytest.raises(ValueError, match="not the sharded model's own"):
            apply(
                {**params, "lm_head.weight": torch.zeros(48, 32)},
                torch.tensor([1, 2]),
                position_ids=torch.tensor([0, 1]),
                cu_seqlens=torch.tensor([0, 2]),
            )

        # DCP, 2 ranks -> 1 (checked by the parent): an FSDP model and its optimiser after one step.
        mesh = device_mesh(2, 1)
        model = parallelize(_model(seed=1), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _one_step(model, opt, 0)
        save_checkpoint(Path(tmp) / "two", {"policy": (model, opt), "step": 7, "rank": rank})
        full, optim = full_state_dict(model), _full_optim(model, opt)
        if rank == 0:
            torch.save({"model": full, "optim": optim}, Path(tmp) / "two_expected.pt")

        # DCP, 1 rank -> 2: the parent's checkpoint into a fresh FSDP model and optimiser.
        model = parallelize(_model(seed=2), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _one_step(model, opt, 1)  # the optimiser state exists, then is overwritten
        data = load_checkpoint(Path(tmp) / "one", {"policy": (model, opt), "step": None})
        assert data["step"] == 3 and data["rank"] == 0  # a rank the save did not have reads rank 0's data
        expected = torch.load(Path(tmp) / "one_expected.pt")
        _assert_close_sd(full_state_dict(model), expected["model"], "1 -> 2 parameters")
        _assert_close_sd(_full_optim(model, opt), expected["optim"], "1 -> 2 optimiser")
        dist.barrier()  # every rank leaves its collectives before teardown
    finally:
        dist.destroy_process_group()


def test_fsdp_and_tensor_parallel_match_one_process_and_checkpoints_change_world_size():
    from rlcore.train import load_checkpoint, save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        # The 1-rank checkpoint the workers load at 2 ranks.
        model = _model(seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _one_step(model, opt, 2)
        save_checkpoint(Path(tmp) / "one", {"policy": (model, opt), "step": 3, "rank": 0})
        torch.save(
            {"model": {k: v.detach() for k, v in model.state_dict().items()}, "optim": _plain_optim(model, opt)},
            Path(tmp) / "one_expected.pt",
        )
        mp.spawn(_worker, args=(os.path.join(tmp, "rendezvous"), tmp), nprocs=WORLD, join=True)

        # The 2-rank checkpoint, loaded here on one process without a process group.
        assert not dist.is_initialized()
        model = _model(seed=4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _one_step(model, opt, 3)
        data = load_checkpoint(Path(tmp) / "two", {"policy": (model, opt), "step": None})
        assert data["step"] == 7 and data["rank"] == 0
        expected = torch.load(Path(tmp) / "two_expected.pt")
        _assert_close_sd({k: v.detach() for k, v in model.state_dict().items()}, expected["model"], "2 -> 1 model")
        _assert_close_sd(_plain_optim(model, opt), expected["optim"], "2 -> 1 optimiser")
        # Whole, without a template: the same tensors.
        whole = load_checkpoint(Path(tmp) / "two")
        _assert_close_sd(whole["policy"]["model"], expected["model"], "2 -> whole")
        assert whole["policy"]["optim"]["param_groups"][0]["lr"] == 1e-2


@pytest.mark.parametrize(
    "sizes, match",
    [
        ({"data_parallel": 2, "tensor_parallel": 2, "world_size": 2}, r"= 4, expected the launched world size 2"),
        (
            {"data_parallel": 1, "tensor_parallel": 1, "world_size": 2},
            r"'parallel.data_parallel': got 1, expected the launched world size 2 \(torchrun --nproc-per-node 1",
        ),
        ({"data_parallel": 1, "tensor_parallel": 2, "world_size": 4}, r"\(2\) = 2, expected the launched world size 4"),
        (
            {"data_parallel": 1, "tensor_parallel": 1, "world_size": 1, "pipeline_parallel": 2},
            r"'parallel.pipeline_parallel': got 2, expected 1 \(supported: data parallelism through FSDP2",
        ),
        ({"data_parallel": 0, "tensor_parallel": 1, "world_size": 1}, r"'parallel.data_parallel': got 0"),
        ({"data_parallel": 1, "tensor_parallel": True, "world_size": 1}, r"'parallel.tensor_parallel': got True"),
    ],
)
def test_parallel_sizes_errors_name_the_keys(sizes, match):
    from rlcore.train import check_parallel_sizes

    with pytest.raises(ValueError, match=match):
        check_parallel_sizes(**sizes)


def test_parallelize_refuses_what_it_cannot_shard():
    from torch.distributed.device_mesh import DeviceMesh

    from rlcore.train import parallelize

    with pytest.raises(ValueError, match=r"mesh: got .*expected a DeviceMesh"):
        parallelize(_model(), "dp")  # type: ignore[arg-type]
    assert DeviceMesh  # the name the error asks for


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    from rlcore.train import clip_grad_norm

    g = torch.Generator().manual_seed(0)
    for norm_type, max_norm in ((2.0, 0.3), (1.0, 2.0), (math.inf, 0.1), (2.0, math.inf)):
        a = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(4))]
        b = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(4))]
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        got = clip_grad_norm(a, max_norm, norm_type=norm_type)
        want = torch.nn.utils.clip_grad_norm_(b, max_norm, norm_type=norm_type)
        torch.testing.assert_close(got, want)
        for p, q in zip(a, b):
            torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(ValueError, match="max_norm: got nan"):
        clip_grad_norm(a, float("nan"))
