"""A GRPO group's prompt runs once: the shared-prompt forward and the shared prefill equal the per-row ones."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.models import decoding, from_hf, load_causal_lm, shared_prefix_logprobs, shares_prompts
from rlcore.testing.reference import response_logprobs_ref
from rlcore.train.rollout import generate
from rlcore.train.stages import response_logprobs
from tiny_runs import tiny_qwen2

VOCAB = 29


def _model(dtype=torch.float32):
    return load_causal_lm(tiny_qwen2(VOCAB), dtype=dtype, seed=0).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@st.composite
def grouped_batches(draw, max_groups=3, max_rows=4, max_prompt=5, max_response=6):
    """Rows in groups sharing a left-padded prompt, in any row order; right-padded responses of any length."""
    prompts = [
        draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=max_prompt))
        for _ in range(draw(st.integers(1, max_groups)))
    ]
    sizes = [draw(st.integers(1, max_rows)) for _ in prompts]
    rows = [g for g, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(range(len(rows))))
    rows = [rows[i] for i in order]
    responses = [draw(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=max_response)) for _ in rows]
    width_p = max(len(p) for p in prompts)
    width_r = max(1, max(len(r) for r in responses))
    ids = torch.zeros(len(rows), width_p, dtype=torch.long)
    pmask = torch.zeros(len(rows), width_p, dtype=torch.long)
    resp = torch.zeros(len(rows), width_r, dtype=torch.long)
    mask = torch.zeros(len(rows), width_r)
    for i, (g, r) in enumerate(zip(rows, responses)):
        p = prompts[g]
        ids[i, width_p - len(p) :] = torch.tensor(p)
        pmask[i, width_p - len(p) :] = 1
        resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return (
        {"prompts": ids, "prompt_mask": pmask, "responses": resp, "mask": mask},
        [prompts[g] for g in rows],
        responses,
    )


@settings(max_examples=25, deadline=None)
@given(grouped_batches(), st.sampled_from([1.0, 0.7]))
def test_shared_prefix_logprobs_match_the_per_row_loop_reference(model, drawn, temperature):
    batch, prompts, responses = drawn
    group = torch.unique(torch.where(batch["prompt_mask"] != 0, batch["prompts"], -1), dim=0, return_inverse=True)[1]
    apply, params = from_hf(model)
    with torch.no_grad():
        logp, entropy = shared_prefix_logprobs(
            apply, params, batch, group=group, temperature=temperature, with_entropy=True
        )
        _, packed_entropy = response_logprobs(
            (apply, params), batch, temperature=temperature, with_entropy=True, share_prompts=False
        )
    for i, (p, r) in enumerate(zip(prompts, responses)):
        want = response_logprobs_ref(model, p, r, temperature=temperature)
        torch.testing.assert_close(
            logp[i, : len(r)].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0
        )
    off = batch["mask"] == 0
    assert torch.all(logp[off] == 0) and torch.all(entropy[off] == 0)
    torch.testing.assert_close(entropy, packed_entropy, atol=1e-5, rtol=0)


def _grouped(seed=0, groups=4, n=3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (groups,), generator=g)
    width = int(lengths.max())
    prompts = torch.zeros(groups, width, dtype=torch.long)
    pmask = torch.zeros(groups, width, dtype=torch.long)
    for i, k in enumerate(lengths.tolist()):
        prompts[i, width - k :] = torch.randint(2, VOCAB, (k,), generator=g)
        pmask[i, width - k :] = 1
    rows = groups * n
    responses = torch.randint(1, VOCAB, (rows, 6), generator=g)
    mask = (torch.arange(6) < torch.randint(0, 7, (rows, 1), generator=g)).float()
    return {
        "prompts": prompts.repeat_interleave(n, 0),
        "prompt_mask": pmask.repeat_interleave(n, 0),
        "responses": responses,
        "mask": mask,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_forward_gradients_equal_the_per_row_forwards(dtype):
    model = _model(dtype)
    batch = _grouped()
    weights = torch.randn(batch["mask"].shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for share in (True, False):
        model.zero_grad()
        logp, entropy = response_logprobs(from_hf(model), batch, with_entropy=True, share_prompts=share)
        ((logp * weights).sum() + entropy.sum()).backward()
        grads.append({k: p.grad.float().clone() for k, p in model.named_parameters()})
    assert_same_gradients(grads[0], grads[1], dtype)


def assert_same_gradients(got: dict, want: dict, dtype: torch.dtype) -> None:
    """Per-parameter gradients equal up to the dtype's rounding (relative to the largest entry), and not all zero."""
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for k in got:
        scale = want[k].abs().max().item() + 1e-12
        assert (got[k] - want[k]).abs().max().item() <= tol * max(1.0, scale), k
    assert any(g.abs().sum() > 0 for g in got.values())  # the comparison is not between zeros


def test_a_response_mask_with_holes_packs_like_the_per_row_forward(model):
    batch = _grouped(seed=3)
    batch["mask"][:, 2] = 0  # an interior gap: those tokens are dropped, as the packed forward drops them
    with torch.no_grad():
        shared = response_logprobs(from_hf(model), batch, share_prompts=True)
        whole = response_logprobs(from_hf(model), batch, share_prompts=False)
    torch.testing.assert_close(shared, whole, atol=1e-5, rtol=0)


def test_shares_prompts_finds_groups_and_declines_when_nothing_is_shared():
    batch = _grouped(groups=3, n=2)
    group = shares_prompts(batch["prompts"], batch["prompt_mask"])
    assert group is not None and torch.equal(group[0::2], group[1::2]) and len(set(group.tolist())) == 3
    distinct = _grouped(groups=4, n=1)
    assert shares_prompts(distinct["prompts"], distinct["prompt_mask"]) is None
    assert shares_prompts(batch["prompts"][:1], batch["prompt_mask"][:1]) is None
    empty = batch["prompt_mask"].clone()
    empty[0] = 0  # a row with no prompt token: the per-row forward handles it
    assert shares_prompts(batch["prompts"], empty) is None


def test_shares_prompts_takes_runs_of_neighbours_and_else_searches_every_row(model):
    batch = _grouped(seed=3, groups=3, n=2)
    # Prompt runs A A B B A A: the runs are the groups (A twice), found without a sort.
    order = torch.tensor([0, 1, 2, 3, 0, 1])
    runs = {k: v[order] if k.startswith("prompt") else v for k, v in batch.items()}
    group = shares_prompts(runs["prompts"], runs["prompt_mask"])
    assert group is not None and group.tolist() == [0, 0, 1, 1, 2, 2]
    with torch.no_grad():
        shared = response_logprobs(from_hf(model), runs)
        whole = response_logprobs(from_hf(model), runs, share_prompts=False)
    torch.testing.assert_close(shared, whole, atol=1e-5, rtol=0)
    # No two neighbours alike (A B C A B C): equal prompts are still found anywhere.
    spread = torch.tensor([0, 2, 4, 1, 3, 5])
    group = shares_prompts(batch["prompts"][spread], batch["prompt_mask"][spread])
    assert group is not None and torch.equal(group[:3], group[3:]) and len(set(group.tolist())) == 3


def test_the_prefill_runs_each_distinct_prompt_once_and_samples_the_same(model, monkeypatch):
    batch = _grouped(seed=5, groups=3, n=4)
    sizes = []
    # Rows entering the model at each forward, the prompt's and each step's (the static decode path calls the
    # embedding, not the model's forward).
    hook = model.model.embed_tokens.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    kwargs = dict(eos_token_id=1, max_new_tokens=5, temperature=1.3)
    shared = generate(
        model, batch["prompts"], batch["prompt_mask"], generator=torch.Generator().manual_seed(7), **kwargs
    )
    hook.remove()
    assert sizes[0] == 3 and len(sizes) > 1 and all(s == 12 for s in sizes[1:])  # the prefill: one row per prompt
    monkeypatch.setattr(decoding, "shares_prompts", lambda ids, attention: None)  # every row's prompt runs
    whole = generate(
        model, batch["prompts"], batch["prompt_mask"], generator=torch.Generator().manual_seed(7), **kwargs
    )
    assert torch.equal(shared.responses, whole.responses) and torch.equal(shared.mask, whole.mask)
    torch.testing.assert_close(shared.logp, whole.logp, atol=1e-6, rtol=0)
