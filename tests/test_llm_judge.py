"""The LLM-judge reward: the score parser, a scripted judge's verdicts parsed through the engine, a tiny random
judge model run batched through the rollout engine and combined with a rule reward, and the timeout."""

import functools
import time

import pytest
import torch

from rlcore.rewards import LLMJudge, build_reward, parse_score
from rlcore.testing.hf_fixtures import build_tiny_qwen2
from rlcore.train import Rollout


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("judge"), texts=["Score: 0 1 2 3 4 5 6 7 8 9 10 good bad"])


def test_parse_score_takes_the_first_number_clamped_and_scaled():
    assert parse_score("Score: 7") == pytest.approx(0.7)
    assert parse_score("8 out of 10, maybe 9") == pytest.approx(0.8)
    assert parse_score("-3") == 0.0 and parse_score("99.5") == 1.0
    assert parse_score("nothing") is None
    assert parse_score("[[4]]", pattern=r"\[\[(\d)\]\]", min_score=1, max_score=5) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="max_score: got 1"):
        parse_score("1", min_score=1, max_score=1)


class ScriptedEngine:
    """An engine that writes a given verdict for every row (its tokens through the judge's tokenizer)."""

    def __init__(self, model, *, eos_token_id, pad_token_id, max_new_tokens, temperature, verdicts, delay=0.0):
        self.eos, self.pad, self.verdicts, self.delay = eos_token_id, pad_token_id, verdicts, delay
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model.name_or_path)

    def generate(self, prompts, prompt_mask, *, n, generator):
        time.sleep(self.delay)
        rows = [self.tok(v, add_special_tokens=False)["input_ids"] + [self.eos] for v in self.verdicts[: len(prompts)]]
        width = max(map(len, rows))
        responses = torch.tensor([r + [self.pad] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
        return Rollout(prompts, prompt_mask, responses, torch.zeros_like(mask), mask)


def test_a_scripted_verdict_yields_its_score(judge_dir):
    engine = functools.partial(ScriptedEngine, verdicts=["Score: 7", "bad", "10"])
    judge = LLMJudge(judge_dir, engine=engine, default=-1.0, batch_size=4)
    scores = judge(["1+1?", "2+2?", "3+3?"], ["2", "5", "6"])
    torch.testing.assert_close(scores, torch.tensor([0.7, -1.0, 1.0]))
    assert judge.last_texts == ["Score: 7", "bad", "10"]


def test_a_slow_judge_times_out_to_the_default_score(judge_dir):
    engine = functools.partial(ScriptedEngine, verdicts=["Score: 9"], delay=1.0)
    judge = LLMJudge(judge_dir, engine=engine, default=0.25, timeout=0.05)
    scores = judge(["q"], ["a"])
    torch.testing.assert_close(scores, torch.tensor([0.25]))
    assert judge.timeouts == 1 and judge.last_texts == []
    judge.timeout = 30.0  # the next call waits for the generation under way, then runs its own
    torch.testing.assert_close(judge(["q"], ["a"]), torch.tensor([0.9]))


def test_a_tiny_random_judge_runs_batched_through_the_rollout_engine_beside_a_rule_reward(judge_dir):
    template = "Rate: {prompt} -> {response}. Score:"
    reward = build_reward(
        [
            {
                "reward": "llm_judge",
                "weight": 0.5,
                "kwargs": {
                    "path": str(judge_dir),
                    "template": template,
                    "batch_size": 2,
                    "max_new_tokens": 4,
                    "default": 0.5,
                },
            },
            {"reward": "length", "weight": 1.0},
        ]
    )
    prompts, responses = ["1+1?", "2+2?", "3+3?"], ["2", "4", "six"]
    scores = reward(prompts, responses)
    judge = next(r.reward for _, r in reward.rewards if r.name == "llm_judge")
    assert scores.shape == (3,) and torch.isfinite(scores).all()
    assert len(judge.last_texts) == 3  # three verdicts from two batches
    parsed = [parse_score(t) for t in judge.last_texts]
    want = torch.tensor([0.5 if s is None else s for s in parsed])
    torch.testing.assert_close(judge(prompts, responses), want)  # greedy: the same verdicts again
    torch.testing.assert_close(scores, 0.5 * want + build_reward(["length"])(prompts, responses))


def test_bad_judge_settings_name_the_argument(judge_dir, tmp_path):
    with pytest.raises(ValueError, match="path: got .* expected a local judge-model directory"):
        LLMJudge(tmp_path / "missing")
    with pytest.raises(ValueError, match="template: got .* expected a format string"):
        LLMJudge(judge_dir, template="{question}")
    with pytest.raises(ValueError, match="timeout: got 0"):
        LLMJudge(judge_dir, timeout=0)
