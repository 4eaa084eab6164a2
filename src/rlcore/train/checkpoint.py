"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): atomic, and loadable at another world size.

A checkpoint is a directory ``output_dir/checkpoint/`` holding numbered versions and a
``latest`` file naming the committed one. :func:`save_checkpoint` writes a new version
(DCP shards of the modules and their optimisers, one small file of plain data per rank,
a manifest), and only then replaces ``latest`` atomically (``os.replace``) and removes
the previous version, so a save killed at any point (Ctrl-C, ``kill -9``, a crash)
leaves the last checkpoint loadable. Modules and optimisers go through
``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` / ``set_state_dict``):
FSDP2 and tensor-parallel shards are saved by their owners and resharded on load, so a
run saved on 2 ranks resumes on 1 and the other way round. Without a process group
everything runs in the one process.

A damaged or incompatible checkpoint (empty, truncated or foreign files, missing
entries, another model size, another algorithm's entries) raises
:class:`CheckpointError`, a ``ValueError`` of one line naming the file and the problem.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rlcore.device import device_kind

__all__ = [
    "CHECKPOINT_NAME",
    "CheckpointError",
    "PendingSave",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "save_checkpoint_async",
    "set_rng_state",
]

CHECKPOINT_NAME = "checkpoint"
_FORMAT = "rlcore-checkpoint"
_VERSION = 2  # 2: the manifest records every file's size and sha256; 1 (no digests) is still read
_READS = (1, 2)
_LATEST = "latest"
_MANIFEST = "manifest.json"
_LOCK = ".lock"
# Version folders: ``step000400`` (the steps the checkpoint holds; ``step000400_1`` for a second
# save of the same step), or ``v000001`` (numbered by save: unnamed saves, and older checkpoints).
_VERSION_NAME = re.compile(r"(?:v(\d{6})|step(\d{6,})(?:_(\d+))?)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message is one line naming the file and the problem."""


def _fail(path: Path | str, problem: str) -> CheckpointError:
    first = " ".join(str(problem).split())  # one line, whatever the cause printed
    return CheckpointError(f"checkpoint {str(path)!r}: {first}")


# --- what a state holds ---------------------------------------------------------


def _kind(name: str, value: Any) -> str:
    """``"module"``, ``"trainable"`` (a module with its optimisers) or ``"data"``."""
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], nn.Module):
        if not _optimizers(value[1]):
            raise ValueError(
                f"state[{name!r}]: got (module, {type(value[1]).__name__}), expected (module, an optimizer "
                "or a sequence of optimizers)"
            )
        return "trainable"
    return "data"


def _optimizers(value: Any) -> list[torch.optim.Optimizer]:
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, Sequence) and value and all(isinstance(o, torch.optim.Optimizer) for o in value):
        return list(value)
    return []


def _tensor_state(kind: str, value: Any) -> dict[str, Any]:
    if kind == "module":
        return get_model_state_dict(value)
    model_sd, optim_sd = get_state_dict(value[0], _optimizers(value[1]))
    return {"model": model_sd, "optim": optim_sd}


def _collective(kinds: Mapping[str, str]) -> bool:
    return any(k != "data" for k in kinds.values()) and dist.is_available() and dist.is_initialized()


# --- files ------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write(path: Path, write: Any) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _version(name: str) -> int | None:
    """The save number of a ``v000001`` folder, ``0`` for a ``step...`` folder, ``None`` for anything else."""
    m = _VERSION_NAME.fullmatch(name)
    if m is None:
        return None
    return int(m.group(1)) if m.group(1) is not None else 0


def _order(name: str) -> tuple[int, int, int]:
    """Sort key of version folders: ``v`` ones by save number, then ``step`` ones by step and repeat."""
    m = _VERSION_NAME.fullmatch(name)
    assert m is not None
    if m.group(1) is not None:
        return (0, int(m.group(1)), 0)
    return (1, int(m.group(2)), int(m.group(3) or 0))


def _new_name(root: Path, step: int | None, previous: str | None) -> str:
    """The folder of the next version: by step when given, else by save; never the committed one's."""
    if step is None:
        numbers = [int(m.group(1)) for p in root.iterdir() if (m := _VERSION_NAME.fullmatch(p.name)) and m.group(1)]
        return f"v{max(numbers, default=0) + 1:06d}"
    name, k = f"step{step:06d}", 0
    while name == previous:  # the same step saved again: its committed folder stays until the commit
        k += 1
        name = f"step{step:06d}_{k}"
    return name


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _file_digests(path: Path) -> dict[str, dict[str, Any]]:
    """Every file of a version (the manifest aside): relative path -> size and sha256."""
    out: dict[str, dict[str, Any]] = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        if rel != _MANIFEST:
            out[rel] = {"size": file.stat().st_size, "sha256": _digest(file)}
    return out


def _verify_files(path: Path, manifest: Mapping[str, Any]) -> None:
    """Each file the manifest lists has its recorded size and sha256 (a version 1 manifest lists none)."""
    files = manifest.get("files")
    if files is None and manifest.get("version") == 1:
        return
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
        for v in files.values()
    ):
        raise _fail(path / _MANIFEST, f"lists files {str(files)[:80]!r}, expected name -> {{size, sha256}}")
    for rel, info in files.items():
        file = path / rel
        if ".." in Path(rel).parts or not file.is_file():
            raise _fail(file, "is missing (the checkpoint version is incomplete)")
        size = file.stat().st_size
        if size < info["size"]:
            raise _fail(file, f"is truncated: {size} bytes, the manifest records {info['size']}")
        if size != info["size"]:
            raise _fail(file, f"has {size} bytes, the manifest records {info['size']} (changed after the save?)")
        if _digest(file) != info["sha256"]:
            raise _fail(
                file,
                "fails its checksum: its sha256 is not the one the manifest records (the file was damaged or changed "
                "after the save)",
            )


def _lock(root: Path) -> int | None:
    """Hold the folder's save lock (one saving process at a time; the kernel drops it when the process dies)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    fd = os.open(root / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        raise _fail(
            root, "another process is saving a checkpoint here now (two runs with the same trainer.output_dir?)"
        ) from None
    return fd


def _read_latest(root: Path) -> str:
    path = root / _LATEST
    try:
        name = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise _fail(path, f"cannot be read ({_cause(err)})") from err
    if _version(name) is None:
        raise _fail(path, f"names {name[:40]!r}, expected a version directory like 'step000001' (a damaged file?)")
    if not (root / name).is_dir():
        raise _fail(path, f"names {name!r}, which is not a directory beside it (the checkpoint was moved or pruned?)")
    return name


def _broadcast(name: str) -> str:
    box = [name]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def save_checkpoint(output_dir: str | os.PathLike, state: Mapping[str, Any], *, step: int | None = None) -> Path:
    """Write ``state`` to ``output_dir/checkpoint/`` as a new version, committed atomically.

    Each value of ``state`` is one of

    * an ``nn.Module``: its parameters and buffers (``get_model_state_dict``), sharded or not;
    * ``(module, optimizer)`` or ``(module, [optimizers])``: the module with the
      optimiser state of its parameters (``get_state_dict``), keyed by parameter name;
    * anything else (the step, the config, :func:`rng_state`, ...): plain data, saved per
      rank with ``torch.save`` (tensors, numbers, strings, lists, tuples, dicts).

    With a process group initialised and a module in ``state``, the save is collective:
    every rank calls it, each writes its own shards and its own data. Without one (or with
    data only) this process writes alone. The previous version stays the committed one
    until the new one is complete on every rank.

    The manifest records the size and sha256 of every file of the version;
    :func:`load_checkpoint` checks them, so a damaged byte is found before it loads. One
    process saves into a folder at a time (a second one gets a :class:`CheckpointError`);
    a failed save (a full disk, Ctrl-C) removes its partial version.

    Args:
      output_dir: the run's output directory.
      state: entry name -> module, (module, optimizers) or data.
      step: the number of steps the state holds, which names the version's folder
        (``step000400``); ``None`` numbers the folders by save (``v000001``).

    Returns:
      the directory of the version written.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = save_checkpoint(d, {"step": 3, "model": torch.nn.Linear(2, 2)})
    >>> load_checkpoint(d)["step"]
    3
    """
    kinds, collective, rank, root = _prepare_save(output_dir, state, step)
    lock, previous, name = _start(root, step, collective, rank)
    try:
        return _save_version(root / name, state, kinds, collective, rank, previous)
    finally:
        if lock is not None:
            os.close(lock)


def _prepare_save(
    output_dir: str | os.PathLike, state: Mapping[str, Any], step: int | None
) -> tuple[dict[str, str], bool, int, Path]:
    """Check a save's arguments: the entries' kinds, whether the save is collective, this rank."""
    if not isinstance(state, Mapping) or not all(isinstance(k, str) and k and "." not in k for k in state):
        raise ValueError(f"state: got {type(state).__name__}, expected a mapping with non-empty str keys without '.'")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step: got {step!r}, expected a non-negative int (the steps the checkpoint holds) or None")
    kinds = {name: _kind(name, value) for name, value in state.items()}
    collective = _collective(kinds)
    return kinds, collective, dist.get_rank() if collective else 0, Path(output_dir) / CHECKPOINT_NAME


def _start(root: Path, step: int | None, collective: bool, rank: int) -> tuple[int | None, str | None, str]:
    """Every rank: the save lock (rank 0), the committed version and the new version's folder (named by rank 0)."""
    lock: int | None = None
    previous: str | None = None
    name = ""
    try:
        if rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                lock = _lock(root)
                previous, name = _begin(root, step)
            except BaseException:
                if collective:  # the other ranks wait for the folder's name: tell them
                    _broadcast("")
                raise
        if collective:
            name = _broadcast(name)
            if not name:
                raise _fail(root, "rank 0 could not start the save (its error names the cause)")
    except BaseException:
        if lock is not None:
            os.close(lock)
        raise
    return lock, previous, name


def _begin(root: Path, step: int | None) -> tuple[str | None, str]:
    """Rank 0: the committed version (if any) and the new version's folder, created empty."""
    try:
        previous: str | None = _read_latest(root)
    except CheckpointError:
        previous = None  # a missing or damaged pointer: this save replaces it
    name = _new_name(root, step, previous)
    # Leftovers of interrupted saves: every version but the committed one.
    for p in root.iterdir():
        if _version(p.name) is not None and p.name != previous:
            shutil.rmtree(p, ignore_errors=True)
    (root / name).mkdir()
    return previous, name


def _save_version(
    path: Path, state: Mapping[str, Any], kinds: Mapping[str, str], collective: bool, rank: int, previous: str | None
) -> Path:
    try:
        tensors = _write_data(path, state, kinds, rank)
        if tensors:
            with _quiet_single_process(not collective):
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=not collective)
        if collective:
            dist.barrier()
        if rank == 0:
            _commit(path, kinds, dist.get_world_size() if collective else 1, previous)
    except BaseException:
        if rank == 0 and _committed(path.parent) != path.name:  # a full disk, Ctrl-C: the partial version goes
            shutil.rmtree(path, ignore_errors=True)
        raise
    if collective:
        dist.barrier()
    return path


def _write_data(path: Path, state: Mapping[str, Any], kinds: Mapping[str, str], rank: int) -> dict[str, Any]:
    """Write this rank's plain-data file; return the tensor entries' state dicts (DCP's to write)."""
    data = {k: v for k, v in state.items() if kinds[k] == "data"}
    _write(path / f"data_{rank}.pt", lambda f: torch.save(data, f))
    return {k: _tensor_state(kinds[k], v) for k, v in state.items() if kinds[k] != "data"}


def _commit(path: Path, kinds: Mapping[str, str], world: int, previous: str | None) -> None:
    """Rank 0, once every rank's files are written: the manifest, then ``latest`` replaced atomically (the
    commit), then the previous version removed."""
    root, name = path.parent, path.name
    manifest = {
        "format": _FORMAT,
        "version": _VERSION,
        "world_size": world,
        "entries": dict(kinds),
        "files": _file_digests(path),
    }
    _write(path / _MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    _fsync_dir(path)
    tmp = root / f".{_LATEST}.tmp"
    _write(tmp, lambda f: f.write(f"{name}\n".encode()))
    os.replace(tmp, root / _LATEST)
    _fsync_dir(root)
    if previous is not None:
        shutil.rmtree(root / previous, ignore_errors=True)


def save_checkpoint_async(
    output_dir: str | os.PathLike,
    state: Mapping[str, Any],
    *,
    step: int | None = None,
    process_group: Any = None,
    stage_in_background: bool = False,
    staging: Callable[[dict[str, Any]], Future[dict[str, Any]]] | None = None,
) -> PendingSave:
    """:func:`save_checkpoint` off the critical path: the tensors are copied to host memory, then written and
    committed in the background (``torch.distributed.checkpoint.async_save``).

    The call returns once the tensors are staged, so the caller may change the modules and
    optimisers at once. With ``stage_in_background`` the copy itself runs in the background
    too (DCP's ``DefaultStager`` with asynchronous staging) and the call returns at once:
    the caller may read the tensors meanwhile (a rollout, a forward) but must not change
    them (an optimiser step, a swap) before the returned future's ``staged`` is done; the
    version then holds the state as it was at the call, bit for bit. With ``staging``
    the copy is the caller's: ``staging(tensors)`` gets the modules' and optimisers'
    state dicts (live tensors, which the call drops at once) and returns the future of
    their copy, which the background write waits for and writes as it is
    (:class:`rlcore.train.swap_staging.SwapStaging`: the copy a phase switch makes anyway).

    The version counts only when committed: every rank's shards
    written, then the manifest, then ``latest`` replaced atomically, as in
    :func:`save_checkpoint`; until then ``latest`` names the previous version, so a crash
    or ``kill -9`` during the background write leaves that one loadable. One save at a
    time: wait for the returned future before the next save into the same folder.

    With a process group, every rank calls it; ``process_group`` is the group of the
    background writes' collectives, which must have a CPU backend (gloo) and should not be
    one the caller's own collectives use meanwhile (the default: a ``dist.new_group`` made
    here; the trainer makes one per run).

    Args:
      output_dir, state, step: as in :func:`save_checkpoint`.
      process_group: the group the background save synchronises over.
      stage_in_background: copy the tensors in the background as well; wait for
        ``staged`` before changing them.
      staging: the copy taken by the caller, as above (not with ``stage_in_background``).

    Returns:
      a :class:`PendingSave`: a ``concurrent.futures.Future`` of the committed version's
      directory, whose ``result()`` raises a :class:`CheckpointError` naming the cause of a
      failed write (the partial version is removed), and whose ``staged`` future is done
      once the copy is taken (at once without ``stage_in_background``).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> model = torch.nn.Linear(2, 2)
    >>> pending = save_checkpoint_async(d, {"step": 3, "model": model})
    >>> _ = model.weight.data.zero_()  # training goes on: the staged copy is what is written
    >>> pending.result().name, bool(load_checkpoint(d)["model"]["weight"].any())
    ('v000001', True)
    """
    if staging is not None and stage_in_background:
        raise ValueError("staging: got a staging together with stage_in_background=True, expected one of the two")
    kinds, collective, rank, root = _prepare_save(output_dir, state, step)
    if collective and process_group is None:
        process_group = dist.new_group(backend="gloo")
    lock, previous, name = _start(root, step, collective, rank)
    path = root / name
    done = PendingSave()
    stager = _stager() if stage_in_background else None
    writes: Any = None
    copied: Future[dict[str, Any]] | None = None
    try:
        tensors = _write_data(path, state, kinds, rank)
        if tensors and staging is not None:
            # Written by the commit thread once copied: DCP's own staging would copy it again, in the call.
            copied = staging(tensors)
        elif tensors:
            with _quiet_single_process(not collective):
                writes = dcp.async_save(
                    tensors,
                    storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                    process_group=process_group if collective else None,
                    async_stager=stager,
                    no_dist=not collective,
                )
        del tensors  # no reference to the live state outlives the call (a swap would find it)
    except BaseException:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        if lock is not None:
            os.close(lock)
        if stager is not None:
            stager.close()
        raise
    staged = copied if copied is not None else getattr(writes, "staging_completion", None)
    if staged is None:
        done.staged.set_result(None)
    else:  # done (or failed: the write's future says why) once the copy is taken
        staged.add_done_callback(lambda _: done.staged.set_result(None))
    world = dist.get_world_size() if collective else 1

    def finish() -> None:
        nonlocal process_group, writes, copied
        failed: CheckpointError | None = None
        try:
            if copied is not None:
                with _quiet_single_process(not collective):
                    dcp.save(
                        copied.result(),
                        storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                        process_group=process_group if collective else None,
                        no_dist=not collective,
                    )
            elif writes is not None:
                # Rank 0 (DCP's coordinator) gets its result only once every rank's shards are written. An
                # asynchronous stager's response (newer torch) carries the upload's future.
                upload: Any = getattr(writes, "upload_completion", writes)
                upload.result()
            elif collective:
                dist.barrier(group=process_group)
            if rank == 0:
                _commit(path, kinds, world, previous)
        except BaseException as err:
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            failed = _fail(path, f"the background save failed, the previous version stays ({_cause(err)})")
            failed.__cause__ = err
        finally:
            if stager is not None:  # a stager passed to DCP stays the caller's to close
                stager.close()
            # Released before the future completes: a save started as soon as it does must find the folder free.
            if lock is not None:
                os.close(lock)
        # This thread must not drop the last reference to a process group or a tensor once the caller may go on:
        # at interpreter exit a daemon thread that releases the GIL in a destructor is killed there (abort).
        process_group = writes = copied = None
        if failed is not None:
            done.set_exception(failed)
        else:
            done.set_result(path)

    done.thread = threading.Thread(target=finish, name="rlcore-checkpoint-commit", daemon=True)
    done.thread.start()
    return done


class PendingSave(Future[Path]):
    """The future of a background save (:func:`save_checkpoint_async`): its result is the committed version's
    directory; ``staged`` is done once the state is copied, after which the caller may change it.

    ``result()`` returns (or raises) once the thread that committed the version has ended
    too, so that a process may exit as soon as it has the result.
    """

    def __init__(self) -> None:
        super().__init__()
        self.staged: Future[None] = Future()
        self.thread: threading.Thread | None = None

    def result(self, timeout: float | None = None) -> Path:
        try:
            return super().result(timeout)
        finally:
            thread = self.thread
            if self.done() and thread is not None and thread is not threading.current_thread():
                thread.join()


def _stager() -> DefaultStager:
    """DCP's stager copying in a background thread (pinned memory and a side stream where there is an accelerator)."""
    device = torch.accelerator.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=device, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=device
        )
    )


# --- loading ----------------------------------------------------------------------


def _manifest(path: Path) -> dict[str, Any]:
    file = path / _MANIFEST
    try:
        manifest = json.loads(file.read_bytes())
    except FileNotFoundError as err:
        raise _fail(file, "is missing (an incomplete or foreign checkpoint version)") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _fail(file, f"is not a readable manifest ({_cause(err)})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise _fail(file, f"is not an rlcore checkpoint manifest (format {str(manifest)[:60]!r})")
    if manifest.get("version") not in _READS:
        raise _fail(file, f"has format version {manifest.get('version')!r}, this rlcore reads {list(_READS)}")
    entries = manifest.get("entries")
    if not isinstance(entries, dict) or not all(v in ("module", "trainable", "data") for v in entries.values()):
        raise _fail(file, f"lists entries {str(entries)[:80]!r}, expected name -> 'module' | 'trainable' | 'data'")
    return manifest


def _data(path: Path, rank: int) -> dict[str, Any]:
    file = path / f"data_{rank}.pt"
    if not file.is_file():
        file = path / "data_0.pt"  # more ranks now than at the save: rank 0's data
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise _fail(file, "is missing") from err
    except Exception as err:  # torch.load raises many types on damaged files
        size = file.stat().st_size
        raise _fail(file, f"cannot be read ({size} bytes; {_cause(err)})") from err
    if not isinstance(data, dict):
        raise _fail(file, f"holds {type(data).__name__}, expected a dict of entries")
    return data


def _metadata(path: Path) -> Metadata:
    file = path / ".metadata"
    if not file.is_file():
        raise _fail(file, "is missing (the tensors of this checkpoint were never committed)")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # unpickling garbage raises anything
        raise _fail(file, f"is not DCP metadata ({file.stat().st_size} bytes; {_cause(err)})") from err
    if not isinstance(metadata, Metadata):
        raise _fail(file, f"holds {type(metadata).__name__}, expected DCP Metadata")
    # Truncated or missing shard files are found here, before any tensor is read.
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in needed.items():
        shard = path / rel
        if not shard.is_file():
            raise _fail(shard, "is missing")
        got = shard.stat().st_size
        if got < size:
            raise _fail(shard, f"is truncated: {got} bytes, the metadata expects at least {size}")
    return metadata


def _cause(err: BaseException) -> str:
    """``Type: first line`` of the error, looking through DCP's per-rank wrapper."""
    failures = getattr(err, "failures", None)
    if isinstance(err, dcp.CheckpointException) and isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


@contextlib.contextmanager
def _quiet_single_process(no_dist: bool) -> Iterator[None]:
    # DCP warns that it assumes a single process, which is what no_dist asks for.
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _dcp_load(path: Path, flat: dict[str, Any], metadata: Metadata, *, no_dist: bool) -> None:
    try:
        with _quiet_single_process(no_dist):
            dcp.load(flat, storage_reader=dcp.FileSystemReader(path), no_dist=no_dist)
    except (Exception, dcp.CheckpointException) as err:
        shards = sorted({str(getattr(i, "relative_path", "?")) for i in (metadata.storage_data or {}).values()})
        where = path / shards[0] if len(shards) == 1 else path
        raise _fail(where, f"reading the tensors failed, the file is damaged ({_cause(err)})") from err


def _unflatten(flat: Mapping[str, Any], paths: Mapping[str, tuple[Any, ...]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        keys = paths.get(key, (key,))
        node: Any = out
        for k, nxt in zip(keys, keys[1:]):
            if isinstance(node, list):
                while len(node) <= k:
                    node.append([] if isinstance(nxt, int) else {})
                node = node[k]
            else:
                node = node.setdefault(k, [] if isinstance(nxt, int) else {})
        if isinstance(node, list):
            while len(node) <= keys[-1]:
                node.append(None)
        node[keys[-1]] = value
    return out


def _flatten(tree: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = tree
    return out


def _check_shapes(path: Path, name: str, prefix: str, template: Mapping[str, Any], metadata: Metadata) -> None:
    """Every tensor the module needs is in the checkpoint, with the module's (global) shape."""
    have = metadata.state_dict_metadata
    cut = len(prefix) + 1
    missing = [k for k in template if k not in have]
    if missing:
        raise _fail(
            path,
            f"entry {name!r} has no {missing[0][cut:]!r} ({len(missing)} of the model's tensors missing: "
            "another model architecture?)",
        )
    for key, value in template.items():
        md = have[key]
        if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata) and md.size != value.shape:
            raise _fail(
                path,
                f"entry {name!r}: {key[cut:]!r} has shape {list(md.size)} in the checkpoint, {list(value.shape)} "
                "in this model (another model size?)",
            )


def load_checkpoint(
    output_dir: str | os.PathLike, state: Mapping[str, Any] | None = None, *, strict: bool = True
) -> dict[str, Any]:
    """Load the committed version of ``output_dir/checkpoint/``.

    Without ``state``, everything comes back whole on this process's CPU: data entries
    as saved, a module entry as its full state dict, a ``(module, optimizers)`` entry as
    ``{"model": ..., "optim": ...}`` (for inspection and export). With ``state`` (the
    same shape as at the save, e.g. ``{"policy": (policy, opt), "step": 0}``), modules
    and optimisers are loaded in place, resharded to their current layout (collective
    when a process group is initialised), and the saved data entries are returned. A
    rank beyond the saved world size gets rank 0's data. Every file is checked against
    the size and sha256 its manifest records before anything is loaded. A version
    replaced by a save while this process reads it (outside a process group) is
    followed to the newly committed one.

    Args:
      output_dir: the run's output directory.
      state: entry name -> module, (module, optimizers) or anything (a data entry whose
        saved value is wanted).
      strict: the checkpoint's module entries must be exactly those of ``state`` (a
        checkpoint of another algorithm has other models); ``False`` loads a subset.

    Returns:
      the data entries (and, without ``state``, the tensor entries).

    Raises:
      ValueError: no checkpoint (a message starting ``resume: no checkpoint at``);
        :class:`CheckpointError` for a damaged or incompatible one.
    """
    root = Path(output_dir) / CHECKPOINT_NAME
    if not (root / _LATEST).exists():
        whole = (
            sorted(
                (p.name for p in root.iterdir() if _version(p.name) is not None and (p / _MANIFEST).is_file()),
                key=_order,
            )
            if root.is_dir()
            else []
        )
        if whole:
            raise _fail(
                root / _LATEST,
                f"is missing, though the folder holds the saved versions {whole} (the marker was deleted?); "
                f"write the name of one, e.g. {whole[-1]!r}, into it to resume from that version",
            )
        raise ValueError(f"resume: no checkpoint at {str(root)!r}; run without --resume first")
    kinds = {name: _kind(name, value) for name, value in (state or {}).items()}
    collective = state is not None and _collective(kinds)
    version = _read_latest(root)
    for attempt in range(3):
        try:
            return _load_version(root / version, state, kinds, collective, strict)
        except (CheckpointError, OSError):
            # A save committed while this read (``rlcore export`` of a running job) and removed
            # the version being read: read the new one. Ranks of a group never race a save.
            now = None if collective or attempt == 2 else _committed(root)
            if now is None or now == version:
                raise
            version = now
    raise AssertionError("unreachable")


def _committed(root: Path) -> str | None:
    try:
        return _read_latest(root)
    except CheckpointError:
        return None


def _load_version(
    path: Path, state: Mapping[str, Any] | None, kinds: Mapping[str, str], collective: bool, strict: bool
) -> dict[str, Any]:
    manifest = _manifest(path)
    _verify_files(path, manifest)
    saved: dict[str, str] = manifest["entries"]
    data = _data(path, dist.get_rank() if collective else 0)
    absent = sorted({k for k, v in saved.items() if v == "data"} - set(data))
    if absent:
        raise _fail(path / "data_0.pt", f"lacks the entries {absent} its manifest lists")
    metadata = _metadata(path) if any(v != "data" for v in saved.values()) else None
    if state is None:
        out = dict(data)
        if metadata is not None:
            flat: dict[str, Any] = {
                k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
                for k, md in metadata.state_dict_metadata.items()
            }
            _dcp_load(path, flat, metadata, no_dist=True)
            out.update(_unflatten(flat, metadata.planner_data or {}))
        return out
    wanted = {k for k, v in kinds.items() if v != "data"}
    stored = {k for k, v in saved.items() if v != "data"}
    for name in sorted(wanted):
        if name not in saved:
            raise _fail(path, f"has no entry {name!r} (entries: {sorted(saved)}; saved by another algorithm?)")
        if saved[name] != kinds[name]:
            what = {"module": "a module", "trainable": "a module with its optimizers", "data": "plain data"}
            raise _fail(path, f"entry {name!r} holds {what[saved[name]]}, this run expects {what[kinds[name]]}")
    if strict and stored - wanted:
        raise _fail(
            path,
            f"holds the models {sorted(stored - wanted)} that this run does not have (saved by another algorithm "
            "or setup?); pass strict=False to load the rest",
        )
    for name in sorted(k for k, v in kinds.items() if v == "data"):
        if name not in data:
            raise _fail(path, f"has no entry {name!r} (entries: {sorted(saved)}; saved by another algorithm?)")
    if wanted:
        assert metadata is not None
        tensors = {name: _tensor_state(kinds[name], state[name]) for name in sorted(wanted)}
        for name, sd in tensors.items():
            model_sd = sd if kinds[name] == "module" else sd["model"]
            prefix = name if kinds[name] == "module" else f"{name}.model"
            _check_shapes(path, name, prefix, _flatten(model_sd, prefix, {}), metadata)
        _dcp_load(path, tensors, metadata, no_dist=not collective)
        for name, sd in tensors.items():
            value = state[name]
            try:
                if kinds[name] == "module":
                    set_model_state_dict(value, sd)
                else:
                    set_state_dict(
                        value[0], _optimizers(value[1]), model_state_dict=sd["model"], optim_state_dict=sd["optim"]
                    )
            except (RuntimeError, KeyError, ValueError) as err:
                raise _fail(path, f"entry {name!r} does not fit this run ({_cause(err)})") from err
    return dict(data)


# --- random streams ------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every random stream a step may draw on: torch's CPU generator, the accelerator's, Python's ``random``.

    Save it as a data entry and give it back to :func:`set_rng_state` on resume, so
    dropout and sampling replay exactly.

    >>> s = rng_state(); a = torch.rand(2); set_rng_state(s); torch.equal(a, torch.rand(2))
    True
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    kind = device_kind()
    if kind != "cpu":
        state[kind] = torch.get_device_module(kind).get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the streams :func:`rng_state` captured (an accelerator's only on the same kind of device)."""
    if not isinstance(state, Mapping) or "torch" not in state or "python" not in state:
        raise ValueError(f"state: got {type(state).__name__}, expected the mapping rng_state() returns")
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind = device_kind()
    if kind != "cpu" and kind in state:
        torch.get_device_module(kind).set_rng_state_all(state[kind])
