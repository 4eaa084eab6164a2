"""The trainer on torch's engines at 2 gloo ranks: FSDP2 and tensor parallel equal the 1-rank run, DCP across world sizes.

One launch of 2 processes runs every multi-rank check: a data-parallel run (FSDP2, 3 steps,
a checkpoint, then resumed to 5 steps at 2 ranks), and a tensor-parallel run (5 steps).
The 1-rank runs with the same global batch are the oracle; the 2-rank checkpoint taken
after 3 steps is resumed at 1 rank. GRPO and PPO runs of 4 steps at 2 data-parallel ranks
equal their 1-rank runs too. Rollouts come from the trainer's default sampler: each row's
stream is keyed by its index in the global batch (rlcore.seeding), so a batch split across
ranks samples the same responses as the whole batch in one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from dist_helpers import leave, spawn
from rlcore.train import full_state_dict, load_config, train
from tiny_runs import QUIET, TINY_MODEL, TINY_ROLLOUT, record_losses

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
BASE = [
    *TINY_MODEL,
    "rl.algo=dapo",  # token-mean: the on-policy loss is a length-weighted advantage sum, not 0
    *TINY_ROLLOUT,
    *QUIET,
]
# The global batch: 4 prompts x 4 samples per step, one optimiser update per step; 8 warm-up prompts.
ONE_RANK = ["rl.batch_size=4", "rl.mini_batch_size=4", "trainer.warmup_batch_size=8"]
DATA_PARALLEL = ["parallel.data_parallel=2", "rl.batch_size=2", "rl.mini_batch_size=2", "trainer.warmup_batch_size=4"]
TENSOR_PARALLEL = ["parallel.tensor_parallel=2", *ONE_RANK]
# GRPO with a KL term (its on-policy loss is otherwise ~0), PPO with its critic's value loss, and on-policy
# distillation over the full vocabulary (the student's and the FSDP-sharded teacher's logits in the update).
ALGOS = {"grpo": ["rl.algo=grpo", "rl.beta=1.0", "rl.lr=0.02"], "ppo": ["rl.algo=ppo"]}
JSD = ["rl.algo=opd", "rl.beta=null", "rl.opd_loss=jsd", "rl.opd_beta=0.5", "rl.task_coef=1.0"]


def _algos(teacher: str) -> dict[str, list[str]]:
    return {**ALGOS, "opd_jsd": [*JSD, f"model.teacher={teacher}"]}


def _teacher(path: Path) -> str:
    """A peaked random teacher with the reversal task's 9-token vocabulary."""
    config = transformers.AutoConfig.for_model(
        model_type="qwen2", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=9,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    return str(path)


def _cfg(out: Path, *extra: str, steps: int = STEPS):
    overrides = [*BASE, f"trainer.output_dir={out}", f"trainer.steps={steps}", *extra]
    return load_config(ROOT / "configs" / "grpo_tiny.yaml", overrides)


def length_reward(prompts, responses, **columns):
    """Rewards that differ within a group from the first step (the tiny model's answers are all wrong at first)."""
    return [len(r) / 6 for r in responses]


def _run(cfg, start: int = 0, **kwargs):
    return train(cfg, reward=length_reward, resume=start > 0, **kwargs)


def _ranks(rank: int, init_file: str, tmp: str, teacher: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    out = Path(tmp)
    first = _run(_cfg(out / "dp", *DATA_PARALLEL, steps=3))
    if rank == 0:
        shutil.copytree(out / "dp" / "checkpoint", out / "saved_at_2" / "checkpoint")
    dist.barrier()
    rest = _run(_cfg(out / "dp", *DATA_PARALLEL), start=3)
    dp_weights = full_state_dict(rest.policy)  # collective: the FSDP shards gathered
    tp = _run(_cfg(out / "tp", *TENSOR_PARALLEL))
    tp_weights = full_state_dict(tp.policy)
    algos = {
        algo: _run(_cfg(out / algo, *extra, *DATA_PARALLEL, steps=4)).records for algo, extra in _algos(teacher).items()
    }
    if rank == 0:
        torch.save(
            {
                "dp": first.records + rest.records,
                "tp": tp.records,
                "dp_weights": dp_weights,
                "tp_weights": tp_weights,
                **algos,
            },
            out / "ranks.pt",
        )
    leave()


def test_two_ranks_fsdp2_and_tensor_parallel_equal_one_rank_and_dcp_resumes_at_one(tmp_path):
    teacher = _teacher(tmp_path / "teacher")
    spawn(_ranks, (str(tmp_path / "rendezvous"), str(tmp_path), teacher), 2, timeout=420)
    got = torch.load(tmp_path / "ranks.pt", weights_only=False)
    ref = _run(_cfg(tmp_path / "one", *ONE_RANK))
    want = record_losses(ref.records)
    assert [r["step"] for r in ref.records] == list(range(STEPS))
    assert want.abs().max() > 1e-3  # the comparison is not between zero losses
    for name in ("dp", "tp"):
        records = got[name]
        assert [r["step"] for r in records] == list(range(STEPS)), name
        # Same rollouts (same data, same weights at every sync): same rewards; losses to 1e-4.
        rewards = torch.tensor([r["reward"] for r in records])
        torch.testing.assert_close(
            rewards, torch.tensor([r["reward"] for r in ref.records]), msg=lambda m: f"{name}: {m}"
        )
        torch.testing.assert_close(record_losses(records), want, rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")
        # Every metric of the first step (same weights on both sides) is the whole batch's, not a mean over ranks.
        for key in ("pg_loss", "approx_kl", "ratio_mean", "ratio_max", "ratio_min", "clip_frac_low", "clip_frac_high"):
            torch.testing.assert_close(
                torch.tensor(records[0][key], dtype=torch.float64),
                torch.tensor(ref.records[0][key], dtype=torch.float64),
                rtol=1e-5,
                atol=1e-7,
                msg=lambda m: f"{name} {key}: {m}",
            )
        final = ref.policy.state_dict()
        for k, v in got[f"{name}_weights"].items():
            torch.testing.assert_close(v, final[k], rtol=0, atol=1e-3, msg=lambda m: f"{name} {k}: {m}")
    for algo, extra in _algos(teacher).items():
        ref = _run(_cfg(tmp_path / f"one_{algo}", *extra, *ONE_RANK, steps=4)).records
        records = got[algo]
        assert [r["step"] for r in records] == list(range(4)), algo
        # The same responses at every step: the default sampler keys each row by its global index.
        rewards = torch.tensor([r["reward"] for r in records])
        torch.testing.assert_close(rewards, torch.tensor([r["reward"] for r in ref]), msg=lambda m: f"{algo}: {m}")
        # The same losses: the counts are global, and PPO whitens its GAE advantages over every rank's tokens.
        assert record_losses(ref).abs().max() > 1e-3, algo
        torch.testing.assert_close(
            record_losses(records), record_losses(ref), rtol=0, atol=1e-4, msg=lambda m: f"{algo}: {m}"
        )
        if algo == "opd_jsd":  # the distillation term is a whole-batch metric too, and not 0
            distill = torch.tensor([r["distill"] for r in records], dtype=torch.float64)
            assert distill.min() > 1e-3
            torch.testing.assert_close(distill, torch.tensor([r["distill"] for r in ref], dtype=torch.float64))
    # The checkpoint the 2-rank run saved after step 2 resumes in one process.
    resumed = _run(_cfg(tmp_path / "saved_at_2", *ONE_RANK), start=3)
    assert [r["step"] for r in resumed.records] == [3, 4]
    torch.testing.assert_close(record_losses(resumed.records), want[3:], rtol=0, atol=1e-4)
