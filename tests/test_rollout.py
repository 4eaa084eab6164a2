"""rlcore.train.rollout: KV-cached sampling against no-cache loop references; top-k / top-p; EOS; engines."""

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.testing.reference import filter_logits_ref, greedy_ref, response_logprobs_ref
from rlcore.train import InferenceEngine, Rollout, TorchEngine, filter_logits, generate, left_pad
from tiny_runs import tiny_lm

EOS, PAD, VOCAB = 1, 0, 12


def tiny_model(dtype=torch.float32, seed=0):
    return tiny_lm(dtype, seed, VOCAB)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


PROMPTS = [[2, 3, 4, 5], [6, 7], [8, 9, 10]]


def test_left_pad():
    ids, mask = left_pad(PROMPTS, PAD)
    assert ids.tolist() == [[2, 3, 4, 5], [0, 0, 6, 7], [0, 8, 9, 10]]
    assert mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]]


@settings(max_examples=50, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 50), max_size=6), max_size=5),
    pad=st.integers(-3, 3),
)
def test_left_pad_matches_a_per_row_loop(seqs, pad):
    ids, mask = left_pad(seqs, pad)
    width = max((len(s) for s in seqs), default=0)
    assert ids.shape == mask.shape == (len(seqs), width) and ids.dtype == mask.dtype == torch.long
    for i, s in enumerate(seqs):  # the loop reference: pad on the left, ones over the tokens
        assert ids[i].tolist() == [pad] * (width - len(s)) + s
        assert mask[i].tolist() == [0] * (width - len(s)) + [1] * len(s)


def _unpadded(r: Rollout, i: int) -> tuple[list[int], list[int]]:
    prompt = r.prompts[i][r.prompt_mask[i] == 1].tolist()
    return prompt, r.responses[i][r.mask[i] == 1].tolist()


def test_greedy_equals_no_cache_loop_reference(model):
    ids, mask = left_pad(PROMPTS, PAD)
    r = generate(model, ids, mask, eos_token_id=EOS, max_new_tokens=6, temperature=0.0)
    expected = greedy_ref(model, PROMPTS, eos_token_id=EOS, max_new_tokens=6)
    assert [_unpadded(r, i)[1] for i in range(3)] == expected


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_unpadded_forward(dtype, tol, temperature):
    model = tiny_model(dtype)
    ids, mask = left_pad(PROMPTS, PAD)
    g = torch.Generator().manual_seed(3)
    r = generate(model, ids, mask, eos_token_id=EOS, max_new_tokens=5, n=2, temperature=temperature, generator=g)
    assert r.logp.dtype == torch.float32
    for i in range(r.responses.shape[0]):
        prompt, response = _unpadded(r, i)
        assert prompt == PROMPTS[i // 2]  # sample j of prompt i sits in row i * n + j
        expected = torch.tensor(
            response_logprobs_ref(model, prompt, response, temperature=temperature), dtype=torch.float32
        )
        torch.testing.assert_close(r.logp[i][r.mask[i] == 1], expected, atol=tol, rtol=0)
    assert bool((r.logp[r.mask == 0] == 0).all())


def test_mask_stops_after_eos_and_padding_follows(model):
    ids, mask = left_pad(PROMPTS, PAD)
    r = generate(model, ids, mask, eos_token_id=EOS, max_new_tokens=8, n=4, generator=torch.Generator().manual_seed(0))
    for row, m in zip(r.responses.tolist(), r.mask.tolist()):
        n_real = sum(m)
        assert m == [1] * n_real + [0] * (len(m) - n_real)
        assert all(t == PAD for t in row[n_real:])
        assert EOS not in row[: n_real - 1]  # only the last real token may be <eos>
        if n_real < len(m):
            assert row[n_real - 1] == EOS


class AlwaysEos(torch.nn.Module):
    """A model whose every next token is <eos>: the loop must stop after one step."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, input_ids, attention_mask, position_ids, use_cache, **cache):
        self.calls += 1
        logits = torch.full((*input_ids.shape, VOCAB), -10.0)
        logits[..., EOS] = 10.0
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits, past_key_values=None)


def test_stops_when_every_row_has_ended():
    m = AlwaysEos()
    ids, mask = left_pad(PROMPTS, PAD)
    r = generate(m, ids, mask, eos_token_id=EOS, max_new_tokens=8, n=2, temperature=0)
    assert m.calls == 1 and r.responses.tolist() == [[EOS]] * 6 and r.mask.tolist() == [[1]] * 6


def test_seeded_generator_reproduces_and_top_k_1_is_greedy(model):
    ids, mask = left_pad(PROMPTS, PAD)
    a = generate(model, ids, mask, eos_token_id=EOS, n=3, generator=torch.Generator().manual_seed(5))
    b = generate(model, ids, mask, eos_token_id=EOS, n=3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logp, b.logp)
    greedy = generate(model, ids, mask, eos_token_id=EOS, temperature=0)
    top1 = generate(model, ids, mask, eos_token_id=EOS, top_k=1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(greedy.responses, top1.responses)


class RowEos(torch.nn.Module):
    """Row ``r`` of the first forward ends (``<eos>``) at response position ``r % 4``; every forward's batch is recorded."""

    def __init__(self):
        super().__init__()
        self.batches: list[int] = []

    def forward(self, input_ids, attention_mask, position_ids, use_cache, past_key_values=None):
        self.batches.append(input_ids.shape[0])
        key = past_key_values
        if key is None:  # prefill: a legacy one-layer cache whose entry for each row is the row's own number
            number = torch.arange(input_ids.shape[0], dtype=torch.float32)[:, None]
            key = ((number, number),)
        row = key[0][0][:, 0].long()  # the rows still here: each row's number travels in its cache entry
        step = attention_mask.shape[1] - 3  # the prompts are 3 wide: response position of the next token
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], VOCAB), -10.0)
        logits[:, -1, 2] = 10.0
        logits[row % 4 == step, -1, 2] = -10.0
        logits[row % 4 == step, -1, EOS] = 10.0
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits, past_key_values=key)


def test_finished_rows_leave_the_batch_and_the_last_token_needs_no_forward():
    m = RowEos()
    ids, mask = left_pad([[3, 4, r] for r in range(2, 10)], PAD)  # 8 distinct prompts: 8 rows in the prefill
    r = generate(m, ids, mask, eos_token_id=EOS, max_new_tokens=6, temperature=0)
    lengths = r.mask.sum(1).tolist()
    assert lengths == [1, 2, 3, 4] * 2  # row r ends at position r % 4, whatever batch it was decoded in
    assert all(r.responses[i, lengths[i] - 1] == EOS for i in range(8))
    assert r.responses[:, 0].tolist() == [EOS, 2, 2, 2] * 2
    # 6 rows left after the first token (3/4 of 8: the batch shrinks to them), 4 after the second,
    # 2 after the third, none after the fourth: no forward is run for a token nobody draws.
    assert m.batches == [8, 6, 4, 2]
    m.batches.clear()
    generate(m, ids, mask, eos_token_id=EOS, max_new_tokens=2, temperature=0)
    assert m.batches == [8, 6]  # two tokens: the prefill and one forward, none for a third


def test_long_tail_rows_match_their_references(model):
    """Rows ending at different times leave the batch; every row's tokens and log-probs still match its own forward."""
    ids, mask = left_pad(PROMPTS, PAD)
    r = generate(model, ids, mask, eos_token_id=EOS, max_new_tokens=24, n=6, generator=torch.Generator().manual_seed(4))
    lengths = r.mask.sum(1)
    assert int(lengths.min()) < 12 and int(lengths.max()) > 12  # some rows end early, others run on
    for i in range(r.responses.shape[0]):
        prompt, response = _unpadded(r, i)
        expected = torch.tensor(response_logprobs_ref(model, prompt, response), dtype=torch.float32)
        torch.testing.assert_close(r.logp[i][r.mask[i] == 1], expected, atol=1e-4, rtol=0)


@settings(max_examples=30)
@given(
    st.lists(st.lists(st.integers(-40, 40), min_size=5, max_size=5, unique=True), min_size=1, max_size=3),
    st.integers(0, 6),
    st.sampled_from([1.0, 0.9, 0.5, 0.2, 0.01]),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_filter_logits_matches_reference(rows, top_k, top_p, dtype):
    logits = (torch.tensor(rows, dtype=torch.float32) / 8).to(dtype)
    got = filter_logits(logits, top_k=top_k, top_p=top_p)
    expected = filter_logits_ref(logits.float(), top_k=top_k, top_p=top_p).to(dtype)
    assert got.dtype == dtype
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])
    assert bool(torch.isfinite(got).any(-1).all())  # the most likely token always survives


def test_filter_logits_hand_values():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[True, False, False, True]]
    # The nucleus grows while the mass ranked above a token is below top_p: 0.4 + 0.3 < 0.75 keeps 0.2.
    assert torch.isinf(filter_logits(logits, top_p=0.75)).tolist() == [[True, False, False, False]]
    assert torch.isinf(filter_logits(logits, top_p=0.69)).tolist() == [[True, False, False, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.4)).tolist() == [[True, False, True, True]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens: got 0"),
        ({"n": 0}, "n: got 0"),
        ({"temperature": -1.0}, "temperature: got -1.0"),
        ({"top_p": 0.0}, r"top_p: got 0.0, expected in \(0, 1\]"),
        ({"top_k": -2}, "top_k: got -2"),
    ],
)
def test_bad_sampling_options(model, kwargs, message):
    ids, mask = left_pad(PROMPTS, PAD)
    with pytest.raises(ValueError, match=message):
        generate(model, ids, mask, eos_token_id=EOS, **kwargs)


def test_bad_prompts(model):
    ids, mask = left_pad(PROMPTS, PAD)
    with pytest.raises(ValueError, match="prompts: got dtype torch.float32"):
        generate(model, ids.float(), mask, eos_token_id=EOS)
    with pytest.raises(ValueError, match="prompt_mask: got shape"):
        generate(model, ids, mask[:, 1:], eos_token_id=EOS)


def test_torch_engine_is_an_inference_engine_and_restores_training_mode(model):
    model.train()
    engine = TorchEngine(model, eos_token_id=EOS, max_new_tokens=3)
    assert isinstance(engine, InferenceEngine)
    ids, mask = left_pad(PROMPTS, PAD)
    r = engine.generate(ids, mask, n=2, generator=torch.Generator().manual_seed(0))
    assert r.responses.shape[0] == 6 and r.responses.shape[1] <= 3
    assert model.training
    model.eval()


# The on-the-fly tasks that feed the rollouts.
from rlcore.train import Addition, CharTokenizer, Reversal, make_task  # noqa: E402


@given(st.text("0123456789+=", max_size=12), st.lists(st.integers(0, 13), max_size=6))
def test_char_tokenizer_round_trip(text, tail):
    tok = CharTokenizer("0123456789+=")
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id] + tail) == text  # decoding stops at <eos>
    assert tok.decode([tok.pad_token_id] + ids) == text
    assert all(2 <= i < tok.vocab_size for i in ids)


def test_tokenizer_errors():
    with pytest.raises(ValueError, match=r"text: got characters \['x'\] outside the alphabet"):
        CharTokenizer("ab").encode("axb")
    with pytest.raises(ValueError, match="alphabet: got 'aa', expected distinct"):
        CharTokenizer("aa")


@pytest.mark.parametrize("task", [Addition(digits=3), Reversal(length=5, min_length=1, letters="xyz")])
def test_tasks_are_verifiable_and_seeded(task):
    a = task.sample(64, torch.Generator().manual_seed(7))
    assert a == task.sample(64, torch.Generator().manual_seed(7))
    assert a != task.sample(64, torch.Generator().manual_seed(8))
    prompts, answers = [s["prompt"] for s in a], [s["answer"] for s in a]
    assert task.reward(prompts, answers, answers=answers).tolist() == [1.0] * 64
    wrong = [x + "1" if isinstance(task, Addition) else x[::-1] + "z" for x in answers]
    assert task.reward(prompts, wrong, answers=answers).tolist() == [0.0] * 64
    for s in a:
        task.tokenizer.encode(s["prompt"] + s["answer"])
        assert len(s["answer"]) <= task.max_answer_length
        if isinstance(task, Addition):
            x, y = s["prompt"][:-1].split("+")
            assert int(s["answer"]) == int(x) + int(y) and max(len(x), len(y)) <= 3
        else:
            assert s["answer"] == s["prompt"][:-1][::-1] and 1 <= len(s["answer"]) <= 5


def test_make_task_names_the_choices():
    assert isinstance(make_task("reversal", length=3), Reversal)
    with pytest.raises(ValueError, match="task: got 'sorting', expected one of 'addition', 'reversal'"):
        make_task("sorting")
    with pytest.raises(ValueError, match="digits: got 0"):
        Addition(digits=0)
    with pytest.raises(ValueError, match="min_length, length: got 3, 2"):
        Reversal(length=2, min_length=3)


@pytest.mark.parametrize("bad", [True, False, VOCAB, VOCAB + 5, -1, 1.0, "1", None])
def test_reprobe30_bool_or_out_of_vocabulary_eos_is_refused(model, bad):
    ids, mask = left_pad(PROMPTS, PAD)
    with pytest.raises(ValueError, match=rf"eos_token_id: got {bad!r}.*, expected an int token id in \[0, {VOCAB}\)"):
        generate(model, ids, mask, eos_token_id=bad, max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"eos_token_id: got {bad!r}.*, expected an int token id in \[0, {VOCAB}\)"):
        TorchEngine(model, eos_token_id=bad, max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"pad_token_id: got {bad!r}.*, expected an int token id in \[0, {VOCAB}\)"):
        TorchEngine(model, eos_token_id=EOS, pad_token_id=bad)
    # The last id of the vocabulary is a valid EOS.
    out = TorchEngine(model, eos_token_id=VOCAB - 1, max_new_tokens=2).generate(ids, mask, n=1, generator=None)
    assert out.responses.shape == (3, 2)
