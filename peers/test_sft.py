"""Peer agreement for the SFT loss: rlcore's ``rl.algo: sft`` path against TRL 1.16's ``SFTTrainer``.

The same prompt-completion rows, the same tokenizer and the same weights on both sides:
TRL prepares its dataset (EOS appended, prompt and completion tokenized, ``completion_only_loss``)
and computes its loss with ``SFTTrainer.compute_loss``; rlcore reads the rows with
``load_supervised``, scores them with the packed ``sft_forward`` and reduces with the
``sft`` recipe's token mean. Loss and every parameter's gradient agree, also over two
micro-batches normalised by the whole batch's token count (TRL's ``num_items_in_batch``,
rlcore's ``global_counts``). TRL has no sequence-mean SFT loss, so ``rl.sft_loss:
seq-mean`` has no peer here. Outside the suite like ``test_issue28.py``; a test whose peer
is absent is skipped.
"""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.data import load_supervised
from rlcore.models import load_causal_lm
from rlcore.testing.hf_fixtures import tiny_tokenizer
from rlcore.train import sft_forward

SHAPE = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
SUFFIXES = ["", " yes", " so it is", " done."]


@pytest.fixture(scope="module")
def trl_sft():
    return pytest.importorskip("trl.trainer.sft_trainer")


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"Q: {a}+{b}=? {a + b}{s}" for a in range(20) for b in range(20) for s in SUFFIXES]
    return tiny_tokenizer(texts, chat_template=None)


def _rows(draw_pairs):
    # The completion starts with a space: both sides tokenize the prompt to the same prefix
    # (TRL tokenizes prompt + completion together; a merge across the boundary would move it).
    return [{"prompt": f"Q: {a}+{b}=?", "completion": f" {a + b}{s}"} for a, b, s in draw_pairs]


def _model(tokenizer):
    return load_causal_lm({**SHAPE, "vocab_size": len(tokenizer)}, seed=0)


def _trl_loss_and_grads(trl_sft, tokenizer, rows, split, tmp_path):
    from datasets import Dataset

    model = _model(tokenizer)
    args = trl_sft.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        completion_only_loss=True,
        use_cpu=True,
    )
    trainer = trl_sft.SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    parts = [trainer.data_collator(examples[:split]), trainer.data_collator(examples[split:])]
    # As Trainer counts it for gradient accumulation: the scored (shifted) labels of all micro-batches.
    n = sum(int((p["labels"][:, 1:] != -100).sum()) for p in parts)
    total = sum(trainer.compute_loss(trainer.model, p, num_items_in_batch=torch.tensor(n)) for p in parts)
    total.backward()
    ids = [list(e["input_ids"]) for e in examples]
    return total.detach(), {k: p.grad for k, p in trainer.model.named_parameters()}, ids


def _rlcore_loss_and_grads(tokenizer, rows, split, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["completion"]}) + "\n" for r in rows))
    data = load_supervised(path, tokenizer=tokenizer, apply_chat_template=False)
    seqs = [(list(p), list(r)) for p, r in zip(data.prompts.prompt_ids, data.response_ids)]
    width = max(len(p) + len(r) for p, r in seqs)
    ids, attention, mask = (torch.zeros(len(seqs), width, dtype=torch.long) for _ in range(3))
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        mask[i, len(p) : len(p) + len(r)] = 1
    model = _model(tokenizer)
    forward = sft_forward(model)
    recipe = algos.sft(loss="token-mean")
    counts = recipe.global_counts({"mask": mask})
    total = 0.0
    for part in (slice(0, split), slice(split, None)):
        cols = {"sft_input_ids": ids[part], "sft_attention_mask": attention[part], "sft_mask": mask[part]}
        loss, _ = recipe.loss(forward(cols), **counts)
        total = total + loss
    total.backward()
    return total.detach(), {k: p.grad for k, p in model.named_parameters()}, [p + r for p, r in seqs]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pairs=st.lists(
        st.tuples(st.integers(0, 19), st.integers(0, 19), st.sampled_from(SUFFIXES)), min_size=2, max_size=5
    ),
    data=st.data(),
)
def test_sft_token_mean_completion_only_matches_trl(trl_sft, tokenizer, tmp_path, pairs, data):
    rows = _rows(pairs)
    split = data.draw(st.integers(1, len(rows) - 1), label="split")
    want, want_grads, trl_ids = _trl_loss_and_grads(trl_sft, tokenizer, rows, split, tmp_path)
    got, grads, ids = _rlcore_loss_and_grads(tokenizer, rows, split, tmp_path)
    assert ids == trl_ids  # the same tokens: prompt, completion and EOS
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert grad is not None and want_grads[name] is not None, name
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
