"""SFT and reward-model training as recipes: the SFT loss against its loop reference, the SFT and RM recipes'
invariance to micro-batching, the SFT dataset's prompt masking (prompt / response rows and messages)."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.data import load_supervised
from rlcore.testing import assert_close, assert_no_host_sync
from rlcore.testing import reference as ref
from rlcore.testing.hf_fixtures import tiny_tokenizer
from rlcore.testing.loss_strategies import policy_batches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=20, deadline=None)
@given(batch=policy_batches(drifts=("none",)), weighted=st.booleans())
def test_sft_loss_matches_loop_reference(dtype, batch, weighted):
    mask = batch["mask"].float() * 0.5 if weighted else batch["mask"]
    logp = batch["logp"].to(dtype).requires_grad_(True)
    loss, metrics = algos.sft_loss(logp, mask)
    loss.sum().backward()
    want, nll = ref.sft_loss_ref(batch["logp"].to(dtype), mask)
    assert loss.dtype == dtype and logp.grad.dtype == dtype
    assert_close(loss, want, dtype=dtype, scale=max(1.0, float(want.abs().max()) if want.numel() else 1.0))
    assert_close(logp.grad, -mask.double() * (mask != 0), dtype=dtype)
    assert_close(metrics["nll"], torch.tensor(nll), dtype=torch.float32, scale=max(1.0, abs(nll)))


def test_sft_loss_gradcheck_and_no_host_sync():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert torch.autograd.gradcheck(lambda x: algos.sft_loss(x, mask)[0], (logp.requires_grad_(True),))
    assert_no_host_sync(algos.sft_loss, logp.detach().float(), mask)
    recipe = algos.sft()
    batch = {"logp": logp.detach().float(), "mask": mask}
    assert_no_host_sync(lambda b: recipe.loss(b, **recipe.global_counts(b)), batch)


@settings(max_examples=20, deadline=None)
@given(
    batch=policy_batches(min_batch=2, drifts=("none",), dtype=torch.float64),
    mode=st.sampled_from(["token-mean", "seq-mean"]),
    cut=st.integers(1, 5),
)
def test_sft_recipe_is_additive_over_micro_batches(batch, mode, cut):
    """With the whole batch's counts the micro-batches' losses add up to the batch's; token-mean is the NLL."""
    recipe = algos.sft(loss=mode)
    whole = {"logp": batch["logp"], "mask": batch["mask"]}
    counts = recipe.global_counts(whole)
    loss, metrics = recipe.loss(whole, **counts)
    cut = min(cut, batch["logp"].shape[0] - 1)
    parts = sum(
        recipe.loss({k: v[s] for k, v in whole.items()}, **counts)[0] for s in (slice(0, cut), slice(cut, None))
    )
    torch.testing.assert_close(parts, loss)
    if mode == "token-mean":
        torch.testing.assert_close(loss.float(), metrics["nll"])
    else:  # every example weighs the same: the mean over rows of each row's token mean
        m = batch["mask"].double()
        rows = m.sum(-1) > 0
        per_row = torch.where(m != 0, -batch["logp"] * m, 0.0).sum(-1)[rows] / m.sum(-1)[rows]
        torch.testing.assert_close(loss, per_row.mean() if rows.any() else torch.zeros((), dtype=torch.float64))


def test_sft_recipe_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="loss: got 'sum'"):
        algos.sft(loss="sum")
    with pytest.raises(ValueError, match="expected 'logp'"):
        algos.sft().loss({"mask": torch.ones(1, 2)})
    with pytest.raises(ValueError, match="mask"):
        algos.sft_loss(torch.zeros(2, 3), torch.ones(2, 4))


@settings(max_examples=20, deadline=None)
@given(
    rewards=st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5)), min_size=2, max_size=8),
    margin=st.none() | st.floats(-1, 1),
    center=st.floats(0, 0.1),
)
def test_rm_recipe_is_the_mean_bradley_terry_loss_and_additive(rewards, margin, center):
    chosen = torch.tensor([a for a, _ in rewards], dtype=torch.float64)
    rejected = torch.tensor([b for _, b in rewards], dtype=torch.float64)
    recipe = algos.rm(margin=margin, center_coef=center)
    batch = {"chosen_rewards": chosen, "rejected_rewards": rejected}
    counts = recipe.global_counts(batch)
    loss, metrics = recipe.loss(batch, **counts)
    want = ref.bradley_terry_loss_ref(chosen, rejected, margin=margin, center_coef=center).mean()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    half = len(rewards) // 2
    parts = [recipe.loss({k: v[s] for k, v in batch.items()}, **counts)[0] for s in (slice(0, half), slice(half, None))]
    torch.testing.assert_close(sum(parts), loss)
    assert metrics["accuracies"] == pytest.approx(float((chosen > rejected).double().mean()))


def test_rm_recipe_adds_the_process_reward_loss_on_step_labels():
    batch = {
        "chosen_rewards": torch.tensor([0.0]),
        "rejected_rewards": torch.tensor([0.0]),
        "step_logits": torch.tensor([[2.0, -1.0, 5.0]]),
        "step_labels": torch.tensor([[1.0, 1.0, 0.0]]),
        "step_mask": torch.tensor([[1, 1, 0]]),
    }
    recipe = algos.rm(process_coef=0.5)
    counts = recipe.global_counts(batch)
    assert float(counts["num_steps"]) == 2.0
    loss, metrics = recipe.loss(batch, **counts)
    steps = ref.process_reward_loss_ref(batch["step_logits"], batch["step_labels"], batch["step_mask"])
    want = torch.log(torch.tensor(2.0)) + 0.5 * steps.sum() / 2
    torch.testing.assert_close(loss.double(), want.double(), rtol=1e-5, atol=1e-6)
    assert float(metrics["step_accuracy"]) == 0.5
    with pytest.raises(ValueError, match="center_coef"):
        algos.rm(center_coef=-1.0)


@pytest.fixture(scope="module")
def chat_tokenizer():
    return tiny_tokenizer(["<|im_start|>user\nwhat is 1+1?<|im_end|>\n<|im_start|>assistant\n2 3 4 hello"])


def test_sft_rows_mask_the_prompt_and_train_on_the_response_and_its_eos(tmp_path, chat_tokenizer):
    tok = chat_tokenizer
    flat = tmp_path / "sft.jsonl"
    flat.write_text(json.dumps({"prompt": "what is 1+1?", "response": "2"}) + "\n")
    convo = tmp_path / "messages.jsonl"
    messages = [{"role": "user", "content": "what is 1+1?"}, {"role": "assistant", "content": "2"}]
    convo.write_text(json.dumps({"messages": messages, "level": 1}) + "\n")
    a = load_supervised(flat, tokenizer=tok)
    b = load_supervised(convo, tokenizer=tok, messages_key="messages")
    # Both layouts give the same templated prompt (with the generation prompt) and the same response ids.
    assert a.prompts.texts == b.prompts.texts
    assert a.prompts.texts[0].endswith("<|im_start|>assistant\n")
    assert a.response_ids == b.response_ids
    assert a.response_ids[0][-1] == tok.eos_token_id
    assert tok.decode(a.response_ids[0][:-1]) == "2"
    assert b.prompts.columns == {"level": (1,)}
    with pytest.raises(ValueError, match="response_key: column 'answer' is not in"):
        load_supervised(flat, tokenizer=tok, response_key="answer")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": messages[:1]}) + "\n")
    with pytest.raises(ValueError, match="row 0 of .* expected a list of at least two"):
        load_supervised(bad, tokenizer=tok, messages_key="messages")
    long = load_supervised(flat, tokenizer=tok, max_response_length=1, overlong="truncate_right")
    assert long.num_truncated == 1 and len(long.response_ids[0]) == 1
