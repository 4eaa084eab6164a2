"""deploy.carry_over: unfinished rows stay in flight across steps; batches of finished groups within the staleness bound."""

import types

import pytest
import torch

from rlcore.dataflow import StageGraph, run_pipeline, stage
from rlcore.seeding import Purpose, RowStream
from rlcore.train import generate, left_pad, parse_config
from rlcore.train.carry import ContinuousRollout, carried
from tiny_runs import tiny_lm

EOS, PAD, VOCAB, SEED, NEW = 1, 0, 12, 3, 8
N = 2  # samples per prompt
PROMPTS = [[2, 3, 4, 5], [6, 7], [8, 9, 10], [11, 4]]


def step_batch(step, prompts=PROMPTS, n=N, floor=-100):
    """The columns sent for one step: each prompt n times; floor -100: the versions never bind."""
    ids, mask = left_pad(prompts, PAD)
    rows = len(prompts) * n
    return {
        "prompts": ids.repeat_interleave(n, 0),
        "prompt_mask": mask.repeat_interleave(n, 0),
        "iteration": torch.full((rows,), step),
        "row": torch.arange(rows),
        "group": torch.arange(len(prompts)).repeat_interleave(n),
        "floor": torch.tensor([floor]),
        "want": torch.tensor([len(prompts)]),
    }


def ahead(step, floor=-100):
    """What call ``step`` sends with one step ahead in flight: steps 0 and 1 first, then step + 1 (4 groups wanted)."""
    parts = [step_batch(s, floor=floor) for s in ([0, 1] if step == 0 else [step + 1])]
    b = {c: torch.cat([p[c] for p in parts]) for c in ("iteration", "row", "group")}
    b["prompts"], b["prompt_mask"] = parts[0]["prompts"], parts[0]["prompt_mask"]
    if len(parts) == 2:
        b["prompts"] = torch.cat([parts[0]["prompts"], parts[1]["prompts"]])
        b["prompt_mask"] = torch.cat([parts[0]["prompt_mask"], parts[1]["prompt_mask"]])
    return {**b, "floor": torch.tensor([floor]), "want": torch.tensor([len(PROMPTS)])}


class Held(ContinuousRollout):
    """Rows stay in the batch to a length keyed by (step, row): a few far longer than the rest."""

    def hold(self, step, rows):
        return torch.tensor([30 if (step + r) % 5 == 0 else 2 for r in rows.tolist()])


def rollout(model, cls=ContinuousRollout):
    return cls(model, seed=SEED, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=NEW, temperature=1.0)


def never():
    return None


def check_groups(out, n=N):
    """Whole groups, one after the other: n consecutive rows of one (prompt_step, row // n)."""
    keys = list(zip(out["prompt_step"].tolist(), (out["row"] // n).tolist()))
    assert len(keys) % n == 0
    for g in range(0, len(keys), n):
        assert len(set(keys[g : g + n])) == 1
    assert len(set(keys[::n])) == len(keys) // n


def test_with_fixed_weights_each_row_is_the_plain_rollout_of_its_key():
    """Carried or not, a row's tokens are generate()'s for its (step, row) stream: decoding beside others changes nothing."""
    model = tiny_lm(torch.float32, 0, VOCAB)
    pool = rollout(model, Held)
    admitted, returned = set(), {}
    for step in range(4):
        admitted |= {(s, r) for s in range(step + 2) for r in range(8)}
        out = pool(ahead(step), never, 0)
        check_groups(out)
        assert out["responses"].shape[0] == 8  # as many rows back as went in
        for k, (s, r) in enumerate(zip(out["prompt_step"].tolist(), out["row"].tolist())):
            assert (s, r) not in returned
            on = out["mask"][k] == 1
            returned[s, r] = (out["responses"][k][on].tolist(), out["rollout_logp"][k][on])
    assert set(returned) | set(pool.in_flight) == admitted and not set(returned) & set(pool.in_flight)
    for step in range(5):
        b = step_batch(step)
        plain = generate(
            model,
            b["prompts"],
            b["prompt_mask"],
            eos_token_id=EOS,
            pad_token_id=PAD,
            max_new_tokens=NEW,
            generator=RowStream(SEED, Purpose.SAMPLING, step, b["row"]),
        )
        for r in range(8):
            if (step, r) in returned:
                tokens, logp = returned[step, r]
                on = plain.mask[r] == 1
                assert tokens == plain.responses[r][on].tolist()
                torch.testing.assert_close(logp, plain.logp[r][on], atol=1e-4, rtol=0)


def test_the_long_rows_are_carried_into_later_calls():
    pool = rollout(tiny_lm(torch.float32, 0, VOCAB), Held)
    late = 0
    for step in range(5):
        out = pool(ahead(step), never, 0)
        late += int((out["prompt_step"] < step).sum())
    assert late > 0 and pool.in_flight


def bumping(every):
    """A refresh that reports a new version every ``every`` decode steps (the weights stay: the bound is what is tested)."""
    state = types.SimpleNamespace(asked=0, version=0)

    def refresh():
        state.asked += 1
        if state.asked % every == 0:
            state.version += 1
            return state.version
        return None

    return refresh, state


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_no_returned_token_is_older_than_the_calls_floor(staleness):
    pool = rollout(tiny_lm(torch.float32, 0, VOCAB), Held)
    refresh, state = bumping(3)
    seen = set()
    for i in range(8):
        # The scheduler's rule: call i comes at a version of at least i - staleness; here the worker is ahead.
        state.version = max(state.version, i - staleness)
        floor = i - staleness
        out = pool(ahead(i, floor=floor), refresh, state.version)
        check_groups(out)
        on = out["mask"] == 1
        assert bool((out["token_version"][on] >= floor).all())
        assert torch.equal(out["version"], out["token_version"][:, 0])
        keys = set(zip(out["prompt_step"].tolist(), out["row"].tolist()))
        assert not keys & seen
        seen |= keys


def test_carried_pipeline_trains_every_row_once_within_the_bound():
    """The trainer's side (carried) in a real pipeline: slots filled with finished groups, prompts following their rows."""
    model = tiny_lm(torch.float32, 0, VOCAB)
    pool = rollout(model, Held)
    version = types.SimpleNamespace(v=0)
    prompts = {s: [[2 + (s + k) % 9, 3 + k] for k in range(3)] for s in range(8)}  # 6 steps, 2 ahead
    tok = types.SimpleNamespace(pad_token_id=PAD)

    class Source:
        columns = ("prompts", "prompt_mask", "answers", "group", "iteration", "row")
        tokenizer, batch_size = tok, 3

        def loader(self, rank, start, n):
            def load(i):
                b = step_batch(start + i, prompts[start + i], n)
                answers = [torch.tensor([start + i, g]) for g in b["group"].tolist()]
                return {
                    **{c: b[c] for c in ("prompts", "prompt_mask", "iteration", "row", "group")},
                    "answers": answers,
                }

            return load

    def worker(b):
        current = version.v
        return pool(b, lambda: None, current)

    proxy = stage(worker, inputs=["prompts"], outputs=["x"], name="rollout", role="rollout", resource="gen")
    roll, source = carried(proxy, Source(), rank=0, start=0, n=N, staleness=2, ahead=2)

    def update(b):
        version.v += 1
        return {"loss": torch.zeros(b["mask"].shape[0])}

    up = stage(update, inputs=["mask", "answers"], outputs=["loss"], name="update", role="update", resource="train")
    graph = StageGraph([roll, up], sources=source.columns)
    collect = ["prompt_step", "row", "token_version", "iteration", "mask", "prompts", "prompt_mask", "group"]
    result = run_pipeline(
        graph, source.loader(0, 0, N), num_prompts=3, n_samples=N, num_iterations=6, staleness=2, collect=collect
    )
    trained = []
    for i, b in enumerate(result.batches):
        on = b["mask"] == 1
        assert bool(((i - b["token_version"])[on] <= 2).all())
        assert b["group"].tolist() == [0, 0, 1, 1, 2, 2]
        for k, (s, r) in enumerate(zip(b["prompt_step"].tolist(), b["row"].tolist())):
            trained.append((s, r))
            want = prompts[s][r // N]
            got = b["prompts"][k][b["prompt_mask"][k] == 1].tolist()
            assert got == want
    assert len(trained) == len(set(trained)) == 36
    assert set(trained) | set(pool.in_flight) == {(s, r) for s in range(8) for r in range(6)}
    assert any(s < i for i, b in enumerate(result.batches) for s in b["prompt_step"].tolist())  # carried


BASE = {"model": {"model_name_or_path": {"model_type": "qwen2"}}}
PARTIAL = {"partial_rollouts": True, "async_infer": True, "mode": "disaggregated"}


def test_carry_over_needs_partial_rollouts():
    with pytest.raises(ValueError, match="config key 'deploy.carry_over'"):
        parse_config({**BASE, "deploy": {"carry_over": True}})
    cfg = parse_config({**BASE, "deploy": {**PARTIAL, "carry_over": True}, "trainer": {"max_worker_restarts": 1}})
    assert cfg.deploy.carry_over and cfg.trainer.max_worker_restarts == 1  # a replacement is sent the rows again


def test_a_carry_over_run_keeps_every_token_within_staleness(tmp_path):
    from pathlib import Path

    from rlcore.train import load_config, train
    from tiny_runs import TINY

    root = Path(__file__).resolve().parents[1]
    extra = ["trainer.steps=4", "deploy.mode=disaggregated", "deploy.async_infer=true", "deploy.staleness=2"]
    extra += ["deploy.partial_rollouts=true", "deploy.carry_over=true"]
    cfg = load_config(root / "configs" / "grpo_tiny.yaml", [*TINY, f"trainer.output_dir={tmp_path}", *extra])
    run = train(cfg, reward=lambda prompts, responses, **c: [len(r) / 6 for r in responses])
    assert [r["step"] for r in run.records] == [0, 1, 2, 3]
    for r in run.records:
        assert 0 <= r["token_lag"] <= r["token_lag_max"] <= 2
