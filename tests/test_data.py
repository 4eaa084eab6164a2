"""Prompt and preference datasets: JSONL / Parquet / saved datasets, chat templates, length limits, errors, seeded resumable order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.data import RESERVED_COLUMNS, epoch_permutation, load_preferences, load_prompts, read_table, sample_indices
from rlcore.testing.hf_fixtures import arithmetic_rows, tiny_tokenizer, write_prompt_files


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return arithmetic_rows(12, seed=5)


@pytest.fixture(scope="module")
def tokenizer(rows):
    return tiny_tokenizer([r["prompt"] for r in rows] * 3, vocab_size=290)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_parquet_and_saved_dataset_agree(tmp_path, rows):
    import datasets

    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "p.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved_dict"))
    sources = [
        _write_jsonl(tmp_path / "p.jsonl", rows),
        tmp_path / "p.parquet",
        tmp_path / "saved",
        tmp_path / "saved_dict",
    ]
    loaded = [load_prompts(s) for s in sources]
    for data in loaded:
        assert data.prompts == tuple(r["prompt"] for r in rows)
        assert data.texts == data.prompts  # no tokenizer: no template
        assert data.prompt_ids is None
        assert data.reward_columns([3, 0]) == {
            "answers": [rows[3]["answer"], rows[0]["answer"]],
            "a": [rows[3]["a"], rows[0]["a"]],
            "b": [rows[3]["b"], rows[0]["b"]],
        }


def test_answer_key_none_and_other_keys(tmp_path, rows):
    path = _write_jsonl(tmp_path / "q.jsonl", [{"question": r["prompt"], "sol": r["answer"]} for r in rows])
    data = load_prompts(path, prompt_key="question", answer_key="sol")
    assert data.columns["answers"] == tuple(r["answer"] for r in rows)
    assert set(data.columns) == {"answers"}
    assert set(load_prompts(path, prompt_key="question", answer_key=None).columns) == {"sol"}


def test_chat_template_applied_when_present(tmp_path, rows, tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    data = load_prompts(path, tokenizer=tokenizer)
    expected = f"<|im_start|>user\n{rows[0]['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    assert data.texts[0] == expected
    assert list(data.prompt_ids[0]) == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert data.prompts[0] == rows[0]["prompt"]  # rewards see the user's prompt
    plain = load_prompts(path, tokenizer=tokenizer, apply_chat_template=False)
    assert plain.texts[0] == rows[0]["prompt"]
    system = load_prompts(path, tokenizer=tokenizer, system_prompt="Be brief.")
    assert system.texts[0].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_messages_prompts(tmp_path, tokenizer):
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    path = _write_jsonl(tmp_path / "m.jsonl", [{"prompt": chat, "answer": "1"}])
    data = load_prompts(path, tokenizer=tokenizer)
    assert data.texts[0] == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match=r"prompt_key: row 0 .* holds list"):
        load_prompts(path)


def test_no_template_tokenizer(tmp_path, rows):
    bare = tiny_tokenizer([r["prompt"] for r in rows], vocab_size=280, chat_template=None)
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    assert load_prompts(path, tokenizer=bare).texts[0] == rows[0]["prompt"]
    with pytest.raises(ValueError, match="apply_chat_template: got True, but the tokenizer has no chat template"):
        load_prompts(path, tokenizer=bare, apply_chat_template=True)


def test_max_prompt_length_drop_truncate_error(tmp_path, tokenizer):
    rows = [{"prompt": "1 + 1?", "answer": "2"}, {"prompt": "What is 12 + 13 + 14 + 15 + 16?", "answer": "70"}]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    lengths = [len(ids) for ids in load_prompts(path, tokenizer=tokenizer).prompt_ids]
    limit = (lengths[0] + lengths[1]) // 2
    assert lengths[0] <= limit < lengths[1]

    dropped = load_prompts(path, tokenizer=tokenizer, max_prompt_length=limit)
    assert (dropped.num_dropped, dropped.num_truncated, len(dropped)) == (1, 0, 1)
    assert dropped.columns["answers"] == ("2",)

    full = load_prompts(path, tokenizer=tokenizer).prompt_ids[1]
    left = load_prompts(path, tokenizer=tokenizer, max_prompt_length=limit, overlong="truncate_left")
    assert (left.num_dropped, left.num_truncated, len(left)) == (0, 1, 2)
    assert left.prompt_ids[1] == full[-limit:]
    assert left.texts[1].endswith("<|im_start|>assistant\n")  # the generation prompt survives
    right = load_prompts(path, tokenizer=tokenizer, max_prompt_length=limit, overlong="truncate_right")
    assert right.prompt_ids[1] == full[:limit]

    with pytest.raises(ValueError, match=r"max_prompt_length: 1 prompts of .*p\.jsonl.* row 1"):
        load_prompts(path, tokenizer=tokenizer, max_prompt_length=limit, overlong="error")
    with pytest.raises(ValueError, match="max_prompt_length: all 2 prompts"):
        load_prompts(path, tokenizer=tokenizer, max_prompt_length=1)
    with pytest.raises(ValueError, match="max_prompt_length: counts tokens"):
        load_prompts(path, max_prompt_length=4)
    with pytest.raises(ValueError, match="overlong: got 'cut'"):
        load_prompts(path, tokenizer=tokenizer, overlong="cut")


def test_errors_are_one_line_and_name_the_thing(tmp_path, rows):
    import datasets

    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    cases = [
        (lambda: load_prompts(tmp_path / "nope.jsonl"), r"data\.path: got '.*nope\.jsonl', which does not exist"),
        (lambda: load_prompts(path, prompt_key="question"), r"prompt_key: column 'question' is not in '.*p\.jsonl'"),
        (lambda: load_prompts(path, answer_key="solution"), r"answer_key: column 'solution' is not in '.*p\.jsonl'"),
        (lambda: load_prompts((tmp_path / "e.jsonl").open("w").close() or tmp_path / "e.jsonl"), "is empty"),
        (lambda: load_prompts(tmp_path / "p.txt"), "expected a file ending in"),
        (
            lambda: read_table(tmp_path / "bad.jsonl", what="data.val_path"),
            r"data\.val_path: '.*bad\.jsonl' is not a readable json file: line 2 is not valid JSON",
        ),
    ]
    (tmp_path / "p.txt").write_text("x")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{not json\n')
    datasets.Dataset.from_dict({"prompt": [], "answer": []}).save_to_disk(str(tmp_path / "empty_saved"))
    cases.append((lambda: load_prompts(tmp_path / "empty_saved"), "is empty, expected at least one prompt"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    cases.append((lambda: load_prompts(tmp_path / "dd"), r"holds splits \['test'\], expected one named 'train'"))
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as info:
            call()
        assert "\n" not in str(info.value), str(info.value)


def test_fixture_files_load(tmp_path):
    train, val = write_prompt_files(tmp_path, num_train=30, num_val=5)
    assert len(load_prompts(train)) == 30
    assert len(load_prompts(val)) == 5


@settings(max_examples=30)
@given(
    n=st.integers(1, 9),
    seed=st.integers(0, 2**40),
    start=st.integers(0, 30),
    cuts=st.lists(st.integers(0, 12), max_size=4),
    shuffle=st.booleans(),
)
def test_sample_indices_is_resumable_and_a_permutation_per_epoch(n, seed, start, cuts, shuffle):
    total = sum(cuts)
    whole = sample_indices(n, total, seed=seed, position=start, shuffle=shuffle)
    # the definition, position by position
    assert whole.indices == [
        epoch_permutation(n, seed=seed, epoch=p // n, shuffle=shuffle)[p % n] for p in range(start, start + total)
    ]
    assert whole.epochs == [p // n for p in range(start, start + total)]
    # drawing in pieces, resuming from next_position each time, gives the same prompts
    pieces, position = [], start
    for c in cuts:
        draw = sample_indices(n, c, seed=seed, position=position, shuffle=shuffle)
        pieces += draw.indices
        position = draw.next_position
    assert pieces == whole.indices and position == start + total
    for epoch in range(3):
        assert sorted(epoch_permutation(n, seed=seed, epoch=epoch, shuffle=shuffle)) == list(range(n))


def test_epochs_and_seeds_shuffle_differently():
    orders = {tuple(epoch_permutation(50, seed=s, epoch=e)) for s in range(3) for e in range(3)}
    assert len(orders) == 9
    assert epoch_permutation(50, seed=1, epoch=2) == epoch_permutation(50, seed=1, epoch=2)


def test_sample_indices_rejects_bad_input():
    for kwargs, pattern in [
        (dict(num_prompts=0, count=1, seed=0, position=0), "num_prompts: got 0"),
        (dict(num_prompts=3, count=-1, seed=0, position=0), "count: got -1"),
        (dict(num_prompts=3, count=1, seed=-2, position=0), "seed: got -2"),
        (dict(num_prompts=3, count=1, seed=0, position=True), "position: got True"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            sample_indices(**kwargs)


def _pairs(rows: list[dict]) -> list[dict]:
    return [
        {
            "prompt": r["prompt"],
            "chosen": f"It is {r['answer']}.",
            "rejected": f"It is {int(r['answer']) + 1}.",
            "id": i,
        }
        for i, r in enumerate(rows)
    ]


def test_preference_pairs_are_the_tokenizers_ids_with_eos(tmp_path, rows, tokenizer):
    path = _write_jsonl(tmp_path / "pairs.jsonl", _pairs(rows))
    pairs = load_preferences(path, tokenizer=tokenizer)
    prompts = load_prompts(path, tokenizer=tokenizer, answer_key=None)
    assert len(pairs) == len(rows) and pairs.prompts.texts == prompts.texts  # the chat template, as for RL
    assert pairs.prompts.prompt_ids == prompts.prompt_ids
    assert set(pairs.prompts.columns) == {"id"}  # the response columns are not reward columns
    eos = tokenizer.eos_token_id
    for i, r in enumerate(rows):
        for side, want in (("chosen", f"It is {r['answer']}."), ("rejected", f"It is {int(r['answer']) + 1}.")):
            ids = getattr(pairs, f"{side}_ids")[i]
            assert getattr(pairs, side)[i] == want
            assert list(ids) == [*tokenizer(want, add_special_tokens=False)["input_ids"], eos]
    # conversational responses (TRL's layout): the last message's content
    chat = [{**p, "chosen": [{"role": "assistant", "content": p["chosen"]}]} for p in _pairs(rows)]
    assert load_preferences(_write_jsonl(tmp_path / "chat.jsonl", chat), tokenizer=tokenizer).chosen == pairs.chosen
    assert load_preferences(path, tokenizer=tokenizer, eos_token_id=7).chosen_ids[0][-1] == 7


def test_preference_length_limits_drop_truncate_and_count(tmp_path, rows, tokenizer):
    data = _pairs(rows)
    data[2]["rejected"] = "It is " + "1 2 3 4 5 6 7 8 9 " * 4
    path = _write_jsonl(tmp_path / "pairs.jsonl", data)
    lengths = [len(x) for x in load_preferences(path, tokenizer=tokenizer).rejected_ids]
    limit = sorted(lengths)[-2]  # only row 2's rejected response is longer
    assert lengths[2] > limit
    dropped = load_preferences(path, tokenizer=tokenizer, max_response_length=limit)
    assert (len(dropped), dropped.num_dropped, dropped.num_truncated) == (len(rows) - 1, 1, 0)
    assert dropped.prompts.columns["id"] == tuple(i for i in range(len(rows)) if i != 2)  # aligned with the pairs
    cut = load_preferences(path, tokenizer=tokenizer, max_response_length=limit, overlong="truncate_right")
    assert (len(cut), cut.num_dropped, cut.num_truncated) == (len(rows), 0, 1)
    assert cut.rejected_ids[2] == load_preferences(path, tokenizer=tokenizer).rejected_ids[2][:limit]
    with pytest.raises(ValueError, match=r"max_response_length: pair 2 of .* longer than"):
        load_preferences(path, tokenizer=tokenizer, max_response_length=limit, overlong="error")
    prompt_lengths = [len(x) for x in load_prompts(path, tokenizer=tokenizer, answer_key=None).prompt_ids]
    cap = max(prompt_lengths) - 1
    long = [i for i, n in enumerate(prompt_lengths) if n > cap]
    short = load_preferences(path, tokenizer=tokenizer, max_prompt_length=cap)
    assert long and short.prompts.num_dropped == len(long) and len(short) == len(rows) - len(long)
    assert short.prompts.columns["id"] == tuple(i for i in range(len(rows)) if i not in long)
    assert short.chosen == tuple(p["chosen"] for i, p in enumerate(data) if i not in long)


def test_preference_errors_name_the_column_and_the_file(tmp_path, rows, tokenizer):
    no_rejected = [{k: v for k, v in p.items() if k != "rejected"} for p in _pairs(rows)]
    path = _write_jsonl(tmp_path / "nocol.jsonl", no_rejected)
    with pytest.raises(ValueError, match=r"rejected_key: column 'rejected' is not in '.*nocol\.jsonl'") as info:
        load_preferences(path, tokenizer=tokenizer)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"chosen_key: column 'better' is not in"):
        load_preferences(path, tokenizer=tokenizer, chosen_key="better")
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{**_pairs(rows)[0], "chosen": 3}])
    with pytest.raises(ValueError, match=r"chosen: row 0 of .* holds int, expected a string or a list"):
        load_preferences(bad, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="max_response_length: got 0"):
        load_preferences(bad, tokenizer=tokenizer, max_response_length=0)
    with pytest.raises(ValueError, match="tokenizer: got None"):
        load_preferences(bad, tokenizer=None)


@pytest.mark.parametrize("name", RESERVED_COLUMNS)
def test_reprobe30_a_column_named_as_a_reward_argument_is_refused_at_load(tmp_path, rows, tokenizer, name):
    # The trainer calls reward(prompts, responses, batch=..., **columns): such a column failed at step 0 with
    # "TypeError: got multiple values".
    path = _write_jsonl(tmp_path / "p.jsonl", [{**r, name: 1} for r in rows])
    with pytest.raises(ValueError, match=rf"data\.path: '.*p\.jsonl' has a column named '{name}'.*rename that column"):
        load_prompts(path)
    assert {"prompts", "responses", "batch"} <= set(RESERVED_COLUMNS)
    # A preference dataset's response columns never reach the rewards: any name does.
    pairs = [{"prompt": p["prompt"], "responses": p["chosen"], "rejected": p["rejected"]} for p in _pairs(rows)]
    assert len(
        load_preferences(_write_jsonl(tmp_path / "pairs.jsonl", pairs), tokenizer=tokenizer, chosen_key="responses")
    ) == len(rows)


def _truncated_parquet(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _empty_parquet(path: Path) -> Path:
    import datasets

    datasets.Dataset.from_dict({"prompt": [], "answer": []}).to_parquet(str(path))
    return path


def _saved(path: Path, rows: list[dict], damage: str) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    arrow = next(path.glob("*.arrow"))
    if damage == "truncated":
        arrow.write_bytes(arrow.read_bytes()[:100])
    elif damage == "missing shard":
        arrow.unlink()
    else:
        (path / "state.json").write_text("{broken")
    return path


MALFORMED = {
    "jsonl of blank lines": (lambda d, rows: _text(d / "p.jsonl", "\n\n  \n"), r"holds only blank lines"),
    "jsonl with a broken line": (
        lambda d, rows: _text(d / "p.jsonl", '{"prompt": "a"}\n\n{"prompt": "b"\n{"prompt": "c"}\n'),
        r"line 3 is not valid JSON",
    ),
    "jsonl with a list line": (lambda d, rows: _text(d / "p.jsonl", '{"prompt": "a"}\n[1, 2]\n'), r"line 2 holds list"),
    "jsonl of non-UTF-8 bytes": (
        lambda d, rows: _bytes(d / "p.jsonl", b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n'),
        r"line 2 of '.*p\.jsonl' is not UTF-8 text",
    ),
    "json cut short": (
        lambda d, rows: _text(d / "p.json", '[{"prompt": "a"},\n {"prompt": '),
        r"line 2 column 13: Expecting value",
    ),
    "csv with an open quote": (lambda d, rows: _text(d / "p.csv", 'prompt,answer\n"a,b\n'), r"csv file: ParserError"),
    "csv of blank lines": (lambda d, rows: _text(d / "p.csv", "\n\n"), r"csv file: EmptyDataError"),
    "csv of latin-1 bytes": (
        lambda d, rows: _bytes(d / "p.csv", b"prompt,answer\ncaf\xe9,1\n"),
        r"line 2 of '.*p\.csv' is not UTF-8",
    ),
    "csv of its header alone": (lambda d, rows: _text(d / "p.csv", "prompt,answer\n"), r"it holds no rows"),
    "parquet of no rows": (lambda d, rows: _empty_parquet(d / "p.parquet"), r"'.*p\.parquet' holds no rows"),
    "truncated parquet": (lambda d, rows: _truncated_parquet(d / "p.parquet", rows), r"parquet file: ArrowInvalid"),
    "parquet that is text": (lambda d, rows: _text(d / "p.parquet", "prompt\n"), r"not a readable parquet file"),
    "saved dataset, truncated shard": (
        lambda d, rows: _saved(d / "saved", rows, "truncated"),
        r"reading the saved dataset '.*saved' failed",
    ),
    "saved dataset, missing shard": (
        lambda d, rows: _saved(d / "saved", rows, "missing shard"),
        r"reading the saved dataset '.*saved' failed with FileNotFoundError",
    ),
    "saved dataset, broken state.json": (
        lambda d, rows: _saved(d / "saved", rows, "state"),
        r"reading the saved dataset '.*saved' failed with JSONDecodeError",
    ),
    "directory that is no dataset": (
        lambda d, rows: _text(d / "folder" / "notes.txt", "x").parent,
        r"reading the saved dataset '.*folder' failed",
    ),
}


def _text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", list(MALFORMED))
def test_reprobe30_malformed_files_are_one_line_naming_the_file(tmp_path, rows, case, capfd):
    make, pattern = MALFORMED[case]
    path = make(tmp_path, rows)
    with pytest.raises(ValueError, match=pattern) as info:
        load_prompts(path, what="data.val_path")
    message = str(info.value)
    assert message.startswith("data.val_path: ") and str(path) in message and "\n" not in message, message
    assert "Failed to" not in capfd.readouterr().err  # datasets' own log line of the same failure is not printed


@pytest.mark.parametrize(
    "template, pattern",
    [
        ("{% for m in messages %}{{ m.content }", r"TemplateSyntaxError"),
        ("{{ raise_exception('only user turns') }}", r"only user turns"),
        ("{{ messages[0].content.nope.deeper }}", r"UndefinedError"),
    ],
)
def test_reprobe30_chat_template_errors_name_the_row_and_the_file(tmp_path, rows, template, pattern):
    tok = tiny_tokenizer([r["prompt"] for r in rows], chat_template=template)
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=rf"apply_chat_template: the tokenizer's chat template failed on row 0 of '.*p\.jsonl': .*{pattern}",
    ) as info:
        load_prompts(path, tokenizer=tok)
    assert "\n" not in str(info.value)


def test_reprobe30_the_same_column_chosen_and_rejected_is_refused(tmp_path, rows, tokenizer):
    path = _write_jsonl(tmp_path / "pairs.jsonl", _pairs(rows))
    with pytest.raises(ValueError, match=r"rejected_key: got 'chosen', the same column as chosen_key"):
        load_preferences(path, tokenizer=tokenizer, rejected_key="chosen")


def _deep_json(depth: int) -> str:
    return json.dumps({"prompt": "1+1=", "answer": "2"})[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}\n"


@pytest.mark.parametrize("depth", [101, 1000])
def test_reprobe30_deeply_nested_json_is_one_line_naming_the_line(tmp_path, rows, depth):
    path = _write_jsonl(tmp_path / "p.jsonl", rows[:2])
    path.write_text(path.read_text() + _deep_json(depth))
    with pytest.raises(ValueError, match=r"'.*p\.jsonl' is not a readable json file: line 3 nests lists") as info:
        load_prompts(path)
    assert "\n" not in str(info.value)


def test_reprobe30_deeply_nested_json_does_not_crash_the_process(tmp_path):
    # pyarrow's JSON reader overflows its stack on it: a segmentation fault, no error to catch.
    import subprocess
    import sys

    path = tmp_path / "p.jsonl"
    path.write_text(_deep_json(100_000))
    code = (
        "import sys; from rlcore.data import read_table\ntry: read_table(sys.argv[1])\nexcept ValueError as e: print(e)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "nests lists and objects more than 100 deep" in done.stdout, done


def test_reprobe30_json_brackets_inside_strings_and_messages_are_no_nesting(tmp_path):
    messages = [{"role": "user", "content": "[[[{{{" * 50}]
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": ']]]}}}\\"[[[' * 50, "answer": "2", "m": messages}])
    assert load_prompts(path).reward_columns([0])["m"] == [messages]


def test_reprobe30_csv_rows_longer_than_the_header_are_refused(tmp_path):
    # pandas would make the extra fields the index, shifting the prompt column onto another field.
    path = _text(tmp_path / "p.csv", "prompt,answer\n1+1=,2,extra,more\n")
    with pytest.raises(ValueError, match=r"'.*p\.csv' is not a readable csv file: its rows hold more fields"):
        load_prompts(path)


def test_reprobe30_a_saved_dataset_whose_state_is_not_an_object_is_one_line(tmp_path, rows):
    path = _saved(tmp_path / "saved", rows, "state")
    (path / "state.json").write_text("[]")
    with pytest.raises(ValueError, match=r"reading the saved dataset '.*saved' failed with"):
        load_prompts(path)


def test_reprobe30_a_prompt_of_no_tokens_is_refused_naming_its_row(tmp_path, rows):
    # Left-padded to padding alone, it failed the rollout at step 0 with a raw reshape error.
    tok = tiny_tokenizer([r["prompt"] for r in rows], chat_template=None)
    path = _write_jsonl(tmp_path / "p.jsonl", [rows[0], {"prompt": "", "answer": "2"}])
    with pytest.raises(ValueError, match=r"prompt_key: row 1 of '.*p\.jsonl' holds '', which is no token"):
        load_prompts(path, tokenizer=tok)
    pairs = [
        {"prompt": rows[0]["prompt"], "chosen": "1", "rejected": "2"},
        {"prompt": "", "chosen": "1", "rejected": "2"},
    ]
    with pytest.raises(ValueError, match=r"prompt_key: row 1 of '.*pairs\.jsonl' holds '', which is no token"):
        load_preferences(_write_jsonl(tmp_path / "pairs.jsonl", pairs), tokenizer=tok)
