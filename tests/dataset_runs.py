"""A tiny trainer run on a prompt dataset (the shipped reversal prompts), shared by the dataset-run tests."""

from __future__ import annotations

import json
from pathlib import Path

from rlcore.train import apply_overrides, parse_config
from rlcore.train.config import Config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY_QWEN2 = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}  # fmt: skip


def reversal_run(tmp_path: Path, out: Path, steps: int, overrides: list[str]) -> Config:
    """A run of ``steps`` steps into ``out`` on 12 reversal prompts (their chosen answers as the reference answers),
    2 prompts x 2 samples of 3 tokens a step, no warm-up, quiet; ``overrides`` on top."""
    rows = [json.loads(line) for line in (CONFIGS / "data" / "reversal_prefs.jsonl").read_text().splitlines()[:12]]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["chosen"]}) + "\n" for r in rows))
    raw = apply_overrides(
        {"model": {"model_name_or_path": TINY_QWEN2}, "rewards": ["answer_match"]},
        [
            f"data.path={data}",
            f"data.tokenizer={CONFIGS / 'data' / 'reversal_tokenizer'}",
            "data.apply_chat_template=false",
            f"trainer.output_dir={out}",
            "rl.batch_size=2",
            "rl.mini_batch_size=2",
            "rl.num_rollouts=2",
            "rl.max_new_tokens=3",
            f"trainer.steps={steps}",
            "trainer.warmup_steps=0",
            "trainer.reward_workers=0",
            "trainer.threads=1",
            "trainer.progress=false",
            "trainer.plot=false",
            "trainer.export=false",
            *overrides,
        ],
    )
    return parse_config(raw)
