"""Export a policy as a Hugging Face directory (safetensors, config, generation config, tokenizer) that loads anywhere.

A built-in task's character tokenizer (``rlcore.train.CharTokenizer``,
``rlcore.agent.SpecialCharTokenizer``) is written as a ``tokenizers`` tokenizer of one
token per character (its special words as added tokens), through
``PreTrainedTokenizerFast``: ``AutoTokenizer.from_pretrained`` gives the same ids.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlcore.models.lora import is_lora, merged_state_dict

__all__ = ["export_hf", "export_reward_model"]


@torch.no_grad()
def _is_char_tokenizer(tokenizer: Any) -> bool:
    """An rlcore character tokenizer: an alphabet, ``<pad>`` 0 and ``<eos>`` 1, no ``save_pretrained``."""
    return (
        not hasattr(tokenizer, "save_pretrained")
        and isinstance(getattr(tokenizer, "alphabet", None), str)
        and getattr(tokenizer, "pad_token_id", None) == 0
        and getattr(tokenizer, "eos_token_id", None) == 1
    )


def _char_tokenizer_as_hf(tokenizer: Any) -> Any:
    """A ``PreTrainedTokenizerFast`` with the ids of an rlcore character tokenizer (``None``: not writable).

    Byte-level BPE without merges over the alphabet's characters, the special words as
    added tokens: the pipeline a Qwen2-type ``AutoTokenizer`` rebuilds from
    ``tokenizer.json``, so it gives the same ids as the generic fast tokenizer. Only
    single-byte (ASCII) characters are one byte-level symbol; another alphabet is not
    written (a warning says so).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet: str = tokenizer.alphabet
    specials: list[str] = list(getattr(tokenizer, "specials", ()))
    wide = sorted({c for c in alphabet if len(c.encode()) != 1})
    if wide or {"<pad>", "<eos>"} & set(specials):
        warnings.warn(
            f"tokenizer: not written beside the model: its characters {wide} are not single bytes, or its special "
            f"words {specials} reuse '<pad>' / '<eos>'",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    symbol = bytes_to_unicode()
    vocab = {"<pad>": 0, "<eos>": 1, **{symbol[c.encode()[0]]: i + 2 for i, c in enumerate(alphabet)}}
    core = Tokenizer(models.BPE(vocab, [], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    # No <unk> of its own (a character outside the alphabet is dropped): naming <pad> keeps
    # tokenizer classes that add a default unknown token from adding one beyond the model's vocabulary.
    fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>")
    # Special words (tool-call tags) after the alphabet, matched before the characters.
    fast.add_tokens([AddedToken(w, normalized=False, special=False) for w in specials])
    want = [int(tokenizer.encode(w)[0]) for w in specials]
    got = [fast.convert_tokens_to_ids(w) for w in specials]
    if got != want or len(fast) != tokenizer.vocab_size:  # pragma: no cover  (the ids are built to agree)
        raise AssertionError(f"tokenizer ids differ: {got} vs {want}, {len(fast)} vs {tokenizer.vocab_size} tokens")
    return fast


def _set_special_ids(model: Any, tokenizer: Any, *, force: bool) -> None:
    """The tokenizer's eos / pad / bos ids in the config and generation config (``force``: even where set)."""
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(tokenizer, key, None)
        for target in (model.config, getattr(model, "generation_config", None)):
            if target is None:  # a model that does not generate (sequence classification)
                continue
            if force or getattr(target, key, None) is None:
                setattr(target, key, value)


def export_hf(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
    params: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str = "5GB",
) -> Path:
    """Write ``model`` with ``save_pretrained`` so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it.

    A LoRA model (``peft.PeftModel``) is written with its adapters merged, as a plain
    model of the base architecture, so inference servers need no peft. ``params`` (e.g.
    the trained tensors of :func:`rlcore.models.from_hf`) replace the model's own tensors
    of the same names. Weights are safetensors; the model itself is not modified. The
    files are written into a hidden folder beside ``out_dir`` and then moved in, so an
    export killed or failing mid-way (a full disk) leaves the previous one loadable.

    Args:
      model: a transformers causal LM, or a ``peft.PeftModel`` around one.
      out_dir: the directory to write (created if missing).
      tokenizer: saved beside the weights when given (with its chat template): a
        ``transformers`` tokenizer, or an rlcore character tokenizer (written as a
        ``PreTrainedTokenizerFast``). Its eos / pad / bos ids go into the config and
        generation config (a character tokenizer's always: ``<eos>`` 1, ``<pad>`` 0, no
        bos; a ``transformers`` one's where the model's are unset).
      params: name -> tensor overriding the model's state.
      dtype: cast floating weights to this dtype (``None``: keep theirs).
      max_shard_size: ``save_pretrained``'s shard size.

    Returns:
      ``out_dir`` as a ``Path``.
    """
    char = _is_char_tokenizer(tokenizer)
    if tokenizer is not None and not char and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise ValueError(
            f"tokenizer: got {type(tokenizer).__name__}, expected a transformers tokenizer or an rlcore character "
            "tokenizer"
        )
    if char:
        ids = tokenizer
        tokenizer = _char_tokenizer_as_hf(tokenizer)
    base: Any = model.get_base_model() if is_lora(model) else model  # type: ignore[operator]
    state = merged_state_dict(model) if is_lora(model) else dict(model.state_dict())
    if params is not None:
        unknown = sorted(set(params) - set(state))
        if unknown:
            raise ValueError(f"params: got names the model does not have, e.g. {unknown[:3]}")
        state.update(params)
    state = {
        k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()).contiguous()
        for k, v in state.items()
    }
    # A clean twin of the base architecture (no adapter modules), holding the tensors
    # without copying them, is what gets saved.
    with torch.device("meta"):
        twin = type(base)(base.config)
    twin.load_state_dict(state, strict=False, assign=True)
    missing = [n for n, p in twin.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"model: its state lacks {missing[:3]}, which the exported architecture needs")
    if dtype is not None:
        twin.config.torch_dtype = dtype
    generation = getattr(base, "generation_config", None)  # a sequence-classification model has none
    if generation is not None:
        twin.generation_config = copy.deepcopy(generation)
    if char:
        _set_special_ids(twin, ids, force=True)
    elif tokenizer is not None:
        _set_special_ids(twin, tokenizer, force=False)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.parent.glob(f".{out.name}.partial-*"):
        if not _writer_alive(old.name):  # left by an export killed mid-way
            shutil.rmtree(old, ignore_errors=True)
    # Written beside, then moved in file by file: an export killed or failing mid-way (a full
    # disk) leaves the previous one loadable, never a truncated weights file.
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    try:
        twin.save_pretrained(stage, safe_serialization=True, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(stage)
        _move_in(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def export_reward_model(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
    params: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a scalar-head model (a one-output token-classification model) as a sequence-classification directory.

    ``AutoModelForSequenceClassification.from_pretrained(out_dir)`` then scores a sequence
    with the head at its last token, what :class:`rlcore.rewards.RewardModel` (the
    ``reward_model`` reward) loads. The sequence-classification head has no bias: the
    token head's bias, a constant added to every reward, is left out (rankings and
    Bradley-Terry losses do not see it).

    Args:
      model: the trained ``*ForTokenClassification`` with ``num_labels == 1`` (its config
        names the architecture; with ``params`` its own tensors are not read).
      out_dir: the directory to write (created if missing).
      tokenizer, dtype: as in :func:`export_hf`.
      params: name -> tensor, the whole state (e.g. gathered from a sharded model); default
        the model's own.

    Returns:
      ``out_dir`` as a ``Path``.
    """
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(model.config)
    if getattr(config, "num_labels", None) != 1:
        raise ValueError(f"model: got num_labels={getattr(config, 'num_labels', None)}, expected a one-output head")
    state = dict(model.state_dict() if params is None else params)
    state.pop("score.bias", None)
    with torch.device("meta"):
        head = AutoModelForSequenceClassification.from_config(config)
    return export_hf(head, out_dir, tokenizer=tokenizer, params=state, dtype=dtype)


def _writer_alive(name: str) -> bool:
    """The process that named a ``.NAME.partial-PID-...`` folder still runs (it may be exporting now)."""
    pid = name.rsplit(".partial-", 1)[-1].split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _is_weights(name: str) -> bool:
    return name.startswith("model") and (name.endswith(".safetensors") or name.endswith(".safetensors.index.json"))


def _move_in(stage: Path, out: Path) -> None:
    """Move the files of ``stage`` into ``out`` (``os.replace``, each synced first), weights before the config;
    then remove weight files of an older export that this one does not have (another sharding)."""
    new = sorted(stage.iterdir(), key=lambda p: (p.name == "config.json", p.name))
    for path in new:
        target = out / path.name
        if path.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        os.replace(path, target)
    names = {p.name for p in new}
    for path in out.iterdir():
        if path.is_file() and _is_weights(path.name) and path.name not in names:
            path.unlink()
