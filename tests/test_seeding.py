"""rlcore.seeding and the sampling step: the keyed uniforms and inverse-CDF draws against loop references.

A row's draws are a function of (seed, purpose, step, global row, position, draw) only:
determinism, independence of batch split and order, frequencies that match the filtered
softmax, and the masks of ``filter_logits``.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore import seeding
from rlcore.agent import multi_turn_rollout
from rlcore.models import filter_logits, sample_tokens, uniform_table
from rlcore.seeding import Purpose, RowStream, hash32, mix, row_keys, row_uniforms
from rlcore.testing.reference import filter_logits_ref, row_uniform_ref, sample_token_ref
from rlcore.train import TorchEngine, generate, left_pad
from test_rollout import EOS, PAD, VOCAB, tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


# --- the keyed uniforms ---------------------------------------------------------------------


@settings(max_examples=60)
@given(
    seed=st.integers(-(2**70), 2**70),
    purpose=st.integers(0, 6),
    step=st.integers(0, 10**9),
    rows=st.lists(st.integers(0, 2**40), min_size=1, max_size=6),
    position=st.integers(0, 2**33),
    draw=st.integers(0, 3),
)
def test_row_uniforms_equal_the_loop_reference(seed, purpose, step, rows, position, draw):
    keys = row_keys(mix(seed, purpose, step), torch.tensor(rows))
    got = row_uniforms(keys, position, draw)
    want = torch.tensor([row_uniform_ref(seed, purpose, step, r, position, draw) for r in rows], dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    # Per-row positions give each row the value of its own position.
    positions = torch.arange(len(rows)) + position
    want = [row_uniform_ref(seed, purpose, step, r, position + i, draw) for i, r in enumerate(rows)]
    assert row_uniforms(keys, positions, draw).tolist() == want
    # A table [N, S] (the decode loops draw one before their first step) holds the same values by column.
    table = row_uniforms(keys[:, None], torch.arange(3) + position, draw)
    for t in range(3):
        assert torch.equal(table[:, t], row_uniforms(keys, position + t, draw))


@settings(max_examples=40)
@given(st.lists(st.integers(-40, 40), min_size=6, max_size=6), st.integers(1, 6))
def test_the_largest_uniform_still_draws_a_kept_token(row, top_k):
    # u = 1 - 2**-24 times the total weight rounds below the total in float32: never past the last kept token.
    logits = torch.tensor([row], dtype=torch.float32) / 8
    token, _ = sample_tokens(logits, torch.tensor([1 - 2**-24]), top_k=top_k)
    assert 0 <= int(token) < 6 and torch.isfinite(filter_logits(logits, top_k=top_k)[0, int(token)])


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20), st.integers(0, 2**32 - 1))
def test_hash32_in_int64_tensors_equals_python_integers(states, word):
    # The 16-bit split products never overflow int64, even next to 2**32.
    got = hash32(torch.tensor(states), word).tolist()
    assert got == [hash32(s, word) for s in states]
    assert all(0 <= h < 2**32 for h in got)


def test_uniforms_are_uniform_and_independent_across_rows_positions_and_keys():
    n = 1 << 14
    keys = row_keys(mix(0, Purpose.SAMPLING, 0), torch.arange(n))
    u = row_uniforms(keys, 0).double()
    # Kolmogorov-Smirnov: sup |F_n - F| < 1.95 / sqrt(n) fails with probability about 1e-3 for uniforms.
    ks = (torch.arange(1, n + 1, dtype=torch.float64) / n - u.sort().values).abs().max()
    assert ks < 1.95 / math.sqrt(n)
    # Neighbouring positions, rows and steps are uncorrelated (|r| < 5 / sqrt(n)).
    for other in (
        row_uniforms(keys, 1),
        row_uniforms(row_keys(mix(0, Purpose.SAMPLING, 0), torch.arange(n) + 1), 0),
        row_uniforms(row_keys(mix(0, Purpose.SAMPLING, 1), torch.arange(n)), 0),
        row_uniforms(row_keys(mix(0, Purpose.DATA, 0), torch.arange(n)), 0),
        row_uniforms(keys, 0, 1),
    ):
        r = torch.corrcoef(torch.stack([u, other.double()]))[0, 1]
        assert abs(r) < 5 / math.sqrt(n)


def test_mix_and_generator_are_deterministic_and_separate_purposes():
    assert mix(3, Purpose.DATA, 5) == mix(3, 0, 5)
    keys = {mix(s, p, t) for s in range(3) for p in Purpose for t in range(3)}
    assert len(keys) == 3 * len(Purpose) * 3
    a = torch.rand(5, generator=seeding.generator(0, Purpose.DATA, 1))
    assert torch.equal(a, torch.rand(5, generator=seeding.generator(0, Purpose.DATA, 1)))
    assert not torch.equal(a, torch.rand(5, generator=seeding.generator(0, Purpose.WARMUP, 1)))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: mix(True, 0, 0), r"^seed: got True \(bool\), expected an int$"),
        (lambda: mix(0, 0, 1.5), r"^step: got 1\.5 \(float\), expected an int$"),
        (lambda: row_keys(1, torch.tensor([0.5])), r"^rows: got torch\.float32 tensor of shape \(1,\)"),
        (lambda: RowStream(0, 2, 0, torch.zeros(2, 2, dtype=torch.long)), r"^rows: got shape \(2, 2\)"),
        (lambda: RowStream(0, 2, 0, torch.arange(3)).row_ids(4), r"^rows: got 3 row indices, expected 4"),
        (lambda: sample_tokens(torch.zeros(2, 3), None), r"^uniforms: got None with temperature 1\.0"),
    ],
)
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_row_stream_is_a_torch_generator_seeded_by_its_key():
    s = RowStream(7, Purpose.SAMPLING, 3, torch.tensor([4, 5]))
    t = RowStream(7, Purpose.SAMPLING, 3, torch.tensor([4, 5]))
    assert isinstance(s, torch.Generator)
    assert torch.equal(
        torch.multinomial(torch.ones(9), 4, generator=s), torch.multinomial(torch.ones(9), 4, generator=t)
    )
    assert s.select([1]).rows.tolist() == [5] and s.select([1]).key == s.key
    assert RowStream(7, Purpose.SAMPLING, 3).row_ids(3).tolist() == [0, 1, 2]


# --- the sampling step ------------------------------------------------------------------------

logit_rows = st.lists(
    st.lists(st.integers(-40, 40), min_size=6, max_size=6, unique=True).map(lambda r: [v / 8 for v in r]),
    min_size=1,
    max_size=4,
)


@settings(max_examples=80)
@given(
    logit_rows,
    st.lists(st.floats(0, 1, exclude_max=True, width=32), min_size=4, max_size=4),
    st.sampled_from([1.0, 0.7, 2.5, 0.0]),
    st.integers(0, 6),
    st.sampled_from([1.0, 0.9, 0.5, 0.2]),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_sample_tokens_equals_the_loop_reference(rows, us, temperature, top_k, top_p, dtype):
    logits = torch.tensor(rows).to(dtype)
    u = torch.tensor(us[: len(rows)])
    tokens, logp = sample_tokens(logits, u, temperature=temperature, top_k=top_k, top_p=top_p)
    exact = logits.float().tolist()  # the reference sees the values the step sees
    for i, row in enumerate(exact):
        want = sample_token_ref(row, float(u[i]), temperature=temperature, top_k=top_k, top_p=top_p)
        if int(tokens[i]) != want:
            # Only a draw within float32 rounding of a boundary between two tokens may differ.
            scaled = torch.tensor(row, dtype=torch.float64) / (temperature or 1.0)
            kept = filter_logits_ref(scaled[None], top_k=top_k, top_p=top_p)[0]
            cdf = torch.softmax(kept, -1).cumsum(-1)
            assert (cdf - float(u[i])).abs().min() < 1e-5, (row, float(u[i]), int(tokens[i]), want)
        scaled = torch.tensor(row, dtype=torch.float64) / (temperature or 1.0)
        want_logp = torch.log_softmax(scaled, -1)[int(tokens[i])]
        assert abs(float(logp[i]) - float(want_logp)) < 1e-5


@settings(max_examples=40)
@given(logit_rows, st.integers(0, 6), st.sampled_from([1.0, 0.9, 0.5, 0.2, 0.01]), st.sampled_from([1.0, 2.5]))
def test_draws_cover_exactly_the_tokens_filter_logits_keeps(rows, top_k, top_p, temperature):
    # Uniforms at the middle of each kept token's CDF interval draw that token; nothing else is ever drawn.
    logits = torch.tensor(rows)
    kept = filter_logits(logits / temperature, top_k=top_k, top_p=top_p)
    probs = torch.softmax(kept.double(), -1)
    for i in range(len(rows)):
        cdf = probs[i].cumsum(-1)
        mids = (cdf - probs[i] / 2)[probs[i] > 1e-4]
        want = torch.nonzero(probs[i] > 1e-4).squeeze(-1)
        got, _ = sample_tokens(
            logits[i : i + 1].expand(len(mids), -1), mids.float(), temperature=temperature, top_k=top_k, top_p=top_p
        )
        assert got.tolist() == want.tolist()
        grid = torch.linspace(0, 1, 257)[:-1]
        drawn, _ = sample_tokens(
            logits[i : i + 1].expand(256, -1), grid, temperature=temperature, top_k=top_k, top_p=top_p
        )
        assert torch.isfinite(kept[i, drawn]).all()  # never a token the mask drops


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 1.0, 1.0), (3, 1.0, 0.7), (0, 0.8, 2.5), (4, 0.9, 1.0)])
def test_empirical_frequencies_match_the_filtered_softmax(top_k, top_p, temperature):
    n, vocab = 40_000, 8
    logits = torch.tensor([[1.2, 0.3, -0.5, 2.0, 0.0, -1.5, 0.9, 0.4]])
    u = uniform_table(RowStream(11, Purpose.SAMPLING, 2), n, torch.arange(1), CPU)[:, 0]
    tokens, _ = sample_tokens(logits.expand(n, -1), u, temperature=temperature, top_k=top_k, top_p=top_p)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    p = torch.softmax(filter_logits_ref(logits.double() / temperature, top_k=top_k, top_p=top_p), -1)[0]
    bound = 5 * (p * (1 - p) / n).sqrt() + 1e-12  # five binomial standard deviations per token
    assert ((freq - p).abs() <= bound).all(), (freq, p)
    assert (freq[p == 0] == 0).all()


# --- through the decode loops -----------------------------------------------------------------

PROMPTS = [[2, 3, 4, 5], [6, 7], [8, 9, 10], [3, 3], [11, 4, 2]]


def _generate(model, prompts, stream, n=2, **kwargs):
    ids, mask = left_pad(prompts, PAD)
    return generate(
        model,
        ids,
        mask,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_new_tokens=6,
        n=n,
        temperature=1.5,
        generator=stream,
        **kwargs,
    )


def _rows_of(r, keep):
    """Each row's (response up to its mask, log-probs) as lists."""
    return [(r.responses[i][r.mask[i] != 0].tolist(), r.logp[i][r.mask[i] != 0]) for i in keep]


def _assert_same_rows(a, b):
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_samples_the_same_in_any_split_and_order_of_the_batch(dtype):
    model = tiny_model(dtype)
    n = 2
    whole = _generate(model, PROMPTS, RowStream(5, Purpose.SAMPLING, 9), n=n)
    assert len({tuple(t) for t, _ in _rows_of(whole, range(len(PROMPTS) * n))}) > 3  # not all one response
    # Two shards, as two data-parallel ranks take them: rank r's rows are r * rows + local row.
    first = _generate(model, PROMPTS[:3], RowStream(5, Purpose.SAMPLING, 9, torch.arange(6)), n=n)
    second = _generate(model, PROMPTS[3:], RowStream(5, Purpose.SAMPLING, 9, torch.arange(6, 10)), n=n)
    _assert_same_rows(_rows_of(first, range(6)) + _rows_of(second, range(4)), _rows_of(whole, range(10)))
    # The prompts in another order, each row keyed by its global index.
    order = [4, 1, 3, 0, 2]
    rows = torch.tensor([p * n + j for p in order for j in range(n)])
    shuffled = _generate(model, [PROMPTS[p] for p in order], RowStream(5, Purpose.SAMPLING, 9, rows), n=n)
    _assert_same_rows(_rows_of(shuffled, range(10)), _rows_of(whole, rows.tolist()))
    # Deterministic; another step or seed draws something else.
    again = _generate(model, PROMPTS, RowStream(5, Purpose.SAMPLING, 9), n=n)
    assert torch.equal(again.responses, whole.responses) and torch.equal(again.logp, whole.logp)
    other = _generate(model, PROMPTS, RowStream(5, Purpose.SAMPLING, 10), n=n)
    assert not torch.equal(other.responses, whole.responses)


class OneShot:
    def reset(self, sample):
        return ""

    def step(self, action):
        return "", 0.5, True, {}


def test_multi_turn_rows_sample_what_generate_samples_and_ignore_the_other_rows(model):
    stream = RowStream(3, Purpose.SAMPLING, 1)
    ref = _generate(model, PROMPTS, stream, n=1, top_k=5)

    def roll(prompts, rows):
        return multi_turn_rollout(
            model,
            prompts,
            [OneShot() for _ in prompts],
            decode=lambda ids: "",
            encode_observation=list,
            eos_token_id=EOS,
            pad_token_id=PAD,
            max_turns=1,
            max_new_tokens=6,
            max_total_tokens=6,
            temperature=1.5,
            top_k=5,
            generator=RowStream(3, Purpose.SAMPLING, 1, rows),
        )

    whole = roll(PROMPTS, torch.arange(5))
    assert torch.equal(whole["responses"], ref.responses) and torch.equal(whole["rollout_logp"], ref.logp)
    part = roll(PROMPTS[3:], torch.tensor([3, 4]))
    for i in range(2):
        m = part["mask"][i] != 0
        assert part["responses"][i][m].tolist() == whole["responses"][3 + i][whole["mask"][3 + i] != 0].tolist()


class GeneratorOnlyEngine(TorchEngine):
    """A user's engine written against torch.Generator: it draws its own noise from whatever generator it gets."""

    def generate(self, prompts, prompt_mask, *, n, generator):
        torch.rand(3, generator=generator)
        return generate(
            self.model,
            prompts,
            prompt_mask,
            n=n,
            generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator))),
            **self.sampling,
        )


def test_an_engine_that_takes_a_torch_generator_accepts_a_row_stream(model):
    ids, mask = left_pad(PROMPTS, PAD)
    engine = GeneratorOnlyEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=3)
    a = engine.generate(ids, mask, n=1, generator=RowStream(0, Purpose.SAMPLING, 0, torch.arange(5)))
    b = engine.generate(ids, mask, n=1, generator=RowStream(0, Purpose.SAMPLING, 0, torch.arange(5)))
    assert torch.equal(a.responses, b.responses) and a.responses.shape[0] == 5 and a.responses.max() < VOCAB
