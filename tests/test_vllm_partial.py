"""Interruptible (partial) rollouts on vLLM: a version published mid-call is taken between two engine steps.

One engine for the module (vLLM's start-up is the slow part); every test starts from
version 0's weights. New versions reach the engine through the one sync path
(:class:`rlcore.dataflow.WeightSync` into :meth:`VLLMEngine.receiver`), from the
``refresh`` callback, as the rollout worker's :class:`rlcore.train.RolloutServer` does.
The model has head_dim 32 (vLLM's CPU attention serves 32, 64, 80, ...); KV blocks of
32 tokens, and one prompt longer than a block, so a prefix cache still holding the old
weights' keys and values after a switch would be hit (and caught by the log-prob check).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers

from rlcore.dataflow import WeightSync
from rlcore.seeding import Purpose, RowStream
from rlcore.testing.reference import partial_greedy_ref, response_logprobs_ref
from rlcore.train import (
    RolloutServer,
    VLLMEngine,
    VLLMOptions,
    WorkerDeployment,
    left_pad,
    load_config,
    read_metrics,
    train,
)
from rlcore.train.step_metrics import StepMetrics
from tiny_runs import QUIET, TINY_BATCH, TINY_ROLLOUT

ROOT = Path(__file__).resolve().parents[1]
EOS, PAD, VOCAB = 1, 0, 100
LONG = [2 + (k * 7) % 90 for k in range(36)]  # more than one 32-token KV block
PROMPTS = [[2, 3, 4, 5, 6], [7, 8], LONG]
MODEL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("qwen2", **MODEL)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def versions():
    return [tiny_model(s) for s in range(3)]


@pytest.fixture(scope="module")
def module_engine(versions):
    options = VLLMOptions(kv_cache_memory_bytes=16 << 20, max_num_seqs=16, block_size=32)
    engine = VLLMEngine.from_module(
        versions[0], eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=10, temperature=1.0, options=options
    )
    yield engine
    engine.close()


@pytest.fixture
def engine(module_engine, versions):
    """The module's engine holding version 0's weights."""
    WeightSync(dict(versions[0].named_parameters())).sync(0, module_engine.receiver())
    return module_engine


def scripted(engine, versions, switches):
    """A refresh that syncs ``versions[k]`` into the engine when asked for the ``switches[k-1]``-th time.

    The engine asks after each step; with every prompt prefilled in the first step, the
    ``s``-th question comes after ``s`` tokens of every row: the switch is at response position ``s``.
    """
    asked = []

    def refresh():
        asked.append(None)
        if len(asked) not in switches:
            return None
        v = switches.index(len(asked)) + 1
        WeightSync(dict(versions[v].named_parameters())).sync(v, engine.receiver())
        return v

    return refresh


def never():
    return None


def stream():
    return RowStream(0, Purpose.SAMPLING, 4, torch.arange(6))


def test_never_interrupted_equals_the_plain_vllm_rollout_token_for_token(engine):
    """No new version in flight: the stepped path sends the same seeded requests as ``LLM.generate``."""
    ids, mask = left_pad(PROMPTS, PAD)
    plain = engine.generate(ids, mask, n=2, generator=stream())
    part = engine.generate(ids, mask, n=2, generator=stream(), refresh=never, version=3)
    for a, b in zip(plain[:5], part[:5]):
        assert torch.equal(a, b)
    assert plain.versions is None and torch.equal(part.versions, 3 * part.mask)
    assert len({tuple(r) for r in plain.responses.tolist()}) == 6  # sampled, not a constant
    # A plain torch.Generator (one seed per row drawn from it): the same again.
    a = engine.generate(ids, mask, n=2, generator=torch.Generator().manual_seed(3))
    b = engine.generate(ids, mask, n=2, generator=torch.Generator().manual_seed(3), refresh=never)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logp, b.logp)


@pytest.mark.parametrize("switches", [[1], [3], [2, 5]])
def test_greedy_partial_rollout_equals_the_loop_reference(engine, versions, switches):
    """Greedy: each token is the argmax of the version that held the engine at its position (float32)."""
    greedy = engine.sampling(temperature=0.0)
    ids, mask = left_pad(PROMPTS, PAD)
    r = greedy.generate(ids, mask, n=1, generator=None, refresh=scripted(engine, versions, switches))
    expected = partial_greedy_ref(versions, switches, PROMPTS, eos_token_id=EOS, max_new_tokens=10)
    for i, (tokens, vs) in enumerate(expected):
        on = r.mask[i] == 1
        assert r.responses[i][on].tolist() == tokens
        assert r.versions[i][on].tolist() == vs
        assert bool((r.versions[i][~on] == 0).all())
    assert len({len(set(vs)) for _, vs in expected}) == 1 and len(set(expected[0][1])) == len(switches) + 1


def test_each_token_carries_the_version_and_log_prob_that_drew_it(engine, versions):
    """Sampled, switched at positions 2 and 4: tokens before the switch are the plain rollout's, version 0.

    Every token's log-prob is the one of the version it records, recomputed by the
    trainer's model from the prompt and the tokens before it (1e-4: both sides float32,
    measured ~1e-6); the old weights' cached keys and values would be off by far more.
    """
    ids, mask = left_pad(PROMPTS, PAD)
    plain = engine.generate(ids, mask, n=2, generator=stream())
    r = engine.generate(ids, mask, n=2, generator=stream(), refresh=scripted(engine, versions, [2, 4]), version=0)
    assert torch.equal(r.responses[:, :2], plain.responses[:, :2]) and torch.equal(r.logp[:, :2], plain.logp[:, :2])
    assert not torch.equal(r.responses, plain.responses)
    for i in range(r.responses.shape[0]):
        on = r.mask[i] == 1
        prompt, response = PROMPTS[i // 2], r.responses[i][on].tolist()
        vs = r.versions[i][on].tolist()
        assert vs == [min(sum(1 for s in (2, 4) if s <= t), 2) for t in range(len(vs))]
        for v in set(vs):
            want = torch.tensor(response_logprobs_ref(versions[v], prompt, response), dtype=torch.float32)
            at = torch.tensor(vs) == v
            torch.testing.assert_close(r.logp[i][on][at], want[at], atol=1e-4, rtol=0)
    assert bool((r.logp[r.mask == 0] == 0).all()) and bool((r.responses[r.mask == 0] == PAD).all())


def test_the_same_interruptions_reproduce_the_same_rollout(engine, versions):
    ids, mask = left_pad(PROMPTS, PAD)
    a = engine.generate(ids, mask, n=2, generator=stream(), refresh=scripted(engine, versions, [3]))
    WeightSync(dict(versions[0].named_parameters())).sync(0, engine.receiver())
    b = engine.generate(ids, mask, n=2, generator=stream(), refresh=scripted(engine, versions, [3]))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_a_refresh_that_raises_leaves_no_request_behind(engine):
    ids, mask = left_pad(PROMPTS, PAD)

    def broken():
        raise RuntimeError("the weights could not be read")

    with pytest.raises(RuntimeError, match="could not be read"):
        engine.generate(ids, mask, n=2, generator=stream(), refresh=broken)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="refresh: got int, expected a callable"):
        engine.generate(ids, mask, n=2, generator=stream(), refresh=3)
    assert engine.generate(ids, mask, n=1, generator=None, refresh=never).responses.shape[0] == 3


# --- the trainer: deploy.engine vllm, disaggregated, async, partial rollouts ---------------------------

SMALL = [
    "model.model_name_or_path.intermediate_size=64",
    "model.model_name_or_path.num_hidden_layers=1",
    "deploy.vllm.kv_cache_memory_bytes=16777216",
    "deploy.vllm.max_num_seqs=16",
    "rl.temperature=1.0",
]
PARTIAL = ["deploy.mode=disaggregated", "deploy.async_infer=true", "deploy.partial_rollouts=true"]


def vllm_cfg(out, *extra):
    return load_config(
        ROOT / "configs" / "grpo_tiny_vllm.yaml",
        [*TINY_BATCH, *TINY_ROLLOUT, *QUIET, *SMALL, f"trainer.output_dir={out}", *extra],
    )


def by_length(prompts, responses, **columns):
    return [len(r) / 6 for r in responses]


class BehindUntilNewer:
    """The worker's :class:`rlcore.dataflow.LatestWeights`, whose first look after the first token waits for a newer version.

    Only while the call's rows are behind (the version held is older than the
    iteration's): the trainer is then updating on the previous iteration and publishes
    the next version (bounded wait). Every such rollout is interrupted after its first
    token, whatever the machine's load.
    """

    def __init__(self, latest, iteration):
        self.latest, self.iteration, self.asked = latest, iteration, 0

    @property
    def version(self):
        return self.latest.version

    @property
    def params(self):
        return self.latest.params

    def __call__(self):
        self.asked += 1  # 1: the server's look before it starts; 2: the engine's after the first token
        if self.asked == 2 and self.latest.version < self.iteration:
            end = time.monotonic() + 120
            while time.monotonic() < end:
                if self.latest():
                    return True
                time.sleep(0.01)
        return self.latest()


def interrupted_server(cfg_dict, vocab_size, build):
    """In the worker: the trainer's RolloutServer (vLLM), its rollouts made to meet the next version mid-way."""
    server = RolloutServer(cfg_dict, vocab_size, build)
    assert isinstance(server.engine, VLLMEngine)

    def generate(batch, weights, latest=None):
        assert latest is not None  # deploy.partial_rollouts: the worker is interruptible
        return server(batch, weights, BehindUntilNewer(latest, int(batch["iteration"][0])))

    return generate


def test_a_partial_rollout_run_on_vllm_trains_every_row_once_within_the_bound(tmp_path, monkeypatch):
    """Each iteration's rows scored once and trained once, rows of two versions among them, every token within 1."""
    scored: list[int] = []
    trained: dict[int, list[tuple[tuple[int, ...], list[int]]]] = {}
    on_metrics = StepMetrics.on_metrics

    def reward(prompts, responses, **columns):  # one call per iteration (rewards in the trainer's process)
        scored.append(len(responses))
        return by_length(prompts, responses)

    def record(self, b, loss, metrics):  # the rows each optimiser update trains, and their tokens' versions
        for it, ids, keep, vs, m in zip(b["iteration"], b["prompts"], b["prompt_mask"], b["token_version"], b["mask"]):
            prompt = tuple(ids[keep != 0].tolist())
            trained.setdefault(int(it), []).append((prompt, sorted(set(vs[m != 0].tolist()))))
        on_metrics(self, b, loss, metrics)

    monkeypatch.setattr(StepMetrics, "on_metrics", record)
    monkeypatch.setattr(WorkerDeployment, "server", staticmethod(interrupted_server))
    cfg = vllm_cfg(tmp_path, "trainer.steps=3", "deploy.staleness=1", *PARTIAL)
    run = train(cfg, reward=reward)
    assert [r["step"] for r in run.records] == [0, 1, 2]
    n, rows = cfg.rl.n_samples, cfg.rl.batch_size * cfg.rl.n_samples
    assert scored == [rows] * 3
    assert sorted(trained) == [0, 1, 2]
    for it, got in trained.items():
        assert len(got) == rows  # no row trained twice, none left out (epochs 1)
        assert all(c % n == 0 for c in Counter(p for p, _ in got).values())  # whole groups of n samples
        for _, vs in got:
            assert vs and all(0 <= it - v <= 1 for v in vs), (it, vs)  # the bound on the oldest token
    two = [vs for got in trained.values() for _, vs in got if len(vs) == 2]
    assert two and all(vs[1] == vs[0] + 1 for vs in two)  # interrupted rows: the old version, then the next
    for r in read_metrics(tmp_path / "metrics.jsonl"):
        assert 0 <= r["token_lag"] <= r["token_lag_max"] <= 1 and r["sync_bytes"] > 0
        assert r["token_lag_max"] <= r["policy_lag_max"]
        assert sum(r[f"token_lag/{k}"] for k in range(2)) == pytest.approx(1.0)


def test_vllm_partial_rollouts_parse_and_what_they_refuse(tmp_path):
    cfg = vllm_cfg(tmp_path, *PARTIAL)
    assert cfg.deploy.partial_rollouts and cfg.deploy.engine == "vllm"
    with pytest.raises(ValueError, match=r"config key 'deploy.engine': got 'vllm' with deploy.carry_over true"):
        vllm_cfg(tmp_path, *PARTIAL, "deploy.carry_over=true")
    agent = ["deploy.engine=vllm", *PARTIAL, "trainer.warmup_steps=0"]
    with pytest.raises(ValueError, match=r"config key 'rl.multi_turn': got 'a section' with deploy.partial_rollouts"):
        load_config(ROOT / "configs" / "agent_calc_tiny.yaml", [*agent, f"trainer.output_dir={tmp_path}"])
