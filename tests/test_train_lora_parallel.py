"""LoRA at 2 gloo ranks: FSDP2 over the peft model equals the 1-rank LoRA run, the checkpoint (adapters) resumes at 1.

One launch of 2 processes: a data-parallel LoRA run (3 steps; warm-up, KL to the reference
in the loss), its engine's weights, the gathered adapters and the sharded reference's
log-probs; tensor-parallel LoRA is refused first, before any work. The 1-rank LoRA run
with the same global batch is the oracle; the 2-rank checkpoint resumes in one process.
Rollouts come from an engine of its own, fed through the weight sync, with the trainer's
default sampler: each row's stream is keyed by its global row, so a batch split across
ranks samples what the whole batch samples in one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from dist_helpers import leave, spawn
from rlcore.models import AdaptersOff, adapters_disabled
from rlcore.train import TorchEngine, build_model, full_state_dict, load_checkpoint, logprob_stage, make_task, train
from rlcore.train.cli import main
from test_trainer_parallel import DATA_PARALLEL, ONE_RANK, _cfg, length_reward
from tiny_runs import record_losses

R, ALPHA, TARGETS = 4, 8, ("q_proj", "v_proj")
LORA = [f"model.lora={{r: {R}, alpha: {ALPHA}, target_modules: [{', '.join(TARGETS)}]}}", "rl.beta=0.05", "rl.lr=0.01"]
STEPS = 3


def _lora_cfg(out: Path, *extra: str, steps: int = STEPS):
    return _cfg(out, *LORA, *extra, steps=steps)


class SyncedEngine(TorchEngine):
    """The torch engine on a model of its own, loaded with the weights the trainer publishes after each update."""

    def __init__(self, cfg):
        tok = make_task(
            cfg.data.task, length=cfg.data.length, min_length=cfg.data.min_length, letters=cfg.data.letters
        ).tokenizer
        torch.manual_seed(123)  # not the policy's initial weights: the first sync must replace them
        super().__init__(
            build_model(cfg, tok.vocab_size).eval(),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            max_new_tokens=cfg.rl.max_new_tokens,
            temperature=cfg.rl.temperature,
        )

    def load_weights(self, params):
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])


def _run(cfg, start: int = 0):
    engine = SyncedEngine(cfg)
    return train(cfg, engine=engine, reward=length_reward, resume=start > 0), engine


def _adapters(state):
    return {k: v for k, v in state.items() if ".lora_" in k}


def _base_model(cfg):
    """The model the run starts from (its seed, its architecture), without adapters."""
    vocab = make_task(cfg.data.task, length=cfg.data.length, min_length=cfg.data.min_length, letters=cfg.data.letters)
    torch.manual_seed(cfg.trainer.seed)
    return build_model(cfg, vocab.tokenizer.vocab_size).eval()


def _batch():
    g = torch.Generator().manual_seed(0)
    return {
        "prompts": torch.randint(1, 8, (3, 5), generator=g),
        "prompt_mask": torch.tensor([[0.0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]),
        "responses": torch.randint(1, 8, (3, 4), generator=g),
        "mask": torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]),
    }


def _ranks(rank: int, init_file: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    out = Path(tmp)
    refused = out / "tp"
    with pytest.raises(ValueError, match=r"^model\.lora: got LoRA with parallel\.tensor_parallel=2") as err:
        train(_lora_cfg(refused, "parallel.tensor_parallel=2", *ONE_RANK))
    assert "\n" not in str(err.value) and not refused.exists()  # one line, refused before any work
    cfg = _lora_cfg(out / "dp", *DATA_PARALLEL)
    run, engine = _run(cfg)
    if rank == 0:
        shutil.copytree(out / "dp" / "checkpoint", out / "saved_at_2" / "checkpoint")
    policy = run.policy
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)  # DTensors: the global numel
    gathered = full_state_dict(policy.get_base_model())  # collective: base and adapters, peft's names
    merged = full_state_dict(policy)  # collective: W + B A alpha / r, the base names
    batch = _batch()
    ref = logprob_stage(AdaptersOff(policy), outputs=("ref_logp",)).fn(batch)["ref_logp"]  # collective forwards
    logp = logprob_stage(policy, outputs=("logp",)).fn(batch)["logp"]
    with adapters_disabled(policy):
        assert all(p.requires_grad is False for n, p in policy.named_parameters() if ".lora_" in n)
    assert all(p.requires_grad for n, p in policy.named_parameters() if ".lora_" in n)  # on again after the block
    base = logprob_stage(_base_model(cfg), outputs=("ref_logp",)).fn(batch)["ref_logp"]
    if rank == 0:
        engine_weights = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        torch.save(
            {
                "records": run.records,
                "trainable": trainable,
                "adapters": _adapters(gathered),
                "gathered": gathered,
                "merged": merged,
                "engine": engine_weights,
                "ref": ref,
                "logp": logp,
                "base": base,
            },
            out / "ranks.pt",
        )
    leave()


def _expected_adapter_numel(cfg) -> int:
    return sum(
        R * (m.in_features + m.out_features)
        for name, m in _base_model(cfg).named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    )


def test_lora_at_two_ranks_equals_one_rank_and_its_adapter_checkpoint_resumes_at_one(tmp_path):
    spawn(_ranks, (str(tmp_path / "rendezvous"), str(tmp_path)), 2, timeout=300)
    got = torch.load(tmp_path / "ranks.pt", weights_only=False)
    cfg = _lora_cfg(tmp_path / "one", *ONE_RANK)
    ref, _ = _run(cfg)
    want = record_losses(ref.records)
    expected = _expected_adapter_numel(cfg)

    # Only the adapters train, at both world sizes.
    assert got["trainable"] == expected == sum(p.numel() for p in ref.policy.parameters() if p.requires_grad)
    # Same rollouts, losses to 1e-4, adapters equal (and they moved: B starts at 0).
    assert [r["step"] for r in got["records"]] == list(range(STEPS))
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(
        torch.tensor([r["reward"] for r in got["records"]]), torch.tensor([r["reward"] for r in ref.records])
    )
    torch.testing.assert_close(record_losses(got["records"]), want, rtol=0, atol=1e-4)
    one = _adapters(ref.policy.get_base_model().state_dict())
    assert one.keys() == got["adapters"].keys() and len(one) == 2 * len(TARGETS)
    assert any(v.abs().max() > 1e-3 for k, v in one.items() if ".lora_B." in k)
    for k, v in got["adapters"].items():
        torch.testing.assert_close(v, one[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")

    # The engine got the merged weights W + B A alpha / r, bit for bit; the base weights never moved.
    gathered, merged = got["gathered"], got["merged"]
    start = _base_model(cfg).state_dict()
    assert merged.keys() == start.keys() and got["engine"].keys() == start.keys()
    for name, value in merged.items():
        assert torch.equal(got["engine"][name], value), name
        owner, _, leaf = name.rpartition(".")
        if owner.rsplit(".", 1)[-1] in TARGETS and leaf == "weight":
            w = gathered[f"{owner}.base_layer.weight"]
            a, b = gathered[f"{owner}.lora_A.default.weight"], gathered[f"{owner}.lora_B.default.weight"]
            assert torch.equal(w, start[name]), name
            assert torch.equal(value, w + (b @ a) * (ALPHA / R)), name
        else:
            assert torch.equal(value, start[name]), name

    # The sharded reference (adapters off) is the base model; the policy is not.
    torch.testing.assert_close(got["ref"], got["base"], rtol=0, atol=1e-6)
    assert (got["logp"] - got["ref"]).abs().max() > 1e-4

    # The checkpoint holds the adapters alone (and their optimiser state).
    state = load_checkpoint(tmp_path / "dp")
    saved = state["policy"]["model"]
    assert "reference" not in state
    assert saved and all("/lora_A" in k or "/lora_B" in k for k in saved)
    assert sum(t.numel() for t in saved.values()) == expected
    assert len(state["policy"]["optim"]["state"]) == len(saved)

    # The run's hf/ (written by rank 0) and `rlcore export` of its checkpoint hold the merged weights.
    exported = tmp_path / "exported"
    assert main(["export", str(tmp_path / "dp"), str(exported)]) == 0
    for directory in (tmp_path / "dp" / "hf", exported):
        written = AutoModelForCausalLM.from_pretrained(directory).state_dict()
        for name, value in merged.items():
            torch.testing.assert_close(written[name], value, rtol=0, atol=0, msg=lambda m: f"{directory} {name}: {m}")

    # Saved at 2 ranks, resumed in one process: the next step is the 1-rank run's own resume.
    straight, _ = _run(_lora_cfg(tmp_path / "one", *ONE_RANK, steps=STEPS + 1), start=STEPS)
    resumed, _ = _run(_lora_cfg(tmp_path / "saved_at_2", *ONE_RANK, steps=STEPS + 1), start=STEPS)
    assert [r["step"] for r in resumed.records] == [STEPS]
    torch.testing.assert_close(record_losses(resumed.records), record_losses(straight.records), rtol=0, atol=1e-4)
    a, b = (_adapters(r.policy.get_base_model().state_dict()) for r in (straight, resumed))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
