"""rlcore.agent without a model: the Hermes parser, tools, ToolEnv faults, StepRunner, references and config."""

import asyncio
import json
import textwrap
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.agent import (
    HermesParser,
    Multiplication,
    MultiTurnConfig,
    StepRunner,
    Tool,
    ToolCall,
    ToolEnv,
    build_env_factory,
    calculator,
    evaluate_arithmetic,
    parse_multi_turn,
    tool,
)
from rlcore.references import load_reference

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5), lambda c: st.lists(c, max_size=3), max_leaves=5
)


@settings(max_examples=30)
@given(
    calls=st.lists(
        st.tuples(st.text(min_size=1, max_size=8), st.dictionaries(st.text(max_size=4), json_values, max_size=3)),
        max_size=3,
    ),
    filler=st.text(alphabet="abc \n", max_size=6),
)
def test_hermes_parser_round_trip(calls, filler):
    text = filler.join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)
    parsed = HermesParser()(filler + text)
    assert parsed.errors == []
    assert parsed.calls == [ToolCall(n, a) for n, a in calls]
    assert parsed.found == bool(calls)


@pytest.mark.parametrize(
    "text, message",
    [
        ("<tool_call>{not json}</tool_call>", "is not valid JSON"),
        ('<tool_call>["calc"]</tool_call>', "has no string 'name'"),
        ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "are not a JSON object"),
        ('<tool_call>{"name": "calc"', "without </tool_call>"),
    ],
)
def test_hermes_parser_malformed(text, message):
    parsed = HermesParser()(text)
    assert parsed.calls == [] and len(parsed.errors) == 1 and message in parsed.errors[0]
    assert parsed.found


def test_tool_decorator_schema():
    @tool(timeout=2.0)
    def lookup(key: str, limit: int = 3) -> str:
        """Look a key up.

        More text."""
        return key * limit

    assert lookup.schema() == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["key"],
            },
        },
    }
    assert lookup.timeout == 2.0
    with pytest.raises(ValueError, match="timeout"):
        Tool("x", len, timeout=0)
    with pytest.raises(ValueError, match="name"):
        Tool("", len)


def _call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def _slow_async(x):
    await asyncio.sleep(5)
    return x


def _slow_sync(x):
    time.sleep(0.5)
    return x


def _boom(x):
    raise RuntimeError("kaput")


FAULT_TOOLS = [
    Tool("echo", lambda x: x),
    Tool("slow_async", _slow_async),
    Tool("slow_sync", _slow_sync),
    Tool("boom", _boom),
]


@pytest.mark.parametrize(
    "action, message",
    [
        ("<tool_call>{bad json</tool_call>", "is not valid JSON"),
        (_call("nope", x=1), "unknown tool 'nope'"),
        (_call("boom", x=1), "raised RuntimeError: kaput"),
        (_call("slow_async", x=1), "timed out after 0.1 s"),
        (_call("slow_sync", x=1), "timed out after 0.1 s"),
        (_call("echo", y=1), "raised TypeError"),
    ],
)
def test_tool_faults_become_error_observations(action, message):
    env = ToolEnv(FAULT_TOOLS, timeout=0.1)
    env.reset({})
    t0 = time.perf_counter()
    obs, reward, done, info = asyncio.run(env.step(action + _call("echo", x="fine")))
    assert time.perf_counter() - t0 < 2.0  # nothing waits for the slow tools
    assert not done and reward == 0.0
    assert info["tool_calls"] == 2 and info["tool_errors"] == 1
    assert message in obs and "<tool_response>\nfine\n</tool_response>" in obs


def test_tool_env_runs_calls_concurrently_and_scores_the_answer():
    async def nap(x):
        await asyncio.sleep(0.2)
        return x

    env = ToolEnv([Tool("nap", nap)], reward=lambda s, text: float(text == s["answer"]))
    assert env.reset({"answer": "42"}) == ""
    t0 = time.perf_counter()
    obs, _, done, info = asyncio.run(env.step("".join(_call("nap", x=i) for i in range(5))))
    assert time.perf_counter() - t0 < 0.8 and not done
    assert obs.count("<tool_response>") == 5 and info["tool_errors"] == 0
    assert info["tool_latency"] >= 5 * 0.2 * 0.9
    assert asyncio.run(env.step("42")) == ("", 1.0, True, {"tool_calls": 0, "tool_errors": 0, "tool_latency": 0.0})
    assert asyncio.run(env.step("41"))[1] == 0.0


def test_tool_env_bad_input():
    with pytest.raises(ValueError, match="distinct names"):
        ToolEnv([calculator, calculator])
    with pytest.raises(ValueError, match="Tool objects"):
        ToolEnv([len])
    with pytest.raises(ValueError, match="timeout"):
        ToolEnv([calculator], timeout=0)


def test_step_runner_concurrency_timeout_and_errors():
    with StepRunner(max_concurrency=8, timeout=0.3) as runner:
        t0 = time.perf_counter()
        futures = [runner.submit(time.sleep, 0.1) for _ in range(8)]
        [f.result() for f in futures]
        assert time.perf_counter() - t0 < 0.7  # eight 0.1 s sleeps overlap
        with pytest.raises(TimeoutError):
            runner.submit(time.sleep, 2).result(timeout=60)
        with pytest.raises(ZeroDivisionError):
            runner.submit(lambda: 1 / 0).result(timeout=60)

        async def double(x):
            return 2 * x

        assert runner.submit(double, 4).result(timeout=60) == 8
        assert threading.current_thread() is threading.main_thread()
    with pytest.raises(RuntimeError, match="after close"):
        runner.submit(len, "x")
    with pytest.raises(ValueError, match="max_concurrency"):
        StepRunner(max_concurrency=0)


def test_step_runner_one_at_a_time():
    with StepRunner(max_concurrency=1) as runner:
        t0 = time.perf_counter()
        [f.result() for f in [runner.submit(time.sleep, 0.05) for _ in range(4)]]
        assert time.perf_counter() - t0 >= 0.19


def test_evaluate_arithmetic():
    assert evaluate_arithmetic("1234*5678") == 1234 * 5678
    assert evaluate_arithmetic("2-3*4+1") == -9
    for bad in ("__import__('os')", "2**100", "1/2", "x", "1" * 65):
        with pytest.raises(ValueError, match="expression"):
            evaluate_arithmetic(bad)


def test_calc_trace_replays_through_its_environment():
    task = Multiplication(digits=4)
    import torch

    for s in task.sample(20, torch.Generator().manual_seed(1)):
        env = task.make_env()
        env.reset(s)
        (call, _), (response, _), (answer, _) = task.trace(s)
        obs, _, done, info = asyncio.run(env.step(call))
        assert obs == response and not done and info["tool_errors"] == 0
        assert asyncio.run(env.step(answer))[1:3] == (1.0, True)
        # The tokenizer spells every observation the environment can write, errors included.
        assert task.tokenizer.decode(task.tokenizer.encode(obs)) == obs
        bad = asyncio.run(env.step('<tool_call>{"name":"calculator","arguments":{"expression":"1*"}}</tool_call>'))
        assert bad[0] == "<tool_response>error</tool_response>" and bad[3]["tool_errors"] == 1
        task.tokenizer.encode(bad[0])


def test_load_reference_file_and_module(tmp_path):
    (tmp_path / "my_tools.py").write_text(
        textwrap.dedent(
            '''
            from rlcore.agent import ToolEnv

            def shout(text: str) -> str:
                """Upper-case the text."""
                return text.upper()

            class Env(ToolEnv):
                def __init__(self, tools, greeting="hi"):
                    super().__init__(tools)
                    self.greeting = greeting
            '''
        )
    )
    assert load_reference("my_tools.py:shout", base_dir=tmp_path)("a") == "A"
    assert load_reference("rlcore.agent.calc:calculator") is calculator
    # The loader's error messages are tested in tests/test_references.py; here, one through the agent config.
    with pytest.raises(ValueError, match=r"rl\.multi_turn\.env: got 'my_tools.py:Nope'.*has no attribute"):
        build_env_factory(
            parse_multi_turn({"tools": ["my_tools.py:shout"], "env": "my_tools.py:Nope"}), base_dir=tmp_path
        )
    cfg = parse_multi_turn(
        {"tools": ["my_tools.py:shout"], "env": "my_tools.py:Env", "env_options": {"greeting": "yo"}}
    )
    env = build_env_factory(cfg, base_dir=tmp_path)()
    assert env.greeting == "yo" and sorted(env.tools) == ["shout"]
    assert env.tools["shout"].description == "Upper-case the text."


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"max_turns": 0}, "max_turns"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"tools": "a.py:b"}, "tools"),
        ({"tool_timeout": -1}, "tool_timeout"),
        ({"env": 3}, "env"),
        ({"colour": 1}, "colour"),
    ],
)
def test_parse_multi_turn_rejects(raw, key):
    with pytest.raises(ValueError, match=f"rl.multi_turn.{key}"):
        parse_multi_turn(raw)


def test_parse_multi_turn_defaults():
    assert parse_multi_turn(None) == MultiTurnConfig()
    assert parse_multi_turn({"stop_tokens": []}).stop_tokens == ()


def _chat_tokenizer():
    """A character-level ``transformers`` tokenizer with a Qwen-style chat template, built in memory."""
    import tokenizers
    import transformers

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz<>/_\n 0123456789"))
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = tokenizers.decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"]
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


def test_observation_encoder_uses_the_chat_template_role_markers():
    from rlcore.agent import observation_encoder

    tok = _chat_tokenizer()
    encode = observation_encoder(tok)
    expected = tok.encode("<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert encode("<tool_response>\n42\n</tool_response>") == expected
    assert encode("ok")[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert observation_encoder(tok, role="tool")("x") == tok.encode(
        "<|im_start|>tool\nx<|im_end|>\n<|im_start|>assistant\n"
    )
    tok.chat_template = None  # without a template: the text alone, no special tokens
    assert observation_encoder(tok)("ab") == tok.encode("ab", add_special_tokens=False)


def test_step_runner_close_cancels_pending_calls():
    async def forever():
        await asyncio.sleep(60)

    runner = StepRunner(max_concurrency=2)
    pending = [runner.submit(forever) for _ in range(3)]
    t0 = time.perf_counter()
    runner.close()
    assert time.perf_counter() - t0 < 5
    assert all(f.cancelled() or f.done() for f in pending)
    runner.close()  # idempotent


def test_shipped_agent_config():
    """configs/agent_calc_tiny.yaml: a trainer config whose rl.multi_turn builds the calculator environment."""
    import pathlib

    import yaml

    from rlcore.agent import stop_token_ids
    from rlcore.train import parse_config

    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "agent_calc_tiny.yaml"
    cfg = parse_config(yaml.safe_load(path.read_text()))
    mt = parse_multi_turn(cfg.rl.multi_turn)
    task = Multiplication(digits=cfg.data.digits)
    assert cfg.data.task == "multiplication"
    env = build_env_factory(mt, reward=task.reward, base_dir=path.parent)()
    assert stop_token_ids(mt, task.tokenizer) == [task.tokenizer.token_id("</tool_call>")]
    assert env.reset(task.sample(1, __import__("torch").Generator().manual_seed(0))[0]) == ""
    trace_call = task.trace({"prompt": "1234*5678=", "answer": str(1234 * 5678)})[0][0]
    obs = asyncio.run(env.step(trace_call))[0]
    assert obs == f"<tool_response>{1234 * 5678}</tool_response>"
    assert mt.max_total_tokens >= len(
        task.warmup_batch(task.sample(64, __import__("torch").Generator()))["input_ids"][0]
    )
