"""The trainer with context parallelism at 2 gloo ranks: ring attention and Ulysses equal the 1-rank run.

One launch of 2 processes trains GRPO (``seq-mean-token-mean``: each sequence's loss is
normalised by its token count over the whole sequence, which no rank holds alone) with a
KL term and two optimiser updates per step, once with ``parallel.cp_mode=ring`` and once
with ``ulysses``, every sequence split over the 2 ranks (warm-up included). The 1-rank
run with the same global batch is the oracle: same rewards, losses to 1e-4, final
weights to 1e-3. A second launch of 4 processes runs Ulysses at ``dp = 2 x cp = 2``
against the same oracle. The config errors (world size, heads for Ulysses, what context
parallelism does not run with) need no launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_helpers import leave, spawn
from rlcore.train import full_state_dict, load_config
from rlcore.train.config import check_launch
from test_trainer_parallel import length_reward
from tiny_runs import TINY, record_losses

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
BASE = [
    *TINY,  # rl.mini_batch_size=2: two updates per step, the second off-policy
    "rl.algo=grpo",  # seq-mean-token-mean: the per-sequence counts cross the shards
    "rl.beta=0.1",  # a KL term: the loss is not 0 on-policy
]
MODES = ("ring", "ulysses")


def _cfg(out: Path, *extra: str):
    return load_config(
        ROOT / "configs" / "grpo_tiny.yaml", [*BASE, f"trainer.output_dir={out}", f"trainer.steps={STEPS}", *extra]
    )


def _run(cfg):
    from rlcore.train import train

    return train(cfg, reward=length_reward)  # the default sampler: each row keyed by its global row


def _ranks(rank: int, init_file: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    got = {}
    for mode in MODES:
        run = _run(_cfg(Path(tmp) / mode, "parallel.context_parallel=2", f"parallel.cp_mode={mode}"))
        got[mode] = {"records": run.records, "weights": full_state_dict(run.policy)}
    if rank == 0:
        torch.save(got, Path(tmp) / "ranks.pt")
    leave()


# What a step record holds besides its metrics: timings (seconds), throughput, the clock, the bytes of a
# weight sync (a sharded run syncs its rollout replica; the 1-rank run samples its weights in place).
_NOT_METRICS = ("step", "tokens_per_s_device", "busy_s/", "bubble/", "sync_bytes")


def _is_metric(key: str) -> bool:
    return not key.startswith(_NOT_METRICS) and not key.endswith("_s")


def _assert_metrics_match(records, ref_records, ctx):  # type: ignore[no-untyped-def]
    """Every logged metric of the first step equals the 1-rank run's to 1e-5 relative.

    The first step's updates start from the same weights; later steps drift by the
    sharded forward's float rounding, which the losses and weights are checked for.
    """
    got, want = records[0], ref_records[0]
    keys = sorted(k for k in want if _is_metric(k))
    assert sorted(k for k in got if _is_metric(k)) == keys, ctx
    for key in ("ratio_max", "ratio_min", "ratio_mean", "approx_kl", "clip_frac_low", "pg_loss"):
        assert key in keys, (ctx, key)
    for key in keys:
        # The rollout-vs-trainer log-prob mismatch is itself float rounding (~1e-7): each run's
        # attention kernels round differently (SDPA's ring pieces against the one-rank matmuls).
        torch.testing.assert_close(
            torch.tensor(got[key], dtype=torch.float64),
            torch.tensor(want[key], dtype=torch.float64),
            rtol=1e-5,
            atol=2e-6 if key.startswith("mismatch/") else 1e-7,
            msg=lambda m: f"{ctx} {key}: {m}",
        )


def test_two_cp_ranks_ring_and_ulysses_equal_one_rank(tmp_path):
    spawn(_ranks, (str(tmp_path / "rendezvous"), str(tmp_path)), 2, timeout=420)
    got = torch.load(tmp_path / "ranks.pt", weights_only=False)
    ref = _run(_cfg(tmp_path / "one"))
    want = record_losses(ref.records)
    assert [r["step"] for r in ref.records] == list(range(STEPS))
    assert want.abs().min() > 1e-3  # the comparison is not between zero losses
    final = ref.policy.state_dict()
    for mode in MODES:
        records = got[mode]["records"]
        assert [r["step"] for r in records] == list(range(STEPS)), mode
        _assert_metrics_match(records, ref.records, mode)
        for key in ("reward", "kl", "response_length"):
            torch.testing.assert_close(
                torch.tensor([r[key] for r in records]),
                torch.tensor([r[key] for r in ref.records]),
                msg=lambda m: f"{mode} {key}: {m}",
            )
        torch.testing.assert_close(record_losses(records), want, rtol=0, atol=1e-4, msg=lambda m: f"{mode}: {m}")
        torch.testing.assert_close(
            torch.tensor([r["pg_loss"] for r in records]),
            torch.tensor([r["pg_loss"] for r in ref.records]),
            rtol=0,
            atol=1e-4,
            msg=lambda m: f"{mode} pg_loss: {m}",
        )
        for k, v in got[mode]["weights"].items():
            torch.testing.assert_close(v, final[k], rtol=0, atol=1e-3, msg=lambda m: f"{mode} {k}: {m}")


# dp x cp: 4 ranks, 2 data-parallel replicas of 2 context-parallel ranks; one update per step
# (the micro-batches of a data-parallel run hold other prompts than the 1-rank run's).
DP_CP = ["parallel.data_parallel=2", "parallel.context_parallel=2", "parallel.cp_mode=ulysses"]
DP_CP += ["rl.batch_size=2", "rl.mini_batch_size=2", "trainer.warmup_batch_size=4"]


def _dp_cp_ranks(rank: int, init_file: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    run = _run(_cfg(Path(tmp) / "dp_cp", *DP_CP))
    weights = full_state_dict(run.policy)
    if rank == 0:
        torch.save({"records": run.records, "weights": weights}, Path(tmp) / "dp_cp.pt")
    leave()


def test_data_parallel_times_context_parallel_equals_one_rank(tmp_path):
    spawn(_dp_cp_ranks, (str(tmp_path / "rendezvous"), str(tmp_path)), 4, timeout=420)
    got = torch.load(tmp_path / "dp_cp.pt", weights_only=False)
    ref = _run(_cfg(tmp_path / "one", "rl.mini_batch_size=4"))
    records = got["records"]
    assert [r["step"] for r in records] == list(range(STEPS))
    _assert_metrics_match(records, ref.records, "dp=2 x cp=2")
    assert max(r["kl"] for r in ref.records) > 1e-5  # the policy moved away from the reference
    for key in ("reward", "kl", "loss"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in records], dtype=torch.float64),
            torch.tensor([r[key] for r in ref.records], dtype=torch.float64),
            rtol=1e-3,
            atol=1e-6,
            msg=lambda m: f"{key}: {m}",
        )
    final = ref.policy.state_dict()
    for k, v in got["weights"].items():
        torch.testing.assert_close(v, final[k], rtol=0, atol=1e-4, msg=lambda m: f"{k}: {m}")


def test_context_parallel_config_errors(tmp_path):
    cfg = _cfg(tmp_path, "parallel.context_parallel=2")
    check_launch(cfg, 2)  # 1 x 2 x 1 = 2
    with pytest.raises(
        ValueError,
        match=r"'parallel.data_parallel' \(1\) x 'parallel.context_parallel' \(2\) = 2, expected the launched "
        r"world size 3",
    ):
        check_launch(cfg, 3)
    dp = _cfg(tmp_path, "parallel.context_parallel=2", "parallel.data_parallel=2")
    check_launch(dp, 4)
    with pytest.raises(ValueError, match=r"= 4, expected the launched world size 2 \(torchrun --nproc-per-node 4"):
        check_launch(dp, 2)
    # Ulysses splits the heads: 4 query and 2 key/value heads do not divide by 4; ring takes them.
    check_launch(_cfg(tmp_path, "parallel.context_parallel=4", "parallel.cp_mode=ring"), 4)
    with pytest.raises(ValueError, match=r"got 4 with parallel.cp_mode 'ulysses', expected a divisor of the model's "):
        check_launch(_cfg(tmp_path, "parallel.context_parallel=4", "parallel.cp_mode=ulysses"), 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(1\)"):
        check_launch(
            _cfg(
                tmp_path,
                "parallel.context_parallel=2",
                "parallel.cp_mode=ulysses",
                "model.model_name_or_path.num_key_value_heads=1",
            ),
            2,
        )
    for extra, key in (
        (["rl.algo=ppo"], "rl.algo"),
        (["rl.algo=gspo"], "rl.algo"),
        (["parallel.tensor_parallel=2"], "parallel.tensor_parallel"),
    ):
        with pytest.raises(ValueError, match=rf"config key '{key}': got .* with parallel.context_parallel 2"):
            check_launch(_cfg(tmp_path, "parallel.context_parallel=2", *extra), 4 if "tensor" in key else 2)


def test_reprobe30_context_parallel_recipe_refuses_sequence_coupled_policy_losses():
    # The config refuses rl.algo=gspo with context parallelism; a library user wrapping GSPO or GMPO
    # got each rank's sequence ratio over its own share of the tokens, silently.
    from functools import partial

    from rlcore import algos
    from rlcore.train import ContextParallelRecipe

    for recipe in (algos.gspo(), algos.grpo()._replace(policy_loss=partial(algos.gmpo_loss, clip_low=0.3))):
        with pytest.raises(ValueError, match=r"recipe.policy_loss: got (gspo|gmpo)_loss, expected a token-local"):
            ContextParallelRecipe(recipe, None)


def _replicate_ranks(rank: int, init_file: str, tmp: str) -> None:
    import datetime
    import json
    import time

    from rlcore.dataflow import stage
    from rlcore.train.context_parallel import replicate_stage

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=15)
    )

    def reward(b):  # type: ignore[no-untyped-def]
        if b["bad"]:
            raise ValueError("reward function 'score': got None for row 3, expected a number")
        return {"scores": torch.tensor([float(dist.get_rank())])}

    s = replicate_stage(stage(reward, inputs=["bad"], outputs=["scores"], name="reward"), dist.group.WORLD)
    got: dict = {"ok": s.fn({"bad": False})["scores"].tolist()}
    t0 = time.monotonic()
    try:
        s.fn({"bad": True})
        got["bad"] = "no error"
    except Exception as err:
        got["bad"] = f"{type(err).__name__}: {err}"
    got["bad_s"] = time.monotonic() - t0
    got["after"] = s.fn({"bad": False})["scores"].tolist()  # the group still works
    (Path(tmp) / f"replicate_{rank}.json").write_text(json.dumps(got))
    leave()


def test_reprobe30_a_failing_replicated_stage_raises_on_every_cp_rank(tmp_path):
    # Before: rank 0's reward raised, rank 1 waited in the broadcast until the process-group timeout.
    import json

    spawn(_replicate_ranks, (str(tmp_path / "rendezvous"), str(tmp_path)), 2, timeout=120)
    for rank in range(2):
        got = json.loads((tmp_path / f"replicate_{rank}.json").read_text())
        assert got["ok"] == [0.0] and got["after"] == [0.0], got  # rank 0's outputs on both ranks
        assert got["bad"] == "ValueError: reward function 'score': got None for row 3, expected a number", got
        assert got["bad_s"] < 10, got
