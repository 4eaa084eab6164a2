"""rlcore.agent.multi_turn_rollout on a tiny random Qwen2: single-turn equivalence, token order, budgets, gradients, faults, stage."""

import time

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import algos
from rlcore.agent import (
    STAGE_OUTPUTS,
    Multiplication,
    MultiTurnConfig,
    StepResult,
    StepRunner,
    ToolEnv,
    multi_turn_rollout,
    multi_turn_stage,
)
from rlcore.dataflow import StageGraph, run_pipeline, stage
from rlcore.ops import logprobs_from_logits
from rlcore.testing.reference import response_logprobs_ref
from rlcore.train.rollout import generate, left_pad

EOS, PAD, VOCAB = 1, 0, 16


def tiny_model(seed=0, vocab=VOCAB):
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def runner():
    with StepRunner(max_concurrency=16, timeout=2.0) as r:
        yield r


def ids_text(ids):
    """A lossless action text: the environment sees exactly the ids the policy sampled."""
    return ",".join(map(str, ids))


class OneShot:
    """Never calls a tool: the first turn ends the episode."""

    def reset(self, sample):
        return ""

    def step(self, action):
        return StepResult("", 0.5, True, {})


class Scripted:
    """Answers each turn with ``obs[k]`` token ids and reward ``k + 1``; records the actions; done after ``len(obs)`` turns."""

    def __init__(self, obs):
        self.obs, self.actions = obs, []

    def reset(self, sample):
        return ""

    def step(self, action):
        self.actions.append([int(t) for t in action.split(",")] if action else [])
        k = len(self.actions) - 1
        if k == len(self.obs):
            return StepResult("", 10.0, True, {"tool_calls": 0})
        return StepResult(
            self.obs[k], float(k + 1), False, {"tool_calls": 1, "tool_errors": k % 2, "tool_latency": 0.01}
        )


prompt_lists = st.lists(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=5), min_size=1, max_size=4)


@settings(max_examples=12)
@given(
    prompts=prompt_lists,
    seed=st.integers(0, 2**16),
    max_new_tokens=st.integers(1, 8),
    temperature=st.sampled_from([1.0, 0.7, 0.0]),
    top=st.sampled_from([(0, 1.0), (4, 1.0), (0, 0.8)]),
)
def test_single_turn_equals_generate(model, runner, prompts, seed, max_new_tokens, temperature, top):
    top_k, top_p = top
    ids, mask = left_pad(prompts, PAD)
    ref = generate(
        model,
        ids,
        mask,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(seed),
    )
    out = multi_turn_rollout(
        model,
        prompts,
        [OneShot() for _ in prompts],
        decode=ids_text,
        encode_observation=list,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_turns=1,
        max_new_tokens=max_new_tokens,
        max_total_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(seed),
        runner=runner,
    )
    assert torch.equal(out["prompts"], ref.prompts) and torch.equal(out["prompt_mask"], ref.prompt_mask)
    assert torch.equal(out["responses"], ref.responses)
    # The masks are float32, as rlcore.train.COLUMNS declares them; the single-turn sampler's is int64.
    assert out["mask"].dtype == out["trajectory_mask"].dtype == torch.float32
    assert torch.equal(out["mask"], ref.mask.float()) and torch.equal(out["trajectory_mask"], ref.mask.float())
    assert torch.equal(out["rollout_logp"], ref.logp)
    assert out["num_turns"].eq(1).all() and out["scores"].eq(0.5).all()
    # The same loss, through the GRPO recipe, from either batch.
    n = len(prompts)
    scores = torch.arange(n, dtype=torch.float32) % 2
    logp = ref.logp + 0.01 * torch.arange(ref.logp.numel()).reshape(ref.logp.shape).sin()
    losses = []
    for r_mask, r_logp in ((ref.mask, ref.logp), (out["mask"], out["rollout_logp"])):
        batch = {
            "scores": scores,
            "group_ids": torch.zeros(n, dtype=torch.long),
            "mask": r_mask.float(),
            "old_logp": r_logp,
            "ref_logp": r_logp,
            "logp": logp,
        }
        algo = algos.grpo()
        losses.append(algo.loss(algo.advantages(batch))[0])
    assert torch.equal(losses[0], losses[1])


def _check_trajectory(model, out, envs, obs, *, max_turns, max_new_tokens, max_total_tokens):
    for i, env in enumerate(envs):
        valid = out["trajectory_mask"][i] == 1
        row, policy = out["responses"][i][valid].tolist(), out["mask"][i][valid].tolist()
        # Token in, token out: policy ids as sampled (the env saw them losslessly), then each observation's ids.
        expected, flags = [], []
        for k, action in enumerate(env.actions):
            assert 1 <= len(action) <= max_new_tokens
            expected += action
            flags += [1] * len(action)
            if k < len(env.actions) - 1:
                expected += obs[i][k]
                flags += [0] * len(obs[i][k])
        assert row == expected and policy == flags
        assert len(env.actions) == out["num_turns"][i] <= max_turns
        assert len(row) <= max_total_tokens and out["responses"].shape[1] <= max_total_tokens
        # Turn rewards k + 1 sit on each turn's last policy token.
        rewards = out["rewards"][i][valid]
        ends = [j for j in range(len(flags)) if flags[j] and (j + 1 == len(flags) or not flags[j + 1])]
        assert rewards.nonzero().flatten().tolist() == [j for j in ends if rewards[j] != 0]
        assert torch.equal(out["scores"][i], rewards.sum())
        finished = len(env.actions) == len(obs[i]) + 1
        assert bool(out["truncated"][i]) == (not finished)
        # The sampled log-probs are those of a teacher-forced forward over the stored ids.
        prompt = out["prompts"][i][out["prompt_mask"][i] == 1].tolist()
        ref = torch.tensor(response_logprobs_ref(model, prompt, row), dtype=torch.float32)
        got = out["rollout_logp"][i][valid]
        torch.testing.assert_close(got[torch.tensor(flags) == 1], ref[torch.tensor(flags) == 1], atol=1e-4, rtol=0)
        assert got[torch.tensor(flags) == 0].eq(0).all()


@settings(max_examples=10)
@given(
    prompts=prompt_lists,
    data=st.data(),
    seed=st.integers(0, 2**16),
    max_turns=st.integers(1, 4),
    max_new_tokens=st.integers(1, 6),
    max_total_tokens=st.integers(1, 30),
)
def test_trajectories_concatenate_policy_and_observation_ids_within_budgets(
    model, runner, prompts, data, seed, max_turns, max_new_tokens, max_total_tokens
):
    tokens = st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=5)
    obs = [data.draw(st.lists(tokens, min_size=0, max_size=4)) for _ in prompts]
    envs = [Scripted(o) for o in obs]
    out = multi_turn_rollout(
        model,
        prompts,
        envs,
        decode=ids_text,
        encode_observation=list,
        eos_token_id=EOS,
        pad_token_id=PAD,
        stop_token_ids=[2],
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        max_total_tokens=max_total_tokens,
        generator=torch.Generator().manual_seed(seed),
        runner=runner,
    )
    _check_trajectory(
        model, out, envs, obs, max_turns=max_turns, max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens
    )
    calls = torch.tensor([min(len(e.actions), len(o)) for e, o in zip(envs, obs)])
    assert torch.equal(out["num_tool_calls"], calls)


def _full_logits(model, out):
    ids = torch.cat([out["prompts"], out["responses"]], 1)
    attention = torch.cat([out["prompt_mask"], out["trajectory_mask"].long()], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    logits.retain_grad()
    width = out["prompts"].shape[1]
    logp, entropy = logprobs_from_logits(logits[:, width - 1 : -1], out["responses"], with_entropy=True)
    return logits, logp, entropy


@pytest.mark.parametrize("recipe", ["grpo", "rloo", "dapo", "ppo"])
def test_observation_and_prompt_tokens_get_no_gradient(recipe):
    model = tiny_model(seed=1).train()
    model.config.use_cache = False
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
    obs = [[[5, 5, 5], [6]], [[7, 8]], [], [[9, 9, 9, 9], [10, 11]]]
    envs = [Scripted(o) for o in obs]
    with torch.no_grad():
        model.eval()
        out = multi_turn_rollout(
            model,
            prompts,
            envs,
            decode=ids_text,
            encode_observation=list,
            eos_token_id=EOS,
            pad_token_id=PAD,
            stop_token_ids=[2],
            max_turns=3,
            max_new_tokens=4,
            max_total_tokens=24,
            generator=torch.Generator().manual_seed(0),
        )
        model.train()
    assert (out["trajectory_mask"] - out["mask"]).sum() > 0  # there are observation tokens
    logits, logp, entropy = _full_logits(model, out)
    mask = out["mask"].float()
    batch = {
        "scores": out["scores"],
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "mask": mask,
        "logp": logp,
        "old_logp": out["rollout_logp"],
        "ref_logp": out["rollout_logp"] - 0.1 * mask,
        "entropy": entropy,
        "rewards": out["rewards"],
    }
    if recipe == "ppo":
        values = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape)
        batch.update(old_values=values, values=values + 0.1)
    algo = {
        "grpo": algos.grpo(),
        "rloo": algos.rloo(),
        "dapo": algos.dapo(max_length=12, cache_length=4),
        "ppo": algos.ppo(),
    }[recipe]._replace(entropy_coef=0.01)
    batch = algo.advantages(batch)
    loss, _ = algo.loss(batch, **algos.global_counts(batch["mask"]))
    loss.backward()
    grad = logits.grad
    width = out["prompts"].shape[1]
    # logits[:, j] predicts token j + 1: only positions predicting a policy token may get gradient.
    predicts_policy = torch.cat([torch.zeros_like(out["prompt_mask"]), out["mask"]], 1)[:, 1:].bool()
    assert grad[:, :-1][~predicts_policy].eq(0).all()
    assert grad[:, -1].eq(0).all()
    assert grad[:, : width - 1].eq(0).all()  # prompt tokens
    assert grad[:, :-1][predicts_policy].abs().sum() > 0  # the entropy bonus reaches every policy token


def test_gae_carries_through_observation_tokens():
    """GAE over a trajectory with observation holes equals GAE over its policy tokens alone."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0]])
    rewards = torch.where(mask == 1, torch.randn(1, 10, generator=g), torch.nan)
    values = torch.where(mask == 1, torch.randn(1, 10, generator=g), torch.nan)
    adv, ret = algos.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    keep = mask[0] == 1
    dense_adv, dense_ret = algos.gae(
        rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum())), gamma=0.9, lam=0.8
    )
    torch.testing.assert_close(adv[:, keep], dense_adv)
    torch.testing.assert_close(ret[:, keep], dense_ret)
    assert adv[:, ~keep].eq(0).all() and ret[:, ~keep].eq(0).all()


class Broken:
    def __init__(self, how):
        self.how = how

    def reset(self, sample):
        if self.how == "reset":
            raise RuntimeError("no start")
        return ""

    def step(self, action):
        if self.how == "raise":
            raise RuntimeError("env bug")
        if self.how == "hang":
            time.sleep(1.5)
        if self.how == "garbage":
            return "not a tuple"
        if self.how == "nan":
            return StepResult("", float("nan"), True, {})
        return StepResult("", 1.0, True, {})


def test_failing_environments_end_their_trajectory_only(model):
    hows = ["raise", "hang", "garbage", "nan", "reset", "ok"]
    t0 = time.perf_counter()
    with StepRunner(max_concurrency=8, timeout=0.2) as runner:
        out = multi_turn_rollout(
            model,
            [[3, 4]] * len(hows),
            [Broken(h) for h in hows],
            decode=ids_text,
            encode_observation=list,
            eos_token_id=EOS,
            pad_token_id=PAD,
            max_turns=3,
            max_new_tokens=4,
            max_total_tokens=20,
            generator=torch.Generator().manual_seed(0),
            runner=runner,
        )
    assert time.perf_counter() - t0 < 5
    assert out["num_env_errors"].tolist() == [1, 1, 1, 1, 1, 0]
    assert out["scores"].tolist() == [0, 0, 0, 0, 0, 1.0]
    assert out["num_turns"].tolist() == [1, 1, 1, 1, 0, 1]
    assert out["trajectory_mask"][4].eq(0).all()


class FaultyCaller(ToolEnv):
    """Replaces the policy's first action with a scripted faulty call (a random model cannot be asked to write one)."""

    def __init__(self, tools, action, **kw):
        super().__init__(tools, **kw)
        self.action, self.turn = action, 0

    async def step(self, action):
        self.turn += 1
        return await super().step(self.action if self.turn == 1 else "")


def test_tool_faults_are_counted_through_the_rollout(model, runner):
    async def sleepy():
        import asyncio

        await asyncio.sleep(10)

    def boom():
        raise RuntimeError("x")

    from rlcore.agent import Tool

    tools = [Tool("sleepy", sleepy), Tool("boom", boom)]
    actions = [
        "<tool_call>{oops</tool_call>",
        '<tool_call>{"name": "missing", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "boom", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "sleepy", "arguments": {}}</tool_call>',
    ]
    t0 = time.perf_counter()
    out = multi_turn_rollout(
        model,
        [[3, 4]] * 4,
        [FaultyCaller(tools, a, timeout=0.1) for a in actions],
        decode=ids_text,
        encode_observation=lambda text: [5] * min(len(text), 6),
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_turns=2,
        max_new_tokens=3,
        max_total_tokens=20,
        generator=torch.Generator().manual_seed(0),
        runner=runner,
    )
    assert time.perf_counter() - t0 < 5
    assert out["num_tool_calls"].tolist() == [1, 1, 1, 1]
    assert out["num_tool_errors"].tolist() == [1, 1, 1, 1]
    assert out["num_env_errors"].eq(0).all() and out["num_turns"].eq(2).all()
    assert out["tool_latency"][3] >= 0.09


def test_bad_arguments(model):
    kw = dict(decode=ids_text, encode_observation=list, eos_token_id=EOS)
    with pytest.raises(ValueError, match="envs"):
        multi_turn_rollout(model, [[3]], [], **kw)
    with pytest.raises(ValueError, match="max_turns"):
        multi_turn_rollout(model, [[3]], [OneShot()], max_turns=0, **kw)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        multi_turn_rollout(model, [[]], [OneShot()], **kw)
    with pytest.raises(ValueError, match="tokenizer"):
        multi_turn_rollout(model, [[3]], [OneShot()], eos_token_id=EOS)


def test_calc_rollout_with_observation_tokens_from_the_tokenizer():
    task = Multiplication(digits=3)
    tok = task.tokenizer
    model = tiny_model(vocab=tok.vocab_size)
    samples = task.sample(6, torch.Generator().manual_seed(0))
    cfg = MultiTurnConfig(max_turns=3, max_new_tokens=30, max_total_tokens=80)
    s = multi_turn_stage(model, tok, task.make_env, cfg, inputs=["prompts"], seed=0)
    prompts = [torch.tensor(tok.encode(x["prompt"])) for x in samples]
    ids = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(p, dtype=torch.bool) for p in prompts], batch_first=True)
    rows = s.fn({"prompts": ids, "prompts_mask": mask, "policy_version": torch.zeros(6, dtype=torch.long)})
    assert set(rows) == set(STAGE_OUTPUTS)
    for k in ("responses", "mask", "trajectory_mask", "rollout_logp", "rewards"):
        assert [r.shape for r in rows[k]] == [r.shape for r in rows["responses"]]
    assert all(r.numel() <= 80 for r in rows["responses"])
    assert model.training is False


def test_stage_in_a_pipeline():
    task = Multiplication(digits=2)
    tok = task.tokenizer
    model = tiny_model(vocab=tok.vocab_size)
    cfg = MultiTurnConfig(max_turns=2, max_new_tokens=12, max_total_tokens=30)
    roll = multi_turn_stage(model, tok, task.make_env, cfg)

    def update(batch):
        assert batch["mask"].shape == batch["responses"].shape and batch["mask"].dtype == torch.float32
        return {"loss": batch["scores"].float()}

    graph = StageGraph([roll, stage(update, inputs=["responses", "mask", "scores"], outputs=["loss"], role="update")])
    samples = task.sample(4, torch.Generator().manual_seed(0))

    def loader(iteration):
        return {"prompts": [torch.tensor(tok.encode(s["prompt"])) for s in samples for _ in range(2)]}

    result = run_pipeline(graph, loader, num_prompts=4, n_samples=2, num_iterations=2, collect=["num_turns", "loss"])
    assert len(result.batches) == 2
    assert all(b["num_turns"].ge(1).all() for b in result.batches)


def test_trajectory_logprobs_and_metrics(model, runner):
    from rlcore.agent import trajectory_logprobs, trajectory_metrics
    from rlcore.models import from_hf

    prompts = [[3, 4, 5], [6], [7, 8]]
    obs = [[[5, 5]], [[9, 9, 9], [4]], []]
    envs = [Scripted(o) for o in obs]
    out = multi_turn_rollout(
        model,
        prompts,
        envs,
        decode=ids_text,
        encode_observation=list,
        eos_token_id=EOS,
        pad_token_id=PAD,
        stop_token_ids=[2],
        max_turns=3,
        max_new_tokens=5,
        max_total_tokens=30,
        generator=torch.Generator().manual_seed(4),
        runner=runner,
    )
    apply, params = from_hf(model)
    with torch.no_grad():
        logp, entropy = trajectory_logprobs(apply, params, out, with_entropy=True)
    on = out["mask"] == 1
    torch.testing.assert_close(logp[on], out["rollout_logp"][on], atol=1e-4, rtol=0)
    assert logp[out["trajectory_mask"] == 0].eq(0).all() and entropy.shape == logp.shape
    m = trajectory_metrics(out)
    turns = [len(e.actions) for e in envs]
    calls = [min(t, len(o)) for t, o in zip(turns, obs)]
    assert m["turns"] == torch.tensor(sum(turns) / 3)
    assert m["tool_calls"] == torch.tensor(sum(calls) / 3)
    assert m["tool_call_rate"] == torch.tensor(sum(c > 0 for c in calls) / 3)
    observed = sum(len(t) for o, e in zip(obs, envs) for t in o[: len(e.actions) - 1])
    torch.testing.assert_close(m["observation_tokens"], torch.tensor(observed / 3))


# --- issue 30 re-probe: environments and tools that exit, block, flood or lie ---------------


def _bounded(seconds, fn):
    """fn() in a daemon thread; fails (rather than hangs) when it takes longer than ``seconds``."""
    import threading

    box = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as err:
            box["err"] = err

    t = threading.Thread(target=run, daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    if "err" in box:
        raise box["err"]
    return box["out"], time.perf_counter() - t0


class Returns:
    """Answers its first turn with a fixed StepResult (or raises it, when it is an exception)."""

    def __init__(self, result, reset=""):
        self.result, self.reset_obs = result, reset

    def reset(self, sample):
        return self.reset_obs

    def step(self, action):
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


class AsyncExit:
    def reset(self, sample):
        return ""

    async def step(self, action):
        raise SystemExit(2)


def _rollout(model, envs, *, timeout=2.0, max_total_tokens=20, encode=list, **kw):
    with StepRunner(max_concurrency=8, timeout=timeout) as runner:
        return multi_turn_rollout(
            model,
            [[3, 4]] * len(envs),
            envs,
            decode=ids_text,
            encode_observation=encode,
            eos_token_id=EOS,
            pad_token_id=PAD,
            max_turns=2,
            max_new_tokens=3,
            max_total_tokens=max_total_tokens,
            generator=torch.Generator().manual_seed(0),
            runner=runner,
            **kw,
        )


@pytest.mark.parametrize(
    "bad, message",
    [
        (Returns(SystemExit(1)), "Returns.step: RuntimeError: .*raised SystemExit"),
        (AsyncExit(), "AsyncExit.step: RuntimeError: .*raised SystemExit"),
        (Returns(KeyboardInterrupt()), "raised KeyboardInterrupt"),
        (Returns(StepResult([5, VOCAB], 0.0, False, {})), rf"token id {VOCAB} is outside the model's vocabulary"),
        (Returns(StepResult([5, -1], 0.0, False, {})), "token id -1 is outside"),
        (Returns(StepResult(b"\x05\x06", 0.0, False, {})), "observation: got bytes"),
        (Returns(StepResult(torch.tensor([5.7, 6.2]), 0.0, False, {})), "observation: got a torch.float32 tensor"),
        (Returns(StepResult(torch.tensor([True]), 0.0, False, {})), "observation: got a torch.bool tensor"),
        (Returns(StepResult([5, 6.0], 0.0, False, {})), "got float 6.0 among the token ids"),
        (Returns(StepResult([5], 0.0, False, {"tool_calls": "2"})), r"Returns.step: ValueError: info\['tool_calls'\]"),
        (Returns(StepResult([5], 0.0, False, {"tool_errors": -1})), r"info\['tool_errors'\]: got -1"),
        (Returns(StepResult([5], 0.0, False, {"tool_latency": "slow"})), r"info\['tool_latency'\]"),
        (Returns(StepResult([5], 0.0, False, ["not", "a", "map"])), "info: got list"),
        (Returns(StepResult([5], 1 + 2j, True, {})), "reward: got"),
        (Returns(StepResult([5], "1", True, {})), "reward: got '1'"),
        (Returns(StepResult([5], 0.0, torch.ones(2), {})), "Returns.step"),
    ],
)
def test_reprobe30_a_lying_environment_ends_only_its_own_trajectory(model, bad, message):
    with pytest.warns(RuntimeWarning, match=message):
        out, _ = _bounded(60, lambda: _rollout(model, [bad, OneShot()]))
    assert out["num_env_errors"].tolist() == [1, 0]
    assert out["scores"].tolist() == [0.0, 0.5]
    assert out["responses"].max() < VOCAB and out["responses"].min() >= 0


def test_reprobe30_a_blocking_async_tool_cannot_stall_the_rollout(model):
    """time.sleep inside an async tool blocks the environments' loop: the rollout gives up after the step timeout and names the tool."""
    from rlcore.agent import Tool

    async def stall():
        time.sleep(12)

    env = FaultyCaller([Tool("stall", stall)], '<tool_call>{"name": "stall", "arguments": {}}</tool_call>', timeout=0.2)
    with pytest.warns(RuntimeWarning, match="tool 'stall' blocked the environments' event loop"):
        out, seconds = _bounded(60, lambda: _rollout(model, [env], timeout=0.5))
    assert seconds < 9  # step timeout + grace, not the 12 s of the sleep, let alone for ever
    assert out["num_env_errors"].tolist() == [1]


def test_reprobe30_a_flood_of_tool_output_is_not_tokenized_whole(model):
    """A 2 MB observation cannot fit the budget: it ends the trajectory as truncated without tokenizing 2 MB."""
    tok = Multiplication().tokenizer
    flood = Returns(StepResult("1" * 2_000_000, 0.0, False, {}))
    encoded = []

    def encode(text):
        encoded.append(len(text))
        return tok.encode(text)

    out, _ = _bounded(60, lambda: _rollout(model, [flood, OneShot()], encode=encode))
    assert sum(encoded) <= 10_000  # a head of the flood, not 2 MB (about 3 s with this tokenizer)
    assert out["truncated"].tolist() == [True, False] and out["num_env_errors"].eq(0).all()
    # A long observation that fits is still tokenized whole and appended.
    fits = Returns(StepResult("1" * 10, 0.0, False, {}))
    out, _ = _bounded(60, lambda: _rollout(model, [fits], encode=tok.encode, max_total_tokens=40))
    assert (out["trajectory_mask"][0] - out["mask"][0]).sum() == 10


def test_reprobe30_a_reset_observation_past_the_model_positions_is_refused(model):
    """The model has 256 positions: a reset observation that leaves no room for max_total_tokens ends its trajectory."""
    long_reset = Returns(StepResult("", 1.0, True, {}), reset=[5] * 240)
    short_reset = Returns(StepResult("", 1.0, True, {}), reset=[5] * 200)
    with pytest.warns(RuntimeWarning, match="Returns.reset: ValueError: observation: more than 234 tokens"):
        out, _ = _bounded(60, lambda: _rollout(model, [long_reset, short_reset]))
    assert out["num_env_errors"].tolist() == [1, 0] and out["num_turns"].tolist() == [0, 1]
    assert out["prompt_mask"][1].sum() == 202


def test_reprobe30_an_environment_without_reset_ends_only_its_trajectory(model):
    with pytest.warns(RuntimeWarning, match="object.reset: AttributeError"):
        out, _ = _bounded(60, lambda: _rollout(model, [object(), OneShot()]))
    assert out["num_env_errors"].tolist() == [1, 0]


def test_reprobe30_an_environment_factory_that_raises_ends_only_its_trajectory():
    task = Multiplication(digits=2)
    made = [0]

    def flaky():
        made[0] += 1
        if made[0] == 1:
            raise RuntimeError("no sandbox left")
        return task.make_env()

    s = multi_turn_stage(
        tiny_model(vocab=task.tokenizer.vocab_size),
        task.tokenizer,
        flaky,
        MultiTurnConfig(max_turns=1),
        to_sample=lambda batch, row: {"prompt": "12*34=", "answer": "408"},
    )
    ids, mask = left_pad([task.tokenizer.encode("12*34=")] * 2, 0)
    with pytest.warns(RuntimeWarning, match="the environment factory raised RuntimeError: no sandbox left"):
        out = _bounded(60, lambda: s.fn({"prompts": ids, "prompt_mask": mask}))[0]
    assert out["num_env_errors"].tolist() == [1, 0]


@pytest.mark.parametrize(
    "bad, message",
    [
        (Returns(StepResult([5], 0.5, "no", {})), r"Returns\.step: ValueError: done: got 'no', expected a bool"),
        (Returns(StepResult([5], 0.5, None, {})), "done: got None, expected a bool"),
        (
            Returns(StepResult([5], 0.0, False, {"tool_calls": 10**30})),
            r"info\['tool_calls'\]: got 10+, expected an int",
        ),
        (Returns(StepResult([5], 0.0, False, {"tool_calls": 1, "tool_errors": 5})), r"at most info\['tool_calls'\]"),
        (Returns(StepResult([5], 1e300, True, {})), r"reward: got 1e\+300, expected a finite number \(in float32\)"),
        (Returns(StepResult([5], 3e38, False, {}), reset=""), "past float32's range"),
    ],
)
def test_reprobe30_more_lies_end_only_their_own_trajectory(model, bad, message):
    """Before: a done of "no" ended the episode and None continued it; 1e30 tool calls crashed the whole batch with
    'Overflow when unpacking long long'; more errors than calls gave error rates above 1; a reward of 1e300 (or
    a sum of rewards) became an inf score in float32."""
    with pytest.warns(RuntimeWarning, match=message):
        out, _ = _bounded(60, lambda: _rollout(model, [bad, OneShot()]))
    assert out["num_env_errors"].tolist() == [1, 0]
    assert torch.isfinite(out["scores"]).all() and out["scores"][1] == 0.5


@pytest.mark.parametrize("done", [True, 1, np.bool_(True), torch.tensor(True)])
def test_reprobe30_a_done_of_any_bool_kind_ends_the_episode(model, done):
    out, _ = _bounded(60, lambda: _rollout(model, [Returns(StepResult([5], 0.25, done, {}))]))
    assert out["num_env_errors"].tolist() == [0] and out["num_turns"].tolist() == [1] and out["scores"][0] == 0.25
