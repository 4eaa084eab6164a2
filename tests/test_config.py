"""rlcore.train.config: the seed's schema, validation naming the key, overrides, launch checks."""

import shutil
from pathlib import Path

import pytest
import yaml

from rlcore.train import apply_overrides, check_launch, load_config, parse_config

INLINE = {
    "model_type": "qwen2",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 16,
}
ROOT = Path(__file__).resolve().parents[1]
# The seed document's example GRPO config (section 4.1), shipped verbatim.
SEED = ROOT / "configs" / "seed" / "qwen2_5_7b_grpo.yaml"


def _seed_text() -> str:
    return SEED.read_text()


@pytest.fixture
def tiny_model_dir(tmp_path):
    import transformers

    config = transformers.AutoConfig.for_model(**INLINE)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def _write(tmp_path, raw) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw) if not isinstance(raw, str) else raw)
    return path


def test_seed_example_loads_with_a_local_model(tmp_path, tiny_model_dir):
    text = _seed_text().replace("Qwen/Qwen2.5-7B-Instruct", str(tiny_model_dir))
    cfg = load_config(_write(tmp_path, text))
    assert cfg.model.model_name_or_path == str(tiny_model_dir)
    assert (cfg.model.torch_dtype, cfg.model.use_flash_attention) == ("bf16", True)
    assert (cfg.rl.algo, cfg.rl.batch_size, cfg.rl.mini_batch_size, cfg.rl.temperature, cfg.rl.beta) == (
        "grpo",
        8,
        2,
        0.8,
        0.05,
    )
    assert (cfg.parallel.data_parallel, cfg.deploy.mode, cfg.deploy.async_infer, cfg.rl.n_samples) == (
        8,
        "co-located",
        True,
        1,
    )
    # One sample per prompt leaves GRPO without a group baseline: refused at launch, not at load.
    with pytest.raises(ValueError, match=r"'rl.num_rollouts': got 1, expected >= 2 for grpo"):
        check_launch(cfg, 8)
    # Asynchronous rollout over 8 ranks keeps every collective in the update: the seed's co-located run launches
    # (each rank samples on its own snapshot), and so does each rank's rollout in its own worker (its four
    # updates per batch take the old-policy forward inside the update stage).
    check_launch(load_config(_write(tmp_path, text), ["rl.num_rollouts=2"]), 8)
    check_launch(load_config(_write(tmp_path, text), ["rl.num_rollouts=2", "deploy.mode=disaggregated"]), 8)
    with pytest.raises(ValueError, match=r"'deploy.async_infer': got true at world size 8 with rl.algo 'ppo'"):
        check_launch(load_config(_write(tmp_path, text), ["rl.num_rollouts=2", "rl.algo=ppo"]), 8)
    with pytest.raises(ValueError, match=r"'parallel.data_parallel': got 8, expected the launched world size 1"):
        check_launch(cfg, 1)


def test_seed_example_with_hub_name_is_refused():
    raw = yaml.safe_load(_seed_text())
    with pytest.raises(
        ValueError, match=r"'model.model_name_or_path': got 'Qwen/Qwen2.5-7B-Instruct', expected a local"
    ):
        parse_config(raw)


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        check_launch(cfg, cfg.parallel.data_parallel)


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"modle": {}},
            r"config key 'modle': unknown section, expected one of model, rl, parallel, deploy, data, trainer",
        ),
        ({"rl": {"bacth_size": 8}}, r"config key 'rl.bacth_size': unknown, expected one of algo, batch_size"),
        ({"rl": {"batch_size": "8"}}, r"config key 'rl.batch_size': got str '8', expected int"),
        ({"rl": {"batch_size": 8.0}}, r"config key 'rl.batch_size': got float 8.0, expected int"),
        ({"rl": {"batch_size": True}}, r"config key 'rl.batch_size': got bool True, expected int"),
        ({"rl": {"temperature": "hot"}}, r"config key 'rl.temperature': got str 'hot', expected float"),
        ({"rl": {"algo": "trpo"}}, r"config key 'rl.algo': got str 'trpo', expected one of 'grpo', 'dr_grpo'"),
        (
            {"deploy": {"mode": "remote"}},
            r"config key 'deploy.mode': got str 'remote', expected one of 'co-located', 'disaggregated'",
        ),
        ({"deploy": {"async_infer": "yes"}}, r"config key 'deploy.async_infer': got str 'yes', expected bool"),
        ({"model": {"torch_dtype": "fp8"}}, r"config key 'model.torch_dtype': got str 'fp8', expected one of 'fp32'"),
        (
            {"model": {"model_name_or_path": 3}},
            r"config key 'model.model_name_or_path': got int 3, expected str or dict",
        ),
        ({"model": {"model_name_or_path": {"hidden_size": 8}}}, r"an inline config needs a 'model_type'"),
        ({"rl": []}, r"config key 'rl': got list, expected a mapping"),
        ({"rl": {"batch_size": 0}}, r"config key 'rl.batch_size': got 0, expected > 0"),
        ({"rl": {"lr": -1.0}}, r"config key 'rl.lr': got -1.0, expected > 0"),
        ({"rl": {"temperature": -0.5}}, r"config key 'rl.temperature': got -0.5, expected >= 0"),
        ({"rl": {"top_p": 1.5}}, r"config key 'rl.top_p': got 1.5, expected a value in \(0, 1\]"),
        (
            {"rl": {"batch_size": 8, "mini_batch_size": 3}},
            r"'rl.mini_batch_size': got 3, expected a divisor of rl.batch_size=8",
        ),
        ({"rl": {"algo": "dpo", "num_rollouts": 4}}, r"'rl.num_rollouts': got 4, expected 1 for dpo"),
        ({"rl": {"algo": "dpo", "num_rollouts": 1, "beta": 0.0}}, r"'rl.beta': got 0.0, expected > 0"),
        ({"parallel": {"tensor_parallel": 0}}, r"'parallel.tensor_parallel': got 0, expected > 0"),
        ({"trainer": {"steps": -1}}, r"'trainer.steps': got -1, expected >= 0"),
        ([1, 2], r"config: got list, expected a mapping of sections"),
    ],
)
def test_every_error_names_the_key(raw, message):
    if isinstance(raw, dict):
        raw = {"model": {"model_name_or_path": INLINE}, **raw} if "model" not in raw else raw
    with pytest.raises(ValueError, match=message):
        parse_config(raw)


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("parallel", "tensor_parallel", 2, r"'parallel.data_parallel' \(1\) x 'parallel.tensor_parallel' \(2\) = 2"),
        ("parallel", "pipeline_parallel", 2, r"'parallel.pipeline_parallel': got 2, expected 1 \(supported:"),
        ("deploy", "backend", "ray", r"'deploy.backend': got 'ray' with deploy.mode 'co-located', expected 'local'"),
    ],
)
def test_launch_refuses_what_the_reference_trainer_cannot_run(section, key, value, message):
    cfg = parse_config({"model": {"model_name_or_path": INLINE}, section: {key: value}})
    with pytest.raises(ValueError, match=message):
        check_launch(cfg, 1)


def test_launch_accepts_the_ray_backend_for_a_disaggregated_rollout():
    cfg = parse_config({"model": {"model_name_or_path": INLINE}, "deploy": {"mode": "disaggregated", "backend": "ray"}})
    check_launch(cfg, 1)


def test_launch_accepts_data_times_tensor_parallel_equal_to_the_world_size():
    cfg = parse_config(
        {"model": {"model_name_or_path": INLINE}, "parallel": {"data_parallel": 2, "tensor_parallel": 2}}
    )
    check_launch(cfg, 4)
    with pytest.raises(ValueError, match=r"= 4, expected the launched world size 2"):
        check_launch(cfg, 2)


def test_overrides_parse_values_as_yaml_and_validate(tmp_path):
    path = _write(tmp_path, {"model": {"model_name_or_path": INLINE}, "rl": {"temperature": 1.0}})
    cfg = load_config(path, ["rl.temperature=0.7", "rl.top_k=5", "deploy.async_infer=true", "trainer.output_dir=out/x"])
    assert (cfg.rl.temperature, cfg.rl.top_k, cfg.deploy.async_infer, cfg.trainer.output_dir) == (0.7, 5, True, "out/x")
    assert load_config(path, ["rl.lr=1e-4"]).rl.lr == 1e-4  # YAML 1.1 reads 1e-4 as a string
    assert load_config(path, ["model.model_name_or_path.hidden_size=32"]).model.model_name_or_path["hidden_size"] == 32
    with pytest.raises(ValueError, match=r"config key 'rl.temprature': unknown"):
        load_config(path, ["rl.temprature=0.7"])
    with pytest.raises(ValueError, match=r"config key 'rl.batch_size': got str 'many', expected int"):
        load_config(path, ["rl.batch_size=many"])
    for bad in ("temperature=0.7", "rl.temperature", ".x=1"):
        with pytest.raises(ValueError, match="expected section.key=value"):
            apply_overrides({}, [bad])
    with pytest.raises(ValueError, match=r"'rl' is not a section"):
        apply_overrides({"rl": 3}, ["rl.temperature=1"])


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ValueError, match=r"config: cannot read '.*missing.yaml'"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_config(_write(tmp_path, "rl: [unclosed"))


def test_local_directory_model_path_and_copy(tmp_path, tiny_model_dir):
    moved = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    cfg = parse_config({"model": {"model_name_or_path": str(moved)}})
    assert cfg.model.model_name_or_path == str(moved)


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"model": {"model_name_or_path": {**INLINE, "num_attention_heads": 3}}},
            r"config key 'model.model_name_or_path': num_attention_heads=3 does not divide hidden_size=16$",
        ),
        (
            {"model": {"model_name_or_path": {**INLINE, "num_attention_heads": 4, "num_key_value_heads": 3}}},
            r"config key 'model.model_name_or_path': num_key_value_heads=3 does not divide num_attention_heads=4$",
        ),
        (
            {"model": {"model_name_or_path": {"model_type": "no_such_model"}}},
            r"config key 'model.model_name_or_path': not a valid model config \(.*no_such_model",
        ),
        (
            {"rl": {"temperature": float("inf")}},
            r"config key 'rl.temperature': got float inf, expected float \(finite\)",
        ),
        (
            {"rl": {"temperature": float("nan")}},
            r"config key 'rl.temperature': got float nan, expected float \(finite\)",
        ),
        ({"rl": {"lr": float("nan")}}, r"config key 'rl.lr': got float nan, expected float \(finite\)"),
        (
            {
                "model": {"model_name_or_path": {**INLINE, "max_position_embeddings": 32}},
                "data": {"task": "reversal", "length": 6},
                "rl": {"max_new_tokens": 26},
            },
            r"config key 'rl.max_new_tokens': got 26; prompts of up to 7 tokens \(data.task='reversal'\) then need "
            r"33 positions, more than the model's max_position_embeddings=32$",
        ),
        ({"trainer": {"reward_timeout": 0}}, r"config key 'trainer.reward_timeout': got 0.0, expected > 0"),
        (
            {"trainer": {"reward_timeout": float("inf")}},
            r"config key 'trainer.reward_timeout': got float inf, expected float \(finite\) or null",
        ),
    ],
)
def test_config_gaps_are_one_line_errors_before_any_work(raw, message):
    # Issue 18, defect 14: these configs got past validation and failed (or ran wrong) later.
    raw = {"model": {"model_name_or_path": INLINE}, **raw} if "model" not in raw else raw
    with pytest.raises(ValueError, match=message) as err:
        parse_config(raw)
    assert "\n" not in str(err.value)


def test_config_gaps_in_yaml_text_top_level_list_and_inf(tmp_path):
    # Issue 18, defect 14: a top-level YAML list was an AttributeError traceback; `.inf` was accepted.
    with pytest.raises(ValueError, match=r"config: '.*c.yaml' holds a list at the top level, expected a mapping"):
        load_config(_write(tmp_path, "- model\n- rl\n"), ["rl.temperature=1.0"])
    with pytest.raises(ValueError, match=r"config: '.*c.yaml' holds a str at the top level"):
        load_config(_write(tmp_path, "just text\n"))
    with pytest.raises(ValueError, match=r"config: got list, expected a mapping of sections"):
        apply_overrides([1], ["rl.temperature=1.0"])  # type: ignore[arg-type]
    path = _write(tmp_path, {"model": {"model_name_or_path": INLINE}})
    with pytest.raises(ValueError, match=r"config key 'rl.temperature': got float inf, expected float \(finite\)"):
        load_config(path, ["rl.temperature=.inf"])
    assert load_config(path, ["trainer.reward_timeout=null"]).trainer.reward_timeout is None
    assert load_config(path, ["trainer.reward_timeout=5"]).trainer.reward_timeout == 5.0
    assert load_config(path).trainer.reward_timeout == 300.0


def test_num_rollouts_is_n_samples_and_to_dict_round_trips():
    cfg = parse_config({"model": {"model_name_or_path": {"model_type": "qwen2"}}, "rl": {"num_rollouts": 3}})
    assert cfg.rl.n_samples == 3
    raw = cfg.to_dict()
    assert raw["rl"]["num_rollouts"] == 3 and "n_samples" not in raw["rl"]
    assert parse_config(raw) == cfg
    with pytest.raises(ValueError, match=r"config key 'rl.n_samples': unknown"):
        parse_config({"rl": {"n_samples": 3}})


def test_context_parallel_keys_load_and_cp_counts_in_the_world_size():
    raw = {"model": {"model_name_or_path": {"model_type": "qwen2"}}}
    cfg = parse_config({**raw, "parallel": {"context_parallel": 1, "cp_mode": "ulysses"}})
    assert (cfg.parallel.context_parallel, cfg.parallel.cp_mode) == (1, "ulysses")
    check_launch(cfg, 1)
    with pytest.raises(ValueError, match=r"'parallel.cp_mode': got str 'zigzag', expected one of 'ring', 'ulysses'"):
        parse_config({**raw, "parallel": {"cp_mode": "zigzag"}})
    with pytest.raises(ValueError, match=r"'parallel.context_parallel': got 0, expected > 0"):
        parse_config({**raw, "parallel": {"context_parallel": 0}})
    two = parse_config({**raw, "parallel": {"context_parallel": 2}})
    check_launch(two, 2)
    with pytest.raises(
        ValueError,
        match=r"'parallel.data_parallel' \(1\) x 'parallel.context_parallel' \(2\) = 2, expected the launched",
    ):
        check_launch(two, 1)


# Re-probe of issue 18 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_size": 0}, r"hidden_size: got 0, expected a positive int"),
        ({"intermediate_size": -4}, r"intermediate_size: got -4, expected a positive int"),
        ({"num_attention_heads": 0}, r"num_attention_heads: got 0, expected a positive int"),
        ({"vocab_size": 0}, r"vocab_size: got 0, expected a positive int"),
        ({"hidden_size": 30}, r"head dimension 15 .* expected an even head dimension"),
    ],
)
def test_reprobe_inline_model_sizes_are_checked_before_any_work(fields, message):
    # hidden_size 0 was a ZeroDivisionError traceback, intermediate_size -4 torch's
    # "negative dimension", an odd head dimension a rotary-embedding size error mid-rollout.
    with pytest.raises(ValueError, match=r"config key 'model.model_name_or_path': " + message) as err:
        parse_config({"model": {"model_name_or_path": {**INLINE, **fields}}})
    assert "\n" not in str(err.value)


def test_reprobe_override_that_is_not_yaml_names_the_override():
    # A yaml.ParserError traceback.
    with pytest.raises(ValueError, match=r"override 'rl.lr=\[1,': the value is not valid YAML"):
        apply_overrides({}, ["rl.lr=[1,"])


def test_reprobe_duplicate_keys_in_a_config_file_are_refused(tmp_path):
    # PyYAML keeps the last of two equal keys: `algo: grpo` then `algo: ppo` silently ran PPO.
    text = "model:\n  model_name_or_path: {model_type: qwen2}\nrl:\n  algo: grpo\n  algo: ppo\n"
    with pytest.raises(ValueError, match=r"config: '.*c.yaml' is not valid YAML: .*duplicate key 'algo'"):
        load_config(_write(tmp_path, text))


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_reprobe_seed_out_of_range_names_the_key(seed):
    with pytest.raises(ValueError, match=r"config key 'trainer.seed': got"):
        parse_config({"model": {"model_name_or_path": INLINE}, "trainer": {"seed": seed}})


def test_reprobe_output_dir_that_cannot_be_a_directory_names_the_key(tmp_path):
    # A file there (or above) gave FileExistsError / NotADirectoryError tracebacks; "" wrote the run into the cwd.
    (tmp_path / "f").write_text("x")
    for out in ("", str(tmp_path / "f"), str(tmp_path / "f" / "run")):
        with pytest.raises(ValueError, match=r"config key 'trainer.output_dir': got"):
            parse_config({"model": {"model_name_or_path": INLINE}, "trainer": {"output_dir": out}})
    assert parse_config({"model": {"model_name_or_path": INLINE}, "trainer": {"output_dir": str(tmp_path / "new")}})


@pytest.mark.parametrize("key", ["path", "val_path"])
def test_reprobe_empty_dataset_path_names_the_key(key):
    # `--dataset ""` said the run needed a model directory with a tokenizer.
    with pytest.raises(ValueError, match=rf"^config key 'data.{key}': got '', expected a dataset path or null$"):
        parse_config({"model": {"model_name_or_path": INLINE}, "data": {key: ""}})


@pytest.mark.parametrize(
    "data, algo, message",
    [
        ({"tokenizer": "tok"}, "grpo", r"'data.tokenizer': got '.*tok' with data.path null, expected null"),
        ({"tokenizer": " "}, "grpo", r"'data.tokenizer': got ' ', expected a tokenizer directory or null"),
        ({"task": "addition", "digits": 0}, "grpo", r"'data.digits': got 0, expected >= 1"),
        ({"task": "reversal", "min_length": 5}, "grpo", r"'data.min_length': got 5 with data.length 4, expected 1 <="),
        ({"task": "reversal", "min_length": 0}, "grpo", r"'data.min_length': got 0 with data.length 4"),
        ({"task": "reversal", "letters": ""}, "grpo", r"'data.letters': got '', expected distinct characters"),
        ({"task": "reversal", "letters": "aba"}, "grpo", r"'data.letters': got 'aba', expected distinct"),
        (
            {"task": "reversal", "letters": "ab>"},
            "grpo",
            r"'data.letters': got 'ab>', expected distinct characters other",
        ),
        ({"val_path": "v.jsonl"}, "grpo", r"'data.val_path': got '.*v.jsonl' with data.path null, expected null"),
        ({"max_prompt_length": 8}, "grpo", r"'data.max_prompt_length': got 8 with data.path null, expected null"),
        ({"max_response_length": 8}, "dpo", r"'data.max_response_length': got 8 with data.path null"),
        ({"system_prompt": "Be brief."}, "grpo", r"'data.system_prompt': got 'Be brief.' with data.path null"),
        (
            {"path": "p.jsonl", "chosen_key": "a", "rejected_key": "a"},
            "dpo",
            r"'data.rejected_key': got 'a', the same column as data.chosen_key",
        ),
        ({"path": "p.jsonl", "chosen_key": "prompt"}, "dpo", r"'data.chosen_key': got 'prompt', the same column as"),
    ],
)
def test_reprobe30_contradicting_data_keys_are_refused(tmp_path, data, algo, message):
    raw = {"model": {"model_name_or_path": INLINE}, "rl": {"algo": algo, "num_rollouts": 1}, "data": data}
    with pytest.raises(ValueError, match=message):
        load_config(_write(tmp_path, raw))


def test_reprobe30_data_paths_in_a_config_file_are_relative_to_it_and_overrides_to_the_working_directory(
    tmp_path, monkeypatch
):
    (tmp_path / "conf").mkdir()
    raw = {"model": {"model_name_or_path": INLINE}, "data": {"path": "d/p.jsonl", "val_path": "/abs/v.jsonl"}}
    raw["data"]["tokenizer"] = "tok"
    path = tmp_path / "conf" / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path)
    conf = tmp_path / "conf"
    assert (cfg.data.path, cfg.data.val_path, cfg.data.tokenizer) == (
        str(conf / "d/p.jsonl"),
        "/abs/v.jsonl",
        str(conf / "tok"),
    )
    cfg = load_config(path, ["data.path=mine.jsonl"])  # --dataset: the working directory's
    assert cfg.data.path == "mine.jsonl" and cfg.data.tokenizer == str(conf / "tok")


@pytest.mark.parametrize(
    "algo, key, value", [("grpo", "rl.max_new_tokens", 40), ("dpo", "data.max_response_length", 40)]
)
def test_reprobe30_the_position_limit_is_checked_with_a_dataset(tiny_model_dir, algo, key, value):
    # prompts of up to 30 tokens and 40 more need 70 positions; the model has INLINE's default, 32768 -> set 64.
    raw = {
        "model": {"model_name_or_path": {**INLINE, "max_position_embeddings": 64}},
        "rl": {"algo": algo, "num_rollouts": 1 if algo == "dpo" else 2},
        "data": {"path": "p.jsonl", "max_prompt_length": 30},
    }
    section, name = key.split(".")
    raw[section][name] = value
    with pytest.raises(
        ValueError,
        match=rf"config key '{key}': got 40; prompts of up to data.max_prompt_length=30 tokens then need 70 positions, more than the model's max_position_embeddings=64",
    ):
        parse_config(raw)
    raw[section][name] = 34
    assert parse_config(raw).data.max_prompt_length == 30


def test_reprobe30_yaml_merge_keys_load_and_the_keys_beside_them_override(tmp_path):
    # The duplicate-key loader built the '<<' key as a value: "could not determine a constructor for the tag merge".
    text = (
        "model:\n  model_name_or_path: {model_type: qwen2}\n"
        "rl:\n  <<: &base {lr: 0.001, epochs: 2}\n  lr: 0.002\n"
        "trainer:\n  <<: {steps: 7, seed: 3}\n"
    )
    cfg = load_config(_write(tmp_path, text))
    assert (cfg.rl.lr, cfg.rl.epochs, cfg.trainer.steps, cfg.trainer.seed) == (0.002, 2, 7, 3)
    with pytest.raises(ValueError, match=r"duplicate key 'lr'"):
        load_config(_write(tmp_path, text.replace("  lr: 0.002\n", "  lr: 0.002\n  lr: 0.003\n")))


def test_reprobe30_a_config_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    # The bare UnicodeDecodeError reached the user without the file's name.
    path = tmp_path / "c.yaml"
    path.write_bytes(b"model:\n  model_name_or_path: {model_type: qwen2}\n# caf\xe9\n")
    with pytest.raises(ValueError, match=r"config: '.*c\.yaml' is not UTF-8 text \(byte \d+: invalid continuation"):
        load_config(path)


@pytest.mark.parametrize(
    "text", ["rl:\n  algo: [grpo\n", "rl: {}\n---\nrl: {}\n", "rl:\n  algo: !!python/name:os.system\n"]
)
def test_reprobe30_yaml_errors_are_one_line(tmp_path, text):
    with pytest.raises(ValueError, match=r"config: '.*c\.yaml' is not valid YAML: .*line \d") as info:
        load_config(_write(tmp_path, text))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "key, value, pattern",
    [("rope_scaling", {"type": "nope"}, r"KeyError: 'nope'"), ("hidden_act", "nope", r"KeyError")],
)
def test_reprobe30_an_inline_model_that_transformers_cannot_build_names_the_key(tmp_path, key, value, pattern):
    # Accepted by the config, then a raw KeyError traceback when the trainer built the model.
    spec = {"model_type": "qwen2", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, key: value}
    with pytest.raises(ValueError, match=rf"'model.model_name_or_path': the inline config builds no model \({pattern}"):
        parse_config({"model": {"model_name_or_path": spec}, "trainer": {"output_dir": str(tmp_path)}})


def test_reprobe30_an_impossible_thread_count_names_the_key(tmp_path):
    # torch.set_num_threads(10**12) failed at the run's start with "Overflow when unpacking long", naming nothing.
    raw = {"model": {"model_name_or_path": {"model_type": "qwen2"}}, "trainer": {"output_dir": str(tmp_path)}}
    with pytest.raises(ValueError, match=r"config key 'trainer.threads': got 1000000000000, expected at most \d+"):
        parse_config({**raw, "trainer": {**raw["trainer"], "threads": 10**12}})
    assert parse_config({**raw, "trainer": {**raw["trainer"], "threads": 8}}).trainer.threads == 8
