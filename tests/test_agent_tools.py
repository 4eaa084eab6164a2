"""rlcore.agent without a model: the Hermes parser, tools, ToolEnv faults, StepRunner, references and config."""

import asyncio
import functools
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


# --- issue 30 re-probe: tools that exit, hang or block; config errors at parse time ---------


def _exit_now(x):
    raise SystemExit(3)


async def _exit_async(x):
    raise SystemExit(4)


def _interrupt(x):
    raise KeyboardInterrupt


class _BadStr:
    def __str__(self):
        raise RuntimeError("no text")


@pytest.mark.parametrize(
    "fn, message",
    [
        (_exit_now, "raised SystemExit: 3"),
        (_exit_async, "raised SystemExit: 4"),
        (_interrupt, "raised KeyboardInterrupt"),
        (lambda x: _BadStr(), r"whose str\(\) raised"),
    ],
)
def test_reprobe30_a_tool_that_exits_is_a_tool_error(fn, message):
    """call_tool raises only ToolError: a SystemExit of the tool's code fails the call, not the loop or the process."""
    from rlcore.agent import ToolError, call_tool

    with pytest.raises(ToolError, match=message):
        asyncio.run(asyncio.wait_for(call_tool(Tool("bad", fn), {"x": 1}, timeout=5), 10))
    env = ToolEnv([Tool("bad", fn), Tool("echo", lambda x: x)], timeout=5)
    obs, _, done, info = asyncio.run(asyncio.wait_for(env.step(_call("bad", x=1) + _call("echo", x="ok")), 10))
    assert info["tool_errors"] == 1 and "ok" in obs and not done


@pytest.mark.parametrize("how", ["sync", "async"])
def test_reprobe30_an_environment_that_exits_fails_its_own_call(how):
    def sync_exit():
        raise SystemExit(5)

    async def async_exit():
        raise SystemExit(6)

    with StepRunner(max_concurrency=2, timeout=5) as runner:
        bad = runner.submit(sync_exit if how == "sync" else async_exit)
        with pytest.raises(RuntimeError, match="raised SystemExit"):
            runner.wait(bad)
        assert runner.wait(runner.submit(lambda: 7)) == 7  # the loop lives on


def test_reprobe30_a_blocked_loop_is_bounded_and_named():
    """time.sleep inside async def blocks the loop: wait() gives up after the timeout and names the blocking tool."""
    from rlcore.agent import call_tool

    async def stall():
        time.sleep(10)

    runner = StepRunner(max_concurrency=2, timeout=0.5)
    future = runner.submit(functools.partial(call_tool, timeout=60), Tool("stall", stall), {})
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="tool 'stall' blocked the environments' event loop"):
        runner.wait(future)
    runner.close()
    assert time.perf_counter() - t0 < 7  # timeout + grace + close, well before the 10 s sleep ends


def test_reprobe30_a_call_that_ignores_cancellation_is_bounded():
    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue

    runner = StepRunner(max_concurrency=2, timeout=0.3)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="ignored its cancellation"):
        runner.wait(runner.submit(stubborn))
    runner.close()
    assert time.perf_counter() - t0 < 10


def test_reprobe30_a_stuck_sync_tool_does_not_hold_the_interpreter_exit(tmp_path):
    """A tool that never returns runs in a daemon thread: the process exits as soon as its work is done."""
    import subprocess
    import sys

    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, threading
            from rlcore.agent import StepRunner, Tool, ToolEnv
            env = ToolEnv([Tool("stuck", lambda: threading.Event().wait())], timeout=0.2)
            call = '<tool_call>{"name": "stuck", "arguments": {}}</tool_call>'
            with StepRunner(max_concurrency=2, timeout=1) as runner:
                print(runner.submit(env.step, call).result(timeout=30).info["tool_errors"])
                try:  # a stuck environment call too
                    runner.submit(threading.Event().wait).result(timeout=30)
                except TimeoutError:
                    print("timeout")
            """
        )
    )
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "timeout"]
    assert time.perf_counter() - t0 < 30


def test_reprobe30_tool_env_formats_are_checked_at_construction():
    for key, value in [
        ("response_format", "<r>{name}</r>"),
        ("response_format", "{} {}"),
        ("error_format", "error {"),
        ("error_format", 3),
        ("separator", None),
        ("timeout", "1"),
        ("parser", "hermes"),
    ]:
        with pytest.raises(ValueError, match=key):
            ToolEnv([calculator], **{key: value})
    ToolEnv([calculator], response_format="<r>{}</r>", error_format="error", separator="")  # fixed text is fine


@pytest.mark.parametrize(
    "options, key",
    [
        ({"response_fromat": "{}"}, "rl.multi_turn.env_options.response_fromat"),
        ({"response_format": "{x}"}, "rl.multi_turn.env_options"),
        ({"error_format": "{} {}"}, "rl.multi_turn.env_options"),
        ({"tools": []}, "rl.multi_turn.env_options.tools"),
    ],
)
def test_reprobe30_env_options_are_checked_when_the_config_is_parsed(options, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        parse_multi_turn({"tools": ["rlcore.agent.calc:calculator"], "env_options": options})


def test_reprobe30_env_options_of_an_env_factory_are_checked_against_its_signature(tmp_path):
    (tmp_path / "envs.py").write_text(
        textwrap.dedent(
            """
            from rlcore.agent import ToolEnv
            def make(tools, *, budget=1):
                return ToolEnv(tools)
            def loose(**options):
                return ToolEnv([])
            """
        )
    )
    cfg = parse_multi_turn({"env": "envs.py:make", "env_options": {"budgett": 2}})
    with pytest.raises(ValueError, match=r"rl\.multi_turn\.env_options\.budgett.*budget"):
        build_env_factory(cfg, base_dir=tmp_path)
    build_env_factory(parse_multi_turn({"env": "envs.py:make", "env_options": {"budget": 2}}), base_dir=tmp_path)
    build_env_factory(parse_multi_turn({"env": "envs.py:loose", "env_options": {"any": 2}}), base_dir=tmp_path)


def test_reprobe30_a_stop_token_that_is_not_one_token_is_refused():
    from rlcore.agent import stop_token_ids

    tok = Multiplication().tokenizer
    for bad in ["</tool_call>1", "</tool>", ""]:
        with pytest.raises(ValueError, match=r"rl\.multi_turn\.stop_tokens\[1\]"):
            stop_token_ids(MultiTurnConfig(stop_tokens=("</tool_call>", bad)), tok)
    assert stop_token_ids(MultiTurnConfig(stop_tokens=("</tool_call>", "=")), tok) == [
        tok.token_id("</tool_call>"),
        tok.token_id("="),
    ]


def test_reprobe30_stuck_sync_calls_do_not_starve_the_later_ones():
    """Each sync call has a thread of its own: calls stuck past their timeout do not occupy the slots of later calls."""
    release = threading.Event()
    with StepRunner(max_concurrency=2, timeout=0.2) as runner:
        stuck = [runner.submit(release.wait) for _ in range(2)]
        for f in stuck:
            with pytest.raises(TimeoutError):
                f.result(timeout=30)
        assert runner.submit(lambda: "free").result(timeout=30) == "free"
    release.set()


def test_reprobe30_deeply_nested_tool_call_json_is_a_malformed_call():
    body = "[" * 100_000 + "]" * 100_000
    parsed = HermesParser()(f"<tool_call>{body}</tool_call>")
    assert parsed.calls == [] and "is not valid JSON" in parsed.errors[0]
    args = json.dumps({"name": "f", "arguments": body})
    assert HermesParser()(f"<tool_call>{args}</tool_call>").errors[0].startswith("malformed tool call: arguments")


def test_reprobe30_two_tools_of_one_name_are_refused_when_built():
    """Before: accepted, then every trajectory's environment factory raised and the run went on at reward 0."""
    cfg = parse_multi_turn({"tools": ["rlcore.agent.calc:calculator", "rlcore.agent.calc:calculator"]})
    with pytest.raises(ValueError, match=r"rl\.multi_turn\.tools\[1\]: .*named 'calculator', as is .*tools\[0\]"):
        build_env_factory(cfg)


def test_reprobe30_a_tool_without_a_signature_is_named():
    """Before: 'no signature found for builtin type', naming neither the key nor the reference."""
    with pytest.raises(ValueError, match=r"rl\.multi_turn\.tools\[0\]: 'builtins:dict' cannot be made a tool"):
        build_env_factory(parse_multi_turn({"tools": ["builtins:dict"]}))


class _HostileText(str):
    def __format__(self, spec):
        raise RuntimeError("no formatting")


def test_reprobe30_a_str_subclass_result_is_plain_text():
    """Before: ToolEnv.step raised the subclass's __format__ error, though a ToolEnv documents that nothing raises."""
    from rlcore.agent import call_tool

    out = asyncio.run(call_tool(Tool("t", lambda: _HostileText("42")), {}))
    assert type(out) is str and out == "42"
    env = ToolEnv([Tool("t", lambda: _HostileText("42"))])
    obs, _, done, info = asyncio.run(env.step('<tool_call>{"name": "t", "arguments": {}}</tool_call>'))
    assert obs == "<tool_response>\n42\n</tool_response>" and not done and info["tool_errors"] == 0


def test_reprobe30_a_generator_function_is_not_a_tool():
    """Before: an async generator tool was accepted and its observation was '<async_generator object ...>'."""

    async def numbers():
        yield 1

    def more():
        yield 2

    for fn in (numbers, more):
        with pytest.raises(ValueError, match=r"fn: got the generator function '(numbers|more)'"):
            Tool("t", fn)
