"""``python -m rlcore.train --config FILE [--resume] [key=value ...]`` (the form torchrun launches)."""

import sys

from rlcore.train.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
