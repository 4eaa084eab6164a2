"""The trainer with rl.multi_turn: the shipped agent config runs through the pipeline; the forwards attend the observations."""

from pathlib import Path

import pytest
import torch

from rlcore import algos
from rlcore.dataflow import StageGraph, run_pipeline, stage
from rlcore.train import (
    build_model,
    left_pad,
    load_config,
    logprob_stage,
    make_prompt_source,
    make_task,
    multi_turn_graph,
    multi_turn_rollout_stage,
    read_metrics,
    rl_forward,
    supervised_warmup,
    task_options,
    train,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "agent_calc_tiny.yaml"
TINY = [
    "model.model_name_or_path.hidden_size=32",
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
    "trainer.warmup_steps=10",
    "trainer.warmup_batch_size=16",
    "trainer.progress=false",
    "trainer.steps=2",
]
MULTI_TURN_KEYS = ("turns", "tool_calls", "tool_call_rate", "tool_errors", "tool_error_rate", "tool_latency_s")


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_shipped_agent_config_trains_through_the_pipeline(algo, tmp_path):
    cfg = load_config(CONFIG, [*TINY, f"rl.algo={algo}", f"trainer.output_dir={tmp_path}"])
    run = train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and len(run.records) == 2
    for r in records:
        for key in (*MULTI_TURN_KEYS, "greedy_reward", "reward", "loss", "entropy", "response_length"):
            assert torch.isfinite(torch.tensor(r[key])), (key, r)
        assert 1 <= r["turns"] <= 3 and 0 <= r["tool_call_rate"] <= 1 and 0 <= r["reward"] <= 1
        assert r["policy_tokens"] + r["observation_tokens"] <= 40
    assert max(r["tool_calls"] for r in records) > 0  # the environments ran tool calls
    assert records[0]["kl"] == pytest.approx(0, abs=1e-6)  # beta 0: logged every trainer.log_ref_kl_every steps
    assert "kl" not in records[1]
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_training_forwards_reproduce_the_rollout_logprobs():
    """Scoring stages and the update's forward adapted by multi_turn_graph give the rollout's log-probs on policy tokens."""
    cfg = load_config(CONFIG, [*TINY, "rl.multi_turn.eval_every=0"])
    task = make_task("multiplication", digits=2)
    tok = task.tokenizer
    torch.manual_seed(0)
    model = build_model(cfg, tok.vocab_size).eval()
    # A little supervision so trajectories hold tool calls and responses after them.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    from rlcore.models import from_hf, token_logprobs

    apply, params = from_hf(model)
    for step in range(40):
        batch = task.warmup_batch(task.sample(16, torch.Generator().manual_seed(step)))
        loss = algos.aggregate(-token_logprobs(apply, params, batch), batch["mask"], mode="token-mean")
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    rollout = multi_turn_rollout_stage(cfg, model, task)
    seen = {}

    def update(b):
        with torch.no_grad():
            seen["logp"] = forward(b)["logp"]  # the update's forward, adapted below
        seen.update({k: b[k] for k in ("old_logp", "rollout_logp", "mask", "trajectory_mask", "plain_logp")})
        return {"loss": torch.zeros(b["mask"].shape[0])}

    scoring = [rollout.stage, logprob_stage(model), logprob_stage(model, outputs=("ref_logp",))]
    scoring.append(stage(lambda b: {"loss_mask": b["mask"]}, inputs=["mask"], outputs=["loss_mask"], name="lm"))
    stages, forward, inputs = multi_turn_graph(
        scoring, rl_forward(model), ["prompts", "responses", "loss_mask"], algos.grpo()
    )
    assert [s.name for s in stages] == ["rollout", "old_logp", "ref_logp", "lm"] and "trajectory_mask" in inputs
    # The unadapted stage (attention = policy tokens only) as a control.
    plain = logprob_stage(model, outputs=("plain_logp",))
    cols = [*inputs, "prompt_mask", "old_logp", "rollout_logp", "mask", "plain_logp", "ref_logp"]
    update_stage = stage(update, inputs=cols, outputs=["loss"], role="update")
    graph = StageGraph(
        [*stages, plain, update_stage], sources=("prompts", "prompt_mask", "answers", "iteration", "row")
    )
    samples = task.sample(4, torch.Generator().manual_seed(1))
    ids, pmask = left_pad([tok.encode(s["prompt"]) for s in samples], tok.pad_token_id)

    def loader(i):
        return {
            "prompts": ids.repeat_interleave(2, 0),
            "prompt_mask": pmask.repeat_interleave(2, 0),
            "answers": [torch.tensor(tok.encode(s["answer"])) for s in samples for _ in range(2)],
            "iteration": torch.zeros(8, dtype=torch.long),
            "row": torch.arange(8),
        }

    run_pipeline(graph, loader, num_prompts=4, n_samples=2, num_iterations=1)
    policy = seen["mask"] != 0
    observed = (seen["trajectory_mask"] != 0) & ~policy
    assert observed.any(), "no trajectory called the tool: the check below would not see an observation"
    torch.testing.assert_close(seen["old_logp"][policy], seen["rollout_logp"][policy], atol=2e-4, rtol=0)
    torch.testing.assert_close(seen["logp"][policy], seen["rollout_logp"][policy], atol=2e-4, rtol=0)
    # Without the observations attended, the tokens after a tool response are scored differently.
    after = policy & (observed.long().cumsum(-1) > 0)
    assert (seen["plain_logp"][after] - seen["rollout_logp"][after]).abs().max() > 1e-3


def test_multi_turn_config_is_validated(tmp_path):
    with pytest.raises(ValueError, match=r"rl.multi_turn.max_turn"):
        load_config(CONFIG, ["rl.multi_turn.max_turn=2"])
    with pytest.raises(ValueError, match=r"'deploy.mode': got 'disaggregated' with rl.multi_turn"):
        load_config(CONFIG, ["deploy.mode=disaggregated"])
    with pytest.raises(ValueError, match=r"rl.multi_turn.max_total_tokens': got 200"):
        load_config(CONFIG, ["rl.multi_turn.max_total_tokens=200"])


def test_reprobe30_task_prompts_pass_on_the_task_warmup_traces():
    """The prompt source that wraps Multiplication gives the trainer the task's tool-using traces, not prompt + answer."""
    cfg = load_config(CONFIG, ["trainer.progress=false"])
    source = make_prompt_source(cfg, task_options(cfg))
    assert source.warmup_batch is not None
    samples = source.sample(4, torch.Generator().manual_seed(0))
    batch = source.warmup_batch(samples)
    tok = source.tokenizer
    call = tok.token_id("<tool_call>")
    trained = batch["input_ids"][batch["mask"] != 0]
    assert (trained == call).sum() == 4  # one tool call per trace is trained on
    # A task without traces of its own: the trainer's prompt + answer sequences.
    plain = make_prompt_source(load_config(ROOT / "configs" / "grpo_tiny.yaml", []), {})
    assert plain.warmup_batch is None


def _warmup_losses(cfg):
    source = make_prompt_source(cfg, task_options(cfg))
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg, source.tokenizer.vocab_size)
    return supervised_warmup(model, source, cfg)


def test_reprobe30_shipped_agent_warmup_learns_the_tool_traces():
    """The shipped config's full warm-up: the trace loss falls from ~3.4 (uniform) to well below 0.5."""
    cfg = load_config(CONFIG, ["trainer.progress=false", "trainer.threads=1"])
    losses = _warmup_losses(cfg)
    assert losses.shape == (cfg.trainer.warmup_steps,)
    assert losses[:5].mean() > 2.0  # it starts near the uniform loss over the vocabulary ...
    assert losses[-10:].mean() < 0.5  # ... and learns the traces (direct answers stay near 2.0)


def test_reprobe30_shipped_agent_config_learns(tmp_path):
    """The shipped agent config on a shortened GRPO schedule: after the warm-up almost every trajectory calls the tool and most answer right."""
    cfg = load_config(
        CONFIG,
        [
            "trainer.steps=6",
            "rl.multi_turn.eval_every=0",
            # Learning, not wall-clock limits: on a loaded machine the shipped 1 s / 5 s cut trajectories short.
            "rl.multi_turn.tool_timeout=30",
            "rl.multi_turn.step_timeout=60",
            "trainer.progress=false",
            "trainer.plot=false",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 6
    assert min(r["tool_call_rate"] for r in records) >= 0.9
    assert max(r["tool_errors"] for r in records) <= 0.5
    # T=1 samples answer right (the regression scored 0.0 at every step).
    assert sum(r["reward"] for r in records) / len(records) >= 0.5


ENVS = '''
import threading

from rlcore.agent import StepResult, Tool, ToolEnv


def hang(**arguments):
    threading.Event().wait()


class Stuck(ToolEnv):
    """Calls a tool that never returns, whatever the policy wrote, then ends the episode."""

    def __init__(self, tools=()):
        super().__init__([Tool("calculator", hang, timeout=0.2)])

    async def step(self, action):
        result = await super().step('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>')
        return result._replace(done=True)


class BadInfo:
    def reset(self, sample):
        return ""

    def step(self, action):
        return StepResult("", 0.0, True, {"tool_calls": "many"})


def make(tools, *, budget=1):
    return ToolEnv(tools)
'''

QUICK = [*TINY[:-3], "trainer.warmup_steps=2", "trainer.progress=false", "trainer.plot=false", "trainer.steps=1"]
# A custom environment takes none of the shipped ToolEnv's options.
QUICK += ["rl.multi_turn.env_options=null", "rl.multi_turn.eval_every=0"]


def test_reprobe30_a_stuck_tool_does_not_keep_the_cli_alive(tmp_path):
    """rlcore train exits after its last step although a tool thread never returns."""
    import subprocess
    import sys

    (tmp_path / "envs.py").write_text(ENVS)
    cmd = [sys.executable, "-m", "rlcore.train", "--config", str(CONFIG), *QUICK]
    cmd += [f"rl.multi_turn.env={tmp_path / 'envs.py'}:Stuck", f"trainer.output_dir={tmp_path / 'run'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records[0]["tool_errors"] == 1.0  # every trajectory's call timed out; the run went on


def test_reprobe30_environment_errors_in_the_trainer_name_the_env_and_key(tmp_path):
    (tmp_path / "envs.py").write_text(ENVS)
    cfg = load_config(
        CONFIG,
        [*QUICK, f"rl.multi_turn.env={tmp_path / 'envs.py'}:BadInfo", f"trainer.output_dir={tmp_path / 'run'}"],
    )
    with pytest.warns(RuntimeWarning, match=r"BadInfo.step: ValueError: info\['tool_calls'\]: got 'many'"):
        train(cfg)
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["env_errors"] == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("rl.multi_turn.stop_tokens=['</tool>']", r"rl\.multi_turn\.stop_tokens\[0\]': got '</tool>'"),
        ("rl.multi_turn.env_options={'budgett': 2}", r"rl\.multi_turn\.env_options\.budgett': not a parameter"),
    ],
)
def test_reprobe30_agent_setup_errors_come_before_the_warmup(tmp_path, override, message):
    (tmp_path / "envs.py").write_text(ENVS)
    cfg = load_config(
        CONFIG,
        [
            *QUICK,
            "trainer.warmup_steps=100000",  # reached only if the check came after the warm-up
            f"rl.multi_turn.env={tmp_path / 'envs.py'}:make",
            override,
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(ValueError, match=message):
        _bounded_train(cfg)


def _bounded_train(cfg, seconds=120):
    import threading

    box = {}

    def run():
        try:
            train(cfg)
        except BaseException as err:
            box["err"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"train still running after {seconds} s"
    if "err" in box:
        raise box["err"]


def test_reprobe30_no_greedy_evaluation_draws_no_evaluation_prompts():
    """Before: eval_size prompts were drawn even with eval_every 0; eval_size 1e8 stalled the setup for minutes."""
    cfg = load_config(CONFIG, [*TINY, "rl.multi_turn.eval_every=0", "rl.multi_turn.eval_size=100000000"])
    task = make_task("multiplication", digits=2)
    drawn = []
    task.sample = lambda n, generator=None: drawn.append(n) or []  # never draws 1e8 prompts, even before the fix
    torch.manual_seed(0)
    model = build_model(cfg, task.tokenizer.vocab_size).eval()
    multi_turn_rollout_stage(cfg, model, task)
    assert drawn == []
