"""`rl.algo: sft` and `rl.algo: rm` through the trainer: the packed SFT forward is the masked NLL of the response,
the shipped configs run and learn on a few steps, the trained reward model loads as the `reward_model` reward and
scores as it did in training, and the config refuses what these recipes cannot run."""

from pathlib import Path

import pytest
import torch

from rlcore import algos
from rlcore.models import load_causal_lm
from rlcore.rewards import RewardModel, build_reward
from rlcore.train import last_token_rewards, load_config, sft_forward, train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
QUICK = ["trainer.progress=false", "trainer.plot=false", "trainer.threads=1"]
TINY = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 11,
    "max_position_embeddings": 32,
}


def test_the_packed_sft_forward_is_the_masked_nll_of_the_response():
    """Rows packed padding-free give the padded HF forward's log-probs; the prompt and the padding never count."""
    model = load_causal_lm(TINY, seed=0)
    rows = [([3, 4, 5], [6, 7, 1]), ([8, 2], [9, 1])]
    width = max(len(p) + len(r) for p, r in rows)
    ids, attention, mask = (torch.zeros(len(rows), width, dtype=torch.long) for _ in range(3))
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        mask[i, len(p) : len(p) + len(r)] = 1
    batch = sft_forward(model)({"sft_input_ids": ids, "sft_attention_mask": attention, "sft_mask": mask})
    recipe = algos.sft()
    loss, _ = recipe.loss(batch, **recipe.global_counts(batch))
    logits = model(input_ids=ids, attention_mask=attention).logits.log_softmax(-1)
    want = [-logits[i, t - 1, ids[i, t]] for i in range(len(rows)) for t in range(width) if mask[i, t]]
    torch.testing.assert_close(loss, torch.stack(want).mean(), rtol=1e-4, atol=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_sft_config_trains_on_demonstrations_and_exports_a_causal_lm(tmp_path):
    cfg = load_config(CONFIGS / "sft_tiny.yaml", [f"trainer.output_dir={tmp_path}", "trainer.steps=4", *QUICK])
    run = train(cfg)
    losses = [r["loss"] for r in run.records]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert all(r["nll"] == pytest.approx(r["loss"], rel=1e-5) for r in run.records)
    exported = load_causal_lm(tmp_path / "hf", what="export")
    assert exported.config.vocab_size == run.policy.config.vocab_size


def test_rm_config_trains_and_the_export_loads_as_the_reward_model_reward(tmp_path):
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.steps=3", "model.init_from=null", *QUICK]
    cfg = load_config(CONFIGS / "rm_tiny.yaml", overrides)
    run = train(cfg)
    assert [set(r) >= {"loss", "accuracies", "margins"} for r in run.records] == [True] * 3
    assert run.critic is not None
    # The reward_model reward through the config's rewards list, on text; the trained model on ids.
    reward = build_reward(
        [{"reward": "reward_model", "kwargs": {"path": str(tmp_path / "reward_model"), "append_eos": True}}]
    )
    prompts, responses = ["abc>", "fe>", "abc>"], ["cba", "ef", "cab"]
    scores = reward(prompts, responses)
    tok = RewardModel(tmp_path / "reward_model")._load()[1]
    ids = [tok(p + r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for p, r in zip(prompts, responses)]
    width = max(map(len, ids))
    padded = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    with torch.no_grad():
        trained = last_token_rewards(run.critic.eval(), padded, attention)
    # The sequence-classification head has no bias: the export's rewards are the trained ones less that constant.
    torch.testing.assert_close(scores, trained - run.critic.score.bias.detach()[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rl.algo=sft", "data.path=null"], "config key 'data.path': got null with rl.algo 'sft', expected an SFT"),
        (["rl.algo=rm", "data.path=null"], "config key 'data.path': got null with rl.algo 'rm', expected a preference"),
        (["rl.rm_margin=0.5"], "config key 'rl.rm_margin' / 'rl.rm_center_coef': set with rl.algo 'sft'"),
        (["data.messages_key=messages", "rl.algo=dpo"], "config key 'data.messages_key': got 'messages' with rl.algo"),
        (["rl.num_rollouts=4"], "config key 'rl.num_rollouts': got 4, expected 1 for sft"),
        (["rl.sft_loss=sum"], "rl.sft_loss"),
    ],
)
def test_the_config_refuses_what_sft_and_rm_cannot_run(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("/", ".")):
        load_config(CONFIGS / "sft_tiny.yaml", ["data.path=null" if o == "data.path=null" else o for o in overrides])
