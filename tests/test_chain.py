"""``model.init_from``: a config trained first, once, into the run's folder; its export is the model the run starts from.

The shipped reward model (configs/rm_tiny.yaml) starts from the SFT config's model this way. The chained config is
trained once (a repeated run reuses it), must build the run's own model, is refused under torchrun, and a bad value
or a config that cannot load is named by its key before anything is trained."""

from pathlib import Path

import pytest
import yaml

from rlcore.models import load_causal_lm
from rlcore.train import load_config, train

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "configs" / "data"
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1}  # fmt: skip
QUICK = {"progress": False, "plot": False, "threads": 1}


def _write(path: Path, shipped: str, init_from: str | None = None, **model) -> Path:
    """The shipped config ``shipped`` shrunk to a smaller model and two steps, its data paths absolute."""
    raw = yaml.safe_load((ROOT / "configs" / shipped).read_text())
    raw["model"]["model_name_or_path"].update(SMALL, **model)
    raw["model"]["init_from"] = init_from
    raw["rl"].update(batch_size=8, mini_batch_size=8)
    raw["data"].update(path=str(DATA / Path(raw["data"]["path"]).name), tokenizer=str(DATA / "reversal_tokenizer"))
    raw["trainer"].update(steps=2, save_every=2, output_dir=str(path.parent / "unused"), **QUICK)
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_shipped_reward_model_starts_from_the_sft_config_named_relative_to_itself():
    cfg = load_config(ROOT / "configs" / "rm_tiny.yaml")
    assert cfg.model.init_from == str(ROOT / "configs" / "sft_tiny.yaml")
    sft = load_config(cfg.model.init_from)
    assert sft.model.model_name_or_path == cfg.model.model_name_or_path  # the same model: the export replaces it


def test_an_init_config_is_trained_once_and_the_run_starts_from_its_export(tmp_path, monkeypatch):
    sft = _write(tmp_path / "sft.yaml", "sft_tiny.yaml")
    rm = _write(tmp_path / "rm.yaml", "rm_tiny.yaml", init_from="sft.yaml")  # relative to rm.yaml
    out = tmp_path / "run"
    cfg = load_config(rm, [f"trainer.output_dir={out}"])
    assert cfg.model.init_from == str(sft)

    with monkeypatch.context() as m:  # under torchrun every rank would train it: refused, nothing made
        m.setenv("WORLD_SIZE", "2")
        with pytest.raises(ValueError, match=r"'model.init_from': got the config .*sft.yaml' under torchrun"):
            train(cfg)
    made = out / "init_from" / "hf"
    assert not made.exists()

    run = train(cfg)
    assert (made / "config.json").is_file() and len(run.records) == 2
    # The reward model's body is the export's after two AdamW steps of lr 1e-3 (each moves a weight by about lr):
    # far closer to it than to another initialisation.
    exported = load_causal_lm(made, dtype="fp32").model.embed_tokens.weight
    body = run.critic.model.embed_tokens.weight.detach()
    assert (body - exported).abs().max() < 5e-3 < (exported - exported.roll(1, 0)).abs().max()

    stamp = (made / "config.json").stat().st_mtime_ns
    train(cfg, overwrite=True)
    assert (made / "config.json").stat().st_mtime_ns == stamp  # reused, not trained again


def test_an_init_config_that_builds_another_model_is_refused_before_anything_is_trained(tmp_path):
    _write(tmp_path / "sft.yaml", "sft_tiny.yaml", hidden_size=16)
    rm = _write(tmp_path / "rm.yaml", "rm_tiny.yaml", init_from="sft.yaml")
    cfg = load_config(rm, [f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"'model.init_from': the config .*sft.yaml' builds .*'hidden_size': 16"):
        train(cfg)
    assert not (tmp_path / "run" / "init_from").exists()


def test_a_bad_init_from_is_named(tmp_path):
    rm = ROOT / "configs" / "rm_tiny.yaml"
    for value in (str(tmp_path), "sft.json"):
        with pytest.raises(ValueError, match=r"config key 'model.init_from': got .*expected null or a YAML config"):
            load_config(rm, [f"model.init_from={value}"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl: {bacth_size: 2}\n")
    cfg = load_config(rm, [f"model.init_from={bad}", f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"'model.init_from': the config .*bad.yaml'.*bacth_size"):
        train(cfg)
    with pytest.raises(ValueError, match=r"'model.init_from': the config .*missing.yaml'.*cannot read"):
        train(load_config(rm, [f"model.init_from={tmp_path / 'missing.yaml'}"]))
