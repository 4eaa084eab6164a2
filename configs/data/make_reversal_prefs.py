"""Write the preference pairs and the tokenizer that ``configs/dpo_offline_tiny.yaml`` trains on.

The reversal task of the main job (``"abcd>"`` -> ``"dcba"``, letters a-f, 2 to 4 of
them) as a preference dataset in TRL's layout: the chosen response is the correct
reversal, the rejected one a perturbed reversal (two neighbouring letters swapped, or
one letter changed). The tokenizer is character-level, built with the ``tokenizers``
library: one token per letter and ``>``, an EOS and a padding token, no chat template.
A held-out set of pairs whose prompts the training pairs never show
(``reversal_prefs_heldout.jsonl``) measures a reward model trained on them
(``configs/rm_tiny.yaml``). The output is deterministic; rerun it from the project root to regenerate::

    python configs/data/make_reversal_prefs.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
LETTERS = "abcdef"
PAIRS = 512
SEED = 0
HELDOUT = 256
HELDOUT_SEED = 1


def perturbed(answer: str, rng: random.Random) -> str:
    """A wrong reversal: two neighbouring letters swapped when they differ, else one letter changed."""
    i = rng.randrange(len(answer) - 1)
    if answer[i] != answer[i + 1] and rng.random() < 0.5:
        return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
    j = rng.randrange(len(answer))
    return answer[:j] + rng.choice([c for c in LETTERS if c != answer[j]]) + answer[j + 1 :]


def pairs(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4)))
        answer = word[::-1]
        rows.append({"prompt": word + ">", "chosen": answer, "rejected": perturbed(answer, rng)})
    return rows


def save_tokenizer(folder: Path) -> None:
    """A character-level tokenizer (BPE without merges over the task's characters), saved for ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models

    specials = ["<pad>", "<eos>"]
    vocab = {token: i for i, token in enumerate([*specials, *LETTERS, ">"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "model_max_length": 64,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    rows = pairs(PAIRS, SEED)
    (HERE / "reversal_prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = {r["prompt"] for r in rows}
    heldout = [r for r in pairs(4 * HELDOUT, HELDOUT_SEED) if r["prompt"] not in seen][:HELDOUT]
    (HERE / "reversal_prefs_heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout))
    save_tokenizer(HERE / "reversal_tokenizer")


if __name__ == "__main__":
    main()
