"""Engine configuration assembled from ``LLM(...)`` kwargs and ``DEEPINFER_*`` env vars.

``EngineConfig.from_kwargs(**kwargs)`` reads the environment strictly (booleans
accept only 0/1/true/false, any unknown ``DEEPINFER_*`` variable is an error so
typos are caught), lets kwargs override it, resolves derived defaults and
validates every field. All problems raise :class:`~deepinfer.errors.ConfigError`
naming the field or variable, the bad value and the allowed values. The variables
themselves (type, default, description) are declared in :mod:`deepinfer.envs`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer import envs
from deepinfer.envs import KNOWN_ENV_VARS, register_env_var
from deepinfer.errors import ConfigError, range_message

__all__ = [
    "EngineConfig",
    "KNOWN_ENV_VARS",
    "register_env_var",
    "DTYPES",
    "ACCELERATORS",
    "DEFAULT_CPU_KV_CACHE_BYTES",
    "DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS",
    "detect_accelerator",
]

DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
ACCELERATORS: tuple[str, ...] = ("nvidia", "ascend", "cpu")
#: KV cache byte budget on the CPU backend when ``kv_cache_memory_bytes`` is None.
DEFAULT_CPU_KV_CACHE_BYTES: int = 2 * 1024**3
#: ``max_num_batched_tokens`` default when chunked prefill is on.
DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS: int = 8192
_MAX_SEED = 2**64 - 1

# env var -> EngineConfig field it sets (the variables themselves are declared in deepinfer/envs.py)
_ENV_FIELDS: dict[str, str] = {
    "DEEPINFER_HF_MODEL_DIR": "model",
    "DEEPINFER_ACCELERATOR": "accelerator",
    "DEEPINFER_BATCH_INVARIANT": "batch_invariant",
    "DEEPINFER_USE_NEXTN_DECODE": "num_speculative_tokens",
    "DEEPINFER_ENABLE_MTP_VARLEN": "enable_mtp_varlen",
    "DEEPINFER_CPU_THREADS": "cpu_threads",
    "DEEPINFER_ASYNC_SCHEDULING": "async_scheduling",
    "DEEPINFER_WARMUP_REQUESTS": "warmup_requests",
}


def host_memory_bytes() -> int | None:
    """Physical memory of this host (bytes), None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes() -> tuple[int, int] | None:
    """(free, total) bytes of the current CUDA device from ``torch.cuda.mem_get_info``; None
    without CUDA. Asked before any weight loads, so ``free`` is what other processes left."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def _memory_bound(accelerator: str) -> tuple[int, str] | None:
    """(bytes, what they are) that one engine's KV cache can never exceed on ``accelerator``."""
    if accelerator == "cpu":
        host = host_memory_bytes()
        return (host, f"this host's memory ({host} bytes) on the CPU backend") if host else None
    if accelerator == "nvidia":
        info = device_memory_bytes()
        if info is not None:
            return info[1], f"the GPU's memory ({info[1]} bytes, torch.cuda.mem_get_info)"
    return None


def detect_accelerator() -> str:
    """'nvidia' if CUDA is usable, else 'ascend' if torch_npu is, else 'cpu'.

    Delegates to :func:`deepinfer.platform.detect_accelerator` (the one module that
    touches devices; it never imports torch_npu without an Ascend install present).
    """
    from deepinfer.platform import detect_accelerator as platform_detect
    return platform_detect()


@dataclass
class EngineConfig:
    """All engine settings; see ``describe()`` for a table of the values in use.

    ``None``/``"auto"`` values are resolved on construction: ``accelerator``
    from the hardware, ``max_num_batched_tokens`` to 8192 with chunked prefill
    (else to ``max_model_len`` once known, see :meth:`resolve_max_model_len`),
    ``kv_cache_memory_bytes`` to ``DEFAULT_CPU_KV_CACHE_BYTES`` on CPU (GPUs
    size the cache from ``gpu_memory_utilization``). ``tokenizer=None`` means
    the model's own; ``max_model_len=None`` means the model's limit.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    #: Override the number of KV blocks per group (tests and memory-pressure experiments).
    num_kv_blocks: int | None = None
    #: torch intra-op threads on CPU; None = 1 for small models (thread hand-offs cost more
    #: than tiny matmuls gain, badly so on a loaded machine), torch's default otherwise.
    cpu_threads: int | None = None
    #: on the CPU reference path, keep dequantized copies of FP8/FP4 weights beside their
    #: bytes (faster steps, more memory); None = yes for small models (hidden_size <= 1024)
    cpu_dense_weights: bool | None = None
    block_size: int = 128
    chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    accelerator: str = "auto"
    batch_invariant: bool = False
    num_speculative_tokens: int = 0
    enable_mtp_varlen: bool = False
    #: plan step N+1 while step N runs (deepinfer/engine/async_engine.py); False = synchronous loop
    async_scheduling: bool = True
    #: at start, serve two throwaway requests through the loop and freeze the start-up heap out
    #: of the GC (EngineCore.warm_up, deepinfer/engine/start_warmup.py); None = on a GPU only
    warmup_requests: bool | None = None
    #: field -> where its value came from ("default", "kwarg", "env VAR", "derived").
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Normalise torch dtypes, resolve derived defaults, then ``validate()``."""
        for name in ("model", "tokenizer"):
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if isinstance(self.dtype, torch.dtype):
            self.dtype = str(self.dtype).removeprefix("torch.")
        if self.accelerator == "auto":
            self.accelerator = detect_accelerator()
            self.sources["accelerator"] = "derived"
        if self.max_num_batched_tokens is None and self.chunked_prefill is True:
            self.max_num_batched_tokens = DEFAULT_CHUNKED_MAX_NUM_BATCHED_TOKENS
            self.sources["max_num_batched_tokens"] = "derived"
        elif self.max_num_batched_tokens is None and self.max_model_len is not None:
            self.max_num_batched_tokens = self.max_model_len
            self.sources["max_num_batched_tokens"] = "derived"
        if self.kv_cache_memory_bytes is None and self.accelerator == "cpu":
            self.kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
            self.sources["kv_cache_memory_bytes"] = "derived"
        self.validate()

    @classmethod
    def from_kwargs(cls, environ: Mapping[str, str] | None = None,
                    **kwargs: Any) -> EngineConfig:
        """Build from ``LLM(...)`` kwargs over ``DEEPINFER_*`` env vars.

        Args:
            environ: environment to read (default ``os.environ``).
            **kwargs: any ``EngineConfig`` field; these override the environment.
        """
        names = [f.name for f in dataclasses.fields(cls) if f.name != "sources"]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            hints = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
            hint = "; ".join(f"{u!r} (did you mean {h[0]!r}?)" for u, h in hints.items() if h)
            raise ConfigError(f"unknown engine argument(s) {unknown}"
                              + (f": {hint}" if hint else "") + f"; allowed: {names}")
        env = os.environ if environ is None else environ
        # every DEEPINFER_* variable that is set is parsed now, also those this engine never
        # reads (e.g. DEEPINFER_DIST_TIMEOUT_S=abc in one process): typos and bad values fail here
        envs.check(env)
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for var, fname in _ENV_FIELDS.items():
            if var in env:
                values[fname] = envs.get(var, env)
                sources[fname] = f"env {var}"
        for fname, value in kwargs.items():
            if fname == "model" and value is None and "model" in values:
                continue  # model=None falls back to DEEPINFER_HF_MODEL_DIR
            values[fname] = value
            sources[fname] = "kwarg"
        return cls(**values, sources=sources)

    def validate(self) -> None:
        """Check the type and range of every field; raise ConfigError on the first bad one."""
        def fail(name: str, allowed: str, got: Any) -> None:
            raise ConfigError(range_message(f"EngineConfig.{name}", allowed, got), field=name)

        def check_int(name: str, lo: int, hi: int | None = None, optional: bool = False) -> None:
            value = getattr(self, name)
            allowed = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
            if optional:
                allowed = "None or " + allowed
                if value is None:
                    return
            if (isinstance(value, bool) or not isinstance(value, int) or value < lo
                    or (hi is not None and value > hi)):
                fail(name, allowed, value)

        for name in ("model", "tokenizer"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value == ""):
                fail(name, "None or a non-empty str path / hub id", value)
        if self.dtype not in DTYPES:
            fail("dtype", f"one of {list(DTYPES)}", self.dtype)
        check_int("seed", 0, _MAX_SEED)
        check_int("max_num_seqs", 1)
        check_int("max_num_batched_tokens", 1, optional=True)
        check_int("max_model_len", 1, optional=True)
        gmu = self.gpu_memory_utilization
        if (isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not math.isfinite(gmu)
                or not 0 < gmu <= 1):
            fail("gpu_memory_utilization", "a number in (0, 1]", gmu)
        check_int("kv_cache_memory_bytes", 1, optional=True)
        bound = _memory_bound(self.accelerator)
        if self.kv_cache_memory_bytes is not None and bound and self.kv_cache_memory_bytes > bound[0]:
            fail("kv_cache_memory_bytes", f"at most {bound[1]}", self.kv_cache_memory_bytes)
        if self.accelerator == "nvidia":
            info = device_memory_bytes()
            if info is not None and info[1] * gmu <= info[1] - info[0]:  # nothing left for weights or KV
                fail("gpu_memory_utilization", f"above {(info[1] - info[0]) / info[1]:.3f}, the fraction of the GPU "
                     f"already in use ({info[1] - info[0]} of {info[1]} bytes, torch.cuda.mem_get_info)", gmu)
        check_int("num_kv_blocks", 1, optional=True)
        check_int("cpu_threads", 1, optional=True)
        for name in ("cpu_dense_weights", "warmup_requests"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                fail(name, "True, False or None (auto)", getattr(self, name))
        check_int("block_size", 1)
        if self.block_size & (self.block_size - 1):
            fail("block_size", "a power of two >= 1", self.block_size)
        self._check_against_checkpoint()
        for name in ("chunked_prefill", "enable_prefix_caching", "batch_invariant",
                     "enable_mtp_varlen", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "True or False", getattr(self, name))
        check_int("expert_parallel_size", 1)
        check_int("data_parallel_size", 1)
        if self.accelerator not in ACCELERATORS:
            fail("accelerator", f"one of {list(ACCELERATORS) + ['auto']}", self.accelerator)
        check_int("num_speculative_tokens", 0)
        if self.batch_invariant and self.enable_mtp_varlen:  # as DeepInfer: no varlen verify in the mode
            raise ConfigError(
                "batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1 / batch_invariant=True) is incompatible "
                "with confidence-scheduled variable-length verification (DEEPINFER_ENABLE_MTP_VARLEN=1 / "
                "enable_mtp_varlen=True): its verify lengths depend on the other requests. "
                "Set DEEPINFER_ENABLE_MTP_VARLEN=0, or DEEPINFER_BATCH_INVARIANT=0", field="enable_mtp_varlen")
        if (not self.chunked_prefill and self.max_num_batched_tokens is not None
                and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            fail("max_num_batched_tokens",
                 f">= max_model_len={self.max_model_len} when chunked_prefill=False",
                 self.max_num_batched_tokens)

    def _check_against_checkpoint(self) -> None:
        """From the checkpoint's config.json, before any weight is loaded: ``block_size``
        against its KV layout (every compress ratio must divide it) and, on the CPU backend,
        an explicit ``num_kv_blocks`` against this host's memory (the cache is allocated
        whole at start). A checkpoint that cannot be read here (missing, not a regular file,
        malformed) is left to the loader, which reports it naming the file."""
        from deepinfer.models.default_model import packaged_model_dir
        from deepinfer.models.registry import family_of, read_model_config

        path = self.model or os.environ.get("DEEPINFER_HF_MODEL_DIR") or str(packaged_model_dir())
        if not os.path.isfile(os.path.join(path, "config.json")):  # isfile: never a FIFO / device
            return
        try:
            mcfg = read_model_config(path)
        except Exception:  # noqa: BLE001 - reported by the loader with the file named
            return
        family = family_of(mcfg)
        try:
            family.check_block_size(mcfg, self.block_size)
        except ValueError as exc:
            raise ConfigError(range_message("EngineConfig.block_size", f"a power of two that every compress ratio "
                                            f"of {path} divides ({exc})", self.block_size),
                              field="block_size") from None
        bound = _memory_bound(self.accelerator)
        if self.num_kv_blocks is not None and bound:
            name = mcfg.torch_dtype if self.dtype == "auto" else self.dtype
            dtype = getattr(torch, name, None) if isinstance(name, str) else None
            dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
            per_block = sum(family.kv_block_bytes(mcfg, self.block_size, dtype).values())
            where = "on this host" if self.accelerator == "cpu" else "on this GPU"
            if self.num_kv_blocks * per_block > bound[0]:
                raise ConfigError(range_message(
                    "EngineConfig.num_kv_blocks", f"at most {bound[0] // per_block} {where} ({per_block} bytes per "
                    f"block of {self.block_size} tokens, {bound[0]} bytes of memory)", self.num_kv_blocks),
                    field="num_kv_blocks")

    def resolve_max_model_len(self, model_max_len: int) -> EngineConfig:
        """Return a copy with ``max_model_len`` (and dependent defaults) filled in.

        Args:
            model_max_len: the model's own context limit; an explicit
                ``max_model_len`` must not exceed it.
        """
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ConfigError(range_message(
                "EngineConfig.max_model_len", f"<= the model's limit {model_max_len}",
                self.max_model_len), field="max_model_len")
        sources = dict(self.sources)
        length = self.max_model_len
        if length is None:
            length, sources["max_model_len"] = model_max_len, "derived"
        batched = self.max_num_batched_tokens
        if batched is None:
            batched, sources["max_num_batched_tokens"] = length, "derived"
        return dataclasses.replace(self, max_model_len=length, max_num_batched_tokens=batched,
                                   sources=sources)

    @property
    def deterministic(self) -> bool:
        """True when outputs are reproducible across batch compositions."""
        return self.batch_invariant and not self.enable_mtp_varlen

    def to_dict(self) -> dict[str, Any]:
        """Field values (without ``sources``) as a plain dict."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "sources"}

    def describe(self) -> str:
        """A fixed-width table of every field, its value and where it came from."""
        rows = [("field", "value", "source")]
        rows += [(k, repr(v), self.sources.get(k, "default")) for k, v in self.to_dict().items()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "EngineConfig\n" + "\n".join(lines)
