"""Command line: ``rlcore train --config FILE [--dataset PATH] [--output_dir DIR] [--resume] [key=value ...]``
(also ``python -m rlcore.train``) and ``rlcore export CHECKPOINT OUT_DIR``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator, Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlcore", description="rlcore reference trainer")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train with a YAML config (torchrun for data parallelism)")
    train.add_argument("--config", required=True, help="YAML file: model / rl / parallel / deploy / data / trainer")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the DCP checkpoint in trainer.output_dir/checkpoint/ (any world size)",
    )
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. rl.temperature=0.7")
    train.add_argument("--dataset", help="prompt dataset (JSONL, Parquet, save_to_disk directory): data.path")
    train.add_argument("--output_dir", "--output-dir", dest="output_dir", help="run directory: trainer.output_dir")
    train.add_argument("--overwrite", action="store_true", help="replace a run already in the output directory")
    train.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume with hyper-parameters that differ from the checkpoint's",
    )
    export = commands.add_parser("export", help="write a training checkpoint as a Hugging Face directory")
    export.add_argument("checkpoint", help="a run's output directory (or its checkpoint folder)")
    export.add_argument("out_dir", help="the directory to write (save_pretrained)")
    return parser


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM (kill, a scheduler, torchrun tearing down) unwinds like Ctrl-C, so the
    # reward workers are shut down and no checkpoint is left half-written.
    raise KeyboardInterrupt


@contextlib.contextmanager
def _library_bars_off() -> Iterator[None]:
    """Transformers' and datasets' own progress bars off for the run ("Writing model shards" at every save,
    "Generating train split" at load would cut into the training bar); their warnings stay on."""
    switches = []
    for name in ("transformers.utils.logging", "datasets.utils.logging"):
        try:
            module = __import__(name, fromlist=["is_progress_bar_enabled"])
        except ImportError:  # the optional dependency is not installed: nothing of it to silence
            continue
        switches.append((module, module.is_progress_bar_enabled()))
        module.disable_progress_bar()
    try:
        yield
    finally:
        for module, enabled in switches:
            if enabled:
                module.enable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlcore`` script; returns the exit status.

    Config errors, a missing optional dependency and a stopped run (a non-finite loss)
    print one line naming the cause and exit with status 2 and 3; a rollout worker that
    dies (its process killed) prints one line naming it and exits with status 1, the
    workers stopped and the last checkpoint kept. A signal of
    ``trainer.stop_signals`` (default SIGTERM) stops the run at the end of the current
    step with a checkpoint there and exits with status 75
    (:data:`rlcore.train.preemption.EXIT_PREEMPTED`; ``--resume`` continues). Ctrl-C (and
    SIGTERM when not a stop signal) exits with 130, leaving the last committed checkpoint
    loadable.
    """
    parser = _parser()
    # Options may follow the overrides (``... rl.lr=1e-4 --resume trainer.steps=9``): argparse
    # stops the positional list at the first option, so the rest are gathered here.
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "export":
        return _export(args.checkpoint, args.out_dir)
    # The seed's flags are overrides too (JSON strings are YAML: any path stays a string).
    flags = [("data.path", args.dataset), ("trainer.output_dir", args.output_dir)]
    args.overrides = [*args.overrides, *rest, *(f"{key}={json.dumps(v)}" for key, v in flags if v is not None)]
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _train(args)
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _train(args: argparse.Namespace) -> int:
    from rlcore.dataflow import WorkerDied
    from rlcore.train.config import load_config
    from rlcore.train.metrics import headline
    from rlcore.train.preemption import EXIT_PREEMPTED, Preempted
    from rlcore.train.trainer import train

    try:
        cfg = load_config(args.config, args.overrides)
        with _library_bars_off():
            records = train(
                cfg, resume=args.resume, overwrite=args.overwrite, allow_config_change=args.allow_config_change
            ).records
    except ValueError as err:
        print(f"rlcore: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the run directory: unwritable, a full disk, a file in the way
        print(f"rlcore: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # an optional dependency the config needs (deploy.engine vllm: vLLM)
        print(f"rlcore: error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:
        print(f"rlcore: stopped: {err}", file=sys.stderr)
        return 3
    except WorkerDied as err:  # the rollout worker (its engine) was killed: the run stops, its checkpoints stay
        print(
            f"rlcore: stopped: {err}; the last checkpoint in {cfg.trainer.output_dir} is kept (--resume continues)",
            file=sys.stderr,
        )
        return 1
    except Preempted as err:
        print(f"rlcore: {err}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("rlcore: interrupted; the last checkpoint is intact", file=sys.stderr)
        return 130
    if records and cfg.trainer.progress and os.environ.get("RANK", "0") == "0":
        print(
            f"done: step {records[-1]['step']}; {headline(records)}; "
            f"metrics, curves.png, timeline.png and checkpoint in {cfg.trainer.output_dir}"
        )
    return 0


def _export(checkpoint: str, out_dir: str) -> int:
    from rlcore.train.export_cli import export_checkpoint

    try:
        with _library_bars_off():  # transformers' "Writing model shards" bar says nothing of a one-file export
            out = export_checkpoint(checkpoint, out_dir)
    except (ValueError, OSError) as err:
        print(f"rlcore: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint} to {out}")
    return 0
