"""Cross-rank whitening on a real 2-process gloo group: equals single-process whitening of the whole batch.

The estimators and the recipes (PPO's GAE, REINFORCE++, GRPO at batch scale) given the group.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

import dist_helpers

WORLD = 2


def _shards(b: int) -> list[torch.Tensor]:
    # Uneven and interleaved: rank 0 holds rows 0, 2 and 3; rank 1 holds the rest.
    first = torch.tensor([0, 2, 3])
    rest = torch.tensor([i for i in range(b) if i not in (0, 2, 3)])
    return [first, rest]


def _data(seed: int, b: int = 7, t: int = 5, dtype: torch.dtype = torch.float64):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, t, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)
    m = torch.rand(b, t, generator=g) > 0.35
    m[1] = False  # a row with no counted token
    return x, m


def _check_batch_normalize(rank: int, pg) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed._functional_collectives as funcol

    from rlcore.algos import batch_normalize
    from rlcore.testing import reference as ref

    rows = _shards(7)[rank]
    for dtype, seed in ((torch.float64, 0), (torch.float32, 1), (torch.bfloat16, 2)):
        x, m = _data(seed, dtype=dtype)
        calls = []
        real = funcol.all_reduce

        def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            return real(*args, **kwargs)

        funcol.all_reduce = counting
        try:
            got = batch_normalize(x[rows], m[rows], process_group=pg)
        finally:
            funcol.all_reduce = real
        assert len(calls) == 1, f"expected exactly one all-reduce, got {len(calls)}"
        local_full = batch_normalize(x, m)[rows]
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(got.double(), local_full.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(got.double(), ref.batch_normalize_ref(x, m)[rows], rtol=tol, atol=tol)
        scaled = batch_normalize(x[rows], m[rows], shift_mean=False, process_group=pg)
        torch.testing.assert_close(
            scaled.double(), batch_normalize(x, m, shift_mean=False)[rows].double(), rtol=tol, atol=tol * 10
        )

    # values far from 0 keep their float32 resolution across ranks
    x, m = _data(3, dtype=torch.float64)
    x32 = (x + 1e4).float()
    got = batch_normalize(x32[rows], m[rows], process_group=pg)
    torch.testing.assert_close(got.double(), ref.batch_normalize_ref(x32, m)[rows], rtol=1e-4, atol=1e-4)

    # constant data across ranks: exactly 0, in float32 and bfloat16
    for dtype in (torch.float32, torch.bfloat16):
        c = torch.full((4, 3), 1234.5, dtype=dtype)
        out = batch_normalize(c, torch.ones(4, 3, dtype=torch.bool), process_group=pg)
        assert torch.equal(out, torch.zeros_like(out))

    # a rank with nothing counted still takes part and gets zeros
    x, m = _data(4)
    mr = m[rows].clone()
    if rank == 1:
        mr[:] = False
    m_all = m.clone()
    m_all[_shards(7)[1]] = False
    got = batch_normalize(x[rows], mr, process_group=pg)
    torch.testing.assert_close(got, batch_normalize(x, m_all)[rows], rtol=1e-12, atol=1e-12)


def _check_gradients(rank: int, pg) -> None:  # type: ignore[no-untyped-def]
    from rlcore.algos import batch_normalize

    rows = _shards(7)[rank]
    x, m = _data(5)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    full = x.clone().requires_grad_(True)
    (w * batch_normalize(full, m)).sum().backward()
    mine = x[rows].clone().requires_grad_(True)
    (w[rows] * batch_normalize(mine, m[rows], process_group=pg)).sum().backward()
    torch.testing.assert_close(mine.grad, full.grad[rows], rtol=1e-10, atol=1e-12)


def _check_estimators(rank: int, pg, mesh) -> None:  # type: ignore[no-untyped-def]
    from rlcore.algos import (
        batch_normalize,
        grpo_advantages,
        reinforce_pp_advantages,
        reinforce_pp_baseline_advantages,
        running_reward_normalizer,
    )

    g = torch.Generator().manual_seed(7)
    scores = torch.randn(8, generator=g)
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    rows = torch.arange(4) if rank == 0 else torch.arange(4, 8)  # groups live on one rank
    got = grpo_advantages(scores[rows], ids[rows], scale="batch", process_group=pg)
    torch.testing.assert_close(got, grpo_advantages(scores, ids, scale="batch")[rows])

    x, m = _data(8, b=8, dtype=torch.float32)
    r = torch.where(m, x, 0.0)
    torch.testing.assert_close(
        reinforce_pp_advantages(r[rows], m[rows], gamma=0.9, process_group=pg),
        reinforce_pp_advantages(r, m, gamma=0.9)[rows],
    )
    torch.testing.assert_close(
        reinforce_pp_baseline_advantages(scores[rows], ids[rows], m[rows], process_group=pg),
        reinforce_pp_baseline_advantages(scores, ids, m)[rows],
    )

    # a 1-D DeviceMesh works as the group
    torch.testing.assert_close(batch_normalize(x[rows], m[rows], process_group=mesh), batch_normalize(x, m)[rows])

    # running normalisation: every rank ends with the global state
    norm = running_reward_normalizer()
    state, state_full = norm.init(), norm.init()
    for step in range(3):
        batch = torch.randn(8, generator=torch.Generator().manual_seed(100 + step)) * 2 + step
        out, state = norm.update(batch[rows], torch.ones(batch[rows].shape, dtype=torch.bool), state, process_group=pg)
        out_full, state_full = norm.update(batch, torch.ones(8, dtype=torch.bool), state_full)
        torch.testing.assert_close(out, out_full[rows])
    for a, b in zip(state, state_full):
        torch.testing.assert_close(a, b)


def _check_recipes(rank: int, pg) -> None:  # type: ignore[no-untyped-def]
    """A recipe's advantages over a rank's share of the groups, given the group, equal one process's over the batch."""
    from functools import partial

    from rlcore import algos

    g = torch.Generator().manual_seed(9)
    b, t = 8, 6
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    batch = {
        "scores": torch.randn(b, generator=g),
        "group_ids": torch.arange(b) // 2,
        "mask": mask,
        "old_values": torch.randn(b, t, generator=g),
        "old_logp": -torch.rand(b, t, generator=g),
        "ref_logp": -torch.rand(b, t, generator=g),
    }
    rows = torch.arange(4) if rank == 0 else torch.arange(4, 8)  # groups live on one rank
    batch_std = algos.Algorithm(
        advantage_estimator=partial(algos.outcome_advantages, estimator=partial(algos.grpo_advantages, scale="batch")),
        policy_loss=algos.ppo_clip_loss,
    )
    for name, recipe in (
        ("ppo", algos.ppo(kl_coef=0.1)),
        ("reinforce_pp", algos.reinforce_pp()),
        ("grpo batch", batch_std),
    ):
        whole = recipe.advantages(batch)
        mine = recipe.advantages({k: v[rows] for k, v in batch.items()}, process_group=pg)
        local = recipe.advantages({k: v[rows] for k, v in batch.items()})
        torch.testing.assert_close(mine["advantages"], whole["advantages"][rows], msg=lambda m: f"{name}: {m}")
        # Without the group the moments are the rank's own: the check above is not vacuous.
        assert not torch.allclose(local["advantages"], whole["advantages"][rows]), name
    # GRPO's group scale needs no group: the result is the same either way.
    grpo = algos.grpo()
    torch.testing.assert_close(
        grpo.advantages({k: v[rows] for k, v in batch.items()}, process_group=pg)["advantages"],
        grpo.advantages(batch)["advantages"][rows],
    )


def _worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        pg = dist.group.WORLD
        _check_batch_normalize(rank, pg)
        _check_gradients(rank, pg)
        _check_estimators(rank, pg, mesh)
        _check_recipes(rank, pg)
    except BaseException:
        dist.destroy_process_group()
        raise
    dist_helpers.leave()


def test_cross_rank_whitening_equals_whole_batch():
    with tempfile.TemporaryDirectory() as tmp:
        dist_helpers.spawn(_worker, (os.path.join(tmp, "rendezvous"),), nprocs=WORLD)
