"""Write the demonstrations that ``configs/sft_tiny.yaml`` trains on.

The reversal task of the main job (``"abcd>"`` -> ``"dcba"``, letters a-f, 2 to 4 of
them) as an SFT dataset in TRL's prompt / completion layout (``prompt``, ``response``),
with a few rows in the conversational layout (``messages``) written to a second file
for the tests. The tokenizer is ``reversal_tokenizer`` (``make_reversal_prefs.py``),
whose ids are those of the built-in task, so the SFT export starts the main job's GRPO.
The output is deterministic; rerun it from the project root to regenerate::

    python configs/data/make_reversal_sft.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
LETTERS = "abcdef"
ROWS = 1024
SEED = 1


def rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4)))
        out.append({"prompt": word + ">", "response": word[::-1]})
    return out


def main() -> None:
    data = rows(ROWS, SEED)
    (HERE / "reversal_sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))


if __name__ == "__main__":
    main()
