"""Multi-turn agent rollouts through vLLM: rlcore.agent.multi_turn_rollout with a VLLMEngine as its turn sampler.

One engine for the module (vLLM's start-up is the slow part). The environment answers
every turn with an observation of token ids and never ends the episode, so every
trajectory runs all its turns and the engine continues each one from its ids (prompt,
policy tokens, observation tokens) three times. The model has head_dim 32 (vLLM's CPU
attention serves 32, 64, ...) and 32-token KV blocks, so the prefix cache finds a
trajectory's earlier turns again.
"""

from pathlib import Path

import pytest
import torch
import transformers

from rlcore.agent import StepResult, TurnSampler, multi_turn_rollout
from rlcore.seeding import Purpose, RowStream
from rlcore.train import VLLMEngine, VLLMOptions, load_config, read_metrics, train
from rlcore.train.cli import main

ROOT = Path(__file__).resolve().parents[1]

EOS, PAD, VOCAB, STOP = 1, 0, 64, 2
PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23], [24, 25, 26, 27, 28]]
OBSERVATION = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46]
MODEL = {
    "model_type": "qwen2",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
BUDGETS = dict(max_turns=3, max_new_tokens=12, max_total_tokens=64)


class Observer:
    """Each turn: an observation of token ids, reward = the turn's length, never done."""

    def reset(self, sample):
        return ""

    def step(self, action):
        return StepResult(list(OBSERVATION), float(len(action)), False, {})


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    fields = dict(MODEL)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def policy():
    return tiny_model()


@pytest.fixture(scope="module")
def engine(policy):
    options = VLLMOptions(kv_cache_memory_bytes=16 << 20, max_num_seqs=16, block_size=32)
    e = VLLMEngine.from_module(policy, eos_token_id=EOS, pad_token_id=PAD, options=options)
    yield e
    e.close()


def rollout(model, prompts=PROMPTS, *, temperature=0.0, rows=None):
    stream = RowStream(7, Purpose.SAMPLING, 3, torch.tensor(rows if rows is not None else range(len(prompts))))
    return multi_turn_rollout(
        model,
        prompts,
        [Observer() for _ in prompts],
        decode=lambda ids: "x" * len(ids),
        encode_observation=lambda text: [],
        eos_token_id=EOS,
        pad_token_id=PAD,
        stop_token_ids=(STOP,),
        temperature=temperature,
        generator=stream,
        **BUDGETS,
    )


def test_the_engine_is_a_turn_sampler(engine, policy):
    assert isinstance(engine, TurnSampler) and not isinstance(policy, TurnSampler)


def test_greedy_trajectories_equal_the_torch_models_and_logp_within_1e_4(engine, policy):
    """Three turns with observations in between: the same tokens, masks and rewards as the torch rollout.

    Greedy in float32 on the same weights; vLLM's log-probs of the policy tokens agree with
    the torch decode loop's within 1e-4 (different kernels and summation orders; the
    differences seen are about 1e-6).
    """
    ours, ref = rollout(engine), rollout(policy)
    assert ours["num_turns"].tolist() == [3, 3, 3]  # two observations appended in each trajectory
    for key in ("prompts", "responses", "mask", "trajectory_mask", "rewards", "scores", "truncated"):
        assert torch.equal(ours[key], ref[key]), key
    mask = ref["mask"].bool()
    assert (ours["rollout_logp"][mask] - ref["rollout_logp"][mask]).abs().max() < 1e-4
    assert torch.equal(ours["rollout_logp"][~mask], torch.zeros_like(ours["rollout_logp"][~mask]))


def test_a_turn_continues_from_the_cached_prefix(engine):
    """Turns 2 and 3 find the earlier turns' KV blocks (32 tokens each) in the prefix cache."""
    before = engine.cached_tokens
    rollout(engine, temperature=1.0)
    # The first trajectory's turn 2 fills its first block (18 prompt + >= 1 sampled + 17 observed
    # tokens); its turn 3 finds that block again.
    assert engine.cached_tokens - before >= 32


def test_seeded_trajectories_reproduce_and_do_not_depend_on_the_batch(engine):
    a, b = rollout(engine, temperature=1.0), rollout(engine, temperature=1.0)
    for key in ("responses", "mask", "rollout_logp"):
        assert torch.equal(a[key], b[key]), key
    alone = rollout(engine, PROMPTS[1:2], temperature=1.0, rows=[1])
    n = int(alone["trajectory_mask"].sum())
    assert torch.equal(alone["responses"][0, :n], a["responses"][1, :n])
    assert torch.equal(alone["rollout_logp"][0, :n], a["rollout_logp"][1, :n])


def test_on_stop_hands_each_row_over_once_with_its_tokens(engine):
    seen = []
    turn = engine.sample_turn(
        [[3, 4, 5], [6, 7]],
        [5, 9],
        stop_token_ids=(EOS, STOP),
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
        on_stop=lambda row, tokens: seen.append((row, tokens)),
    )
    assert sorted(row for row, _ in seen) == [0, 1]
    for row, tokens in seen:
        assert tokens == turn.tokens[row, : turn.lengths[row]].tolist()
    assert turn.lengths.tolist()[0] <= 5 and turn.lengths.tolist()[1] <= 9


@pytest.mark.parametrize(
    "contexts, budgets, match",
    [
        ([[3, 4]], [0], "budgets: got \\[0\\], expected 1 ints >= 1"),
        ([[3, 4]], [4, 4], "budgets: got \\[4, 4\\], expected 1 ints"),
        ([[]], [4], "contexts\\[0\\]: got 0 tokens"),
        ([[3] * 120], [12], "contexts\\[0\\]: got 120 tokens with a budget of 12, expected 1 to 116"),
    ],
)
def test_bad_turns_are_refused_naming_the_argument(engine, contexts, budgets, match):
    with pytest.raises(ValueError, match=match):
        engine.sample_turn(contexts, budgets, stop_token_ids=(EOS,))
    assert not engine.llm.llm_engine.has_unfinished_requests()


# configs/agent_calc_tiny.yaml on vLLM, made small (test_trainer_agent's overrides; head_dim stays 32).
TINY_AGENT = [
    "deploy.engine=vllm",
    "model.model_name_or_path.intermediate_size=64",
    "model.model_name_or_path.num_hidden_layers=1",
    "rl.batch_size=4",
    "rl.mini_batch_size=2",
    "rl.num_rollouts=2",
    "data.digits=2",
    "rl.multi_turn.max_new_tokens=24",
    "rl.multi_turn.max_total_tokens=40",
    "rl.multi_turn.eval_every=1",
    "rl.multi_turn.eval_size=4",
    "deploy.vllm.kv_cache_memory_bytes=8388608",
    "deploy.vllm.block_size=32",
    "trainer.warmup_steps=10",
    "trainer.warmup_batch_size=16",
    "trainer.progress=false",
    "trainer.plot=false",
    "trainer.steps=2",
]


def _agent_run(out, *extra):
    cfg = load_config(ROOT / "configs" / "agent_calc_tiny.yaml", [*TINY_AGENT, f"trainer.output_dir={out}", *extra])
    train(cfg)
    return read_metrics(out / "metrics.jsonl")


def test_the_agent_config_trains_on_vllm_co_located_and_in_the_worker(tmp_path):
    """The trainer's agent rollout on vLLM, in its process and in the rollout worker's (environments beside the engine).

    ``mismatch/*`` compares vLLM's log-probs of the policy tokens with the trainer's
    recomputed ones (float32 on both sides: about 1e-5). The blocking disaggregated run
    sends the same row-keyed requests to the same engine: its records equal the co-located
    run's, the trajectory metrics the worker sends back included.
    """
    records = _agent_run(tmp_path / "co-located")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        for key in ("turns", "tool_calls", "greedy_reward", "reward", "loss", "sync_s"):
            assert torch.isfinite(torch.tensor(r[key])), (key, r)
        assert 1 <= r["turns"] <= 3 and r["policy_tokens"] + r["observation_tokens"] <= 40
        assert r["mismatch/logp_abs_max"] < 1e-3, r
    worker = _agent_run(tmp_path / "worker", "deploy.mode=disaggregated", "deploy.rollout_timeout=300")
    timing = ("_s", "tokens_per_s", "bubble/")
    for ours, theirs in zip(worker, records, strict=True):
        same = {k: v for k, v in theirs.items() if not any(t in k for t in timing)}
        assert "greedy_reward" in same and "tool_calls" in same
        assert {k: ours.get(k) for k in same} == same


def test_an_agent_model_vllm_cannot_serve_is_refused_in_one_line(tmp_path, capsys):
    """configs/agent_calc_tiny.yaml with four heads of 16 channels: vLLM's CPU attention does not serve them."""
    argv = ["train", "--config", str(ROOT / "configs" / "agent_calc_tiny.yaml"), "deploy.engine=vllm"]
    argv += ["model.model_name_or_path.num_attention_heads=4"]
    argv += ["trainer.warmup_steps=0", "trainer.progress=false", f"trainer.output_dir={tmp_path}"]
    assert main(argv) == 2
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlcore:")]
    assert len(ours) == 1 and ours[0].startswith("rlcore: error: model: got head dimension 16"), ours
