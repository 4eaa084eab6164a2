"""vLLM beyond one rank: each data-parallel rank of an FSDP2 run (2 gloo processes) runs its own engine.

After every sync each rank reads its engine's weights back (through the engine's own
kernels) and compares them with the trainer's, gathered from the FSDP2 shards: equal bit
for bit, the tied head's kernel copy included, on both ranks, at every version. The model
is configs/grpo_tiny_vllm.yaml's with one layer (head_dim 32, the smallest vLLM's CPU
attention serves). The same run with each rank's engine in its own rollout worker gives the
co-located run's losses and rewards.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from dist_helpers import leave, spawn
from rlcore.train import VLLMDeployment, full_state_dict, load_config, train
from tiny_runs import QUIET, TINY_ROLLOUT

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "model.model_name_or_path.intermediate_size=64",
    "model.model_name_or_path.num_hidden_layers=1",
    "deploy.vllm.kv_cache_memory_bytes=8388608",
    "deploy.vllm.max_num_seqs=16",
    "parallel.data_parallel=2",
    "rl.batch_size=2",
    "rl.mini_batch_size=2",
    "trainer.warmup_batch_size=4",
    "trainer.steps=3",
]


def length_reward(prompts, responses, **columns):
    """Rewards that differ within a group from the first step, so every update moves the weights."""
    return [len(r) / 6 for r in responses]


def _digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _ranks(rank: int, init_file: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    checks: list[dict] = []
    publish = VLLMDeployment.publish

    def checked_publish(self: VLLMDeployment, version: int) -> None:
        publish(self, version)
        back = self.engine.read_weights()
        full = full_state_dict(self.policy)  # collective: every rank publishes at the same points
        checks.append(
            {
                "version": version,
                "sharded": any(type(p.data).__name__ == "DTensor" for p in self.policy.parameters()),
                "equal": sorted(n for n in self.names if torch.equal(back[n], full[n])) == sorted(self.names),
                "head": torch.equal(back["lm_head.weight"], full["model.embed_tokens.weight"]),
                "digest": _digest({n: full[n] for n in self.names}),
            }
        )

    VLLMDeployment.publish = checked_publish  # type: ignore[method-assign]
    out = Path(tmp) / "run"
    cfg = load_config(
        ROOT / "configs" / "grpo_tiny_vllm.yaml",
        [*TINY_ROLLOUT, *QUIET, *SMALL, f"trainer.output_dir={out}"],
    )
    records = train(cfg, reward=length_reward).records
    VLLMDeployment.publish = publish  # type: ignore[method-assign]
    # Each rank's engine in its own rollout worker: the same row-keyed requests to the same engine.
    worker = load_config(
        ROOT / "configs" / "grpo_tiny_vllm.yaml",
        [*TINY_ROLLOUT, *QUIET, *SMALL, f"trainer.output_dir={Path(tmp) / 'worker'}", "deploy.mode=disaggregated"],
    )
    run = train(worker, reward=length_reward)
    weights = _digest(full_state_dict(run.policy))  # collective
    out = {"checks": checks, "records": records, "worker": run.records, "worker_weights": weights}
    torch.save(out, Path(tmp) / f"rank{rank}.pt")
    leave()


def test_each_rank_runs_its_engine_and_reads_back_the_trainers_weights_after_every_sync(tmp_path):
    # A bound on a hang, not a timing: it starts beside the suite's other longest files (tests/conftest.py),
    # and took 346 s there on a loaded machine (about 115 s quiet).
    spawn(_ranks, (str(tmp_path / "rendezvous"), str(tmp_path)), 2, timeout=900)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for got in ranks:
        checks = got["checks"]
        assert [c["version"] for c in checks] == [0, 1, 2, 3]  # version 0, then after each of 3 steps
        assert all(c["sharded"] and c["equal"] and c["head"] for c in checks), checks
        assert len({c["digest"] for c in checks}) == 4  # every update changed the weights
        assert [r["step"] for r in got["records"]] == [0, 1, 2]
    assert [c["digest"] for c in ranks[0]["checks"]] == [c["digest"] for c in ranks[1]["checks"]]
    assert [r["reward"] for r in ranks[0]["records"]] == [r["reward"] for r in ranks[1]["records"]]
    # Disaggregated, one worker per rank: the co-located run's losses, rewards and final weights.
    for got in ranks:
        for key in ("loss", "reward", "response_length"):
            assert [r[key] for r in got["worker"]] == [r[key] for r in got["records"]], key
    assert ranks[0]["worker_weights"] == ranks[1]["worker_weights"]
