"""Every ``DEEPINFER_*`` environment variable, declared once (vLLM's ``envs.py`` idea).

Each variable has a type (its parser), a default and a description; nothing else in the
engine declares one. Readers ask this module::

    from deepinfer import envs
    envs.DEEPINFER_FP8_GEMM                  # parsed value of os.environ, or the default
    envs.get("DEEPINFER_EPLB_POLICY", env)   # the same for another mapping

Values are parsed strictly at read time (the environment may change between engines):
a bad value raises :class:`~deepinfer.errors.ConfigError` naming the variable and the
allowed values. ``EngineConfig.from_kwargs`` rejects any ``DEEPINFER_*`` name not declared
here (typos), and ``deepinfer config`` parses every variable that is set.

An alias is an older name of a variable: either name works, and setting both to
different values is a ConfigError naming both.

This module imports nothing from deepinfer but :mod:`deepinfer.errors`, so any module
may read it without an import cycle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer.errors import ConfigError

__all__ = ["EnvVar", "ENV_VARS", "KNOWN_ENV_VARS", "get", "is_set", "set_name", "unknown", "check",
           "register_env_var"]

_BOOL_WORDS = {"0": False, "1": True, "true": True, "false": False}


class _Invalid(Exception):
    """A parser's rejection; carries the allowed values for the message."""

    def __init__(self, allowed: str) -> None:
        super().__init__(allowed)
        self.allowed = allowed


def _bool(raw: str) -> bool:
    if raw.lower() not in _BOOL_WORDS:
        raise _Invalid("0, 1, true, false (case-insensitive)")
    return _BOOL_WORDS[raw.lower()]


def _int(lo: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        s = raw.strip()
        if not (s.isascii() and s.isdigit()) or int(s) < lo:
            raise _Invalid(f"an integer >= {lo}")
        return int(s)
    return parse


def _positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:  # also rejects nan
        raise _Invalid("a number > 0")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        s = raw.strip().lower()
        if s not in choices:
            raise _Invalid(", ".join(choices) + " (case-insensitive)")
        return s
    return parse


def _path(raw: str) -> str:
    if not raw:
        raise _Invalid("a non-empty path")
    return raw


def _host(raw: str) -> str:
    s = raw.strip()
    if not s or any(c.isspace() or c in "/[]" for c in s):
        raise _Invalid("an IP address or host name of this machine (e.g. 127.0.0.1, 0.0.0.0, ::1)")
    return s


def _str(raw: str) -> str:
    return raw


def _default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")


@dataclass(frozen=True)
class EnvVar:
    """One declared variable: ``parse(raw)`` -> value; ``default`` (or ``default_factory()``) when unset."""

    name: str
    type: str
    parse: Callable[[str], Any]
    default: Any
    description: str
    aliases: tuple[str, ...] = ()
    default_factory: Callable[[], Any] | None = None

    def default_value(self) -> Any:
        return self.default_factory() if self.default_factory is not None else self.default


_FASTPATH_MODES = ("auto", "0", "1", "ref", "triton", "off", "false", "no")

_DECLARED: tuple[EnvVar, ...] = (
    # ---- engine configuration (EngineConfig fields; LLM(...) kwargs override them) ----
    EnvVar("DEEPINFER_HF_MODEL_DIR", "path", _path, None,
           "local checkpoint directory, used when model is None (default: the embedded deepinfer-tiny)"),
    EnvVar("DEEPINFER_ACCELERATOR", "choice", _choice("nvidia", "ascend", "cpu", "auto"), "auto",
           "nvidia|ascend|cpu|auto (default: auto-detect); also read by build.sh and scripts/bootstrap.sh"),
    EnvVar("DEEPINFER_BATCH_INVARIANT", "bool", _bool, False, "0|1|true|false: batch-invariant kernels"),
    EnvVar("DEEPINFER_USE_NEXTN_DECODE", "int", _int(0), 0, "int >= 0: max draft length (0 = speculation off)"),
    EnvVar("DEEPINFER_ENABLE_MTP_VARLEN", "bool", _bool, False,
           "0|1|true|false: confidence-scheduled variable verification"),
    EnvVar("DEEPINFER_CPU_THREADS", "int", _int(1), None,
           "int >= 1: torch intra-op threads on CPU (default: 1 for small models)"),
    EnvVar("DEEPINFER_ASYNC_SCHEDULING", "bool", _bool, True,
           "0|1|true|false (default 1): plan step N+1 while step N runs on the device"),
    EnvVar("DEEPINFER_WARMUP_REQUESTS", "bool", _bool, None,
           "0|1|true|false (default: 1 on a GPU, 0 on the CPU): serve two throwaway requests at start "
           "(like SGLang's server warm-up) and freeze the start-up heap out of the GC; 0 = skip both"),
    EnvVar("DEEPINFER_CACHE_DIR", "path", _path, None,
           "where the embedded default checkpoint is written (default ~/.cache/deepinfer)",
           default_factory=_default_cache_dir),
    # ---- compiled (fast) path ----
    EnvVar("DEEPINFER_FASTPATH", "choice", _choice(*_FASTPATH_MODES), "auto",
           "auto|0|1|ref|triton: fast path of pure-decode steps (auto = bf16/fp16 on CUDA, 1 = any dtype; "
           "ref / triton force it on the host with the torch references / interpreted kernels: tests)"),
    EnvVar("DEEPINFER_CUDA_GRAPHS", "choice", _choice("0", "1", "off", "false", "no", "on", "true", "yes"), None,
           "0|1 (default 1 on CUDA, off on a host cache): CUDA graphs of pure-decode steps on the fast path"),
    EnvVar("DEEPINFER_CUDA_GRAPH_WARMUP", "choice", _choice("auto", "0", "1"), "auto",
           "auto|0|1: capture every decode graph shape at engine start, largest first (auto = on CUDA; "
           "0 = capture on first use; 1 = also emulated on a host cache: tests)"),
    EnvVar("DEEPINFER_FAST_PREFILL", "choice", _choice("auto", "0", "triton", "ref"), "auto",
           "auto|0|triton|ref: fast path of prefill / mixed steps (auto = bf16/fp16 on CUDA; triton / ref "
           "force it anywhere with the kernels / their torch references: tests)"),
    EnvVar("DEEPINFER_FP8_GEMM", "choice", _choice("auto", "triton", "ref", "dequant"), "auto",
           "auto|triton|ref|dequant: how FP8 checkpoint linears compute (auto = Triton w8a8 block-scaled "
           "GEMM on CUDA, dequantized weight elsewhere)"),
    EnvVar("DEEPINFER_MOE_W8A8", "choice", _choice("auto", "0", "1"), "auto",
           "auto|0|1: FP8 routed experts with FP8 activations (auto = CUDA steps with >= 16 rows per expert, "
           "experts >= 2048 wide; 0 = weight-only always; 1 = every step)"),
    # ---- DeepSeek-V4.1 SWA bounded replay (DeepInfer's "YOCO prefill truncation") ----
    EnvVar("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "choice", _choice("off", "mask", "compact"), "off",
           "off|mask|compact: SWA bounded replay of the V4.1 decoder layers in prefill (default off)",
           aliases=("DEEPINFER_SWA_REPLAY_MODE",)),
    EnvVar("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "int", _int(1), 140,
           "int >= 1: prompt suffix the V4.1 decoder layers replay (default 140; >= sliding_window + 6)",
           aliases=("DEEPINFER_SWA_REPLAY_KEEP",)),
    # ---- speculative decoding ----
    EnvVar("DEEPINFER_SPEC_STEP_CURVE", "path", _path, None,
           "path: a spec_step_curve_*.json file or a directory of them for the confidence-scheduled verify "
           "budget (default unset = profile at start-up; the engine never reads profiling/results itself)"),
    EnvVar("DEEPINFER_SPEC_STEP_CURVE_CACHE", "bool", _bool, True,
           "0|1|true|false (default 1): cache the start-up step-time curve under DEEPINFER_CACHE_DIR/step_curves "
           "per hardware + model config + dtype + draft length (0: profile every start, write nothing)"),
    # ---- parallel engine (REFERENCE names DeepInfer's EPLB knobs, not their variables) ----
    EnvVar("DEEPINFER_EPLB_NUM_REDUNDANT_EXPERTS", "int", _int(0), 0,
           "int >= 0: redundant expert slots per MoE layer (padded so routed + redundant divides by the EP "
           "size; default 0)"),
    EnvVar("DEEPINFER_EPLB_REBALANCE_INTERVAL", "int", _int(0), 0,
           "int >= 0: engine steps between automatic rebalances (0 = only on request; default 0)"),
    EnvVar("DEEPINFER_EPLB_WINDOW_SIZE", "int", _int(1), 100,
           "int >= 1: steps of expert load the policy sees (default 100)"),
    EnvVar("DEEPINFER_EPLB_POLICY", "choice", _choice("auto", "global", "hierarchical"), "auto",
           "auto|global|hierarchical: EPLB policy (auto = hierarchical when groups and nodes are set)"),
    EnvVar("DEEPINFER_EPLB_NUM_GROUPS", "int", _int(1), None, "int >= 1: expert groups for the hierarchical policy"),
    EnvVar("DEEPINFER_EPLB_NUM_NODES", "int", _int(1), 1, "int >= 1: nodes for the hierarchical policy (default 1)"),
    EnvVar("DEEPINFER_DIST_HOST", "str", _host, "127.0.0.1",
           "address the data-parallel group's rendezvous store listens on (default 127.0.0.1: loopback only; "
           "the store has no authentication)"),
    EnvVar("DEEPINFER_DIST_TIMEOUT_S", "float", _positive_float, 120.0,
           "seconds > 0 a collective may wait for a peer before failing (default 120)"),
    EnvVar("DEEPINFER_EP_TIMING", "bool", _bool, False,
           "0|1: time each expert-parallel all-to-all (EP benchmark; CUDA events on GPUs, wall clock on CPU)"),
    EnvVar("DEEPINFER_STRUCTURED_BACKEND", "choice", _choice("auto", "xgrammar", "llguidance"), "auto",
           "auto|xgrammar|llguidance: grammar backend of JSON-schema structured output (auto = xgrammar, "
           "llguidance per schema where only it enforces the schema exactly)"),
    EnvVar("DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S", "float", _positive_float, 30.0,
           "seconds > 0 admission waits for a request's grammar to compile; a grammar still compiling then is "
           "refused (field structured_output), never run unchecked (default 30)"),
    # ---- results, tests and scripts ----
    EnvVar("DEEPINFER_COMMIT", "str", _str, None,
           "the source commit recorded in results when the tree's .git cannot tell (device copies)"),
    EnvVar("DEEPINFER_TEST_SEED", "int", _int(0), None, "tests only: replay a failing test's random seed"),
    EnvVar("DEEPINFER_TEST_WORKERS", "str", _str, "auto",
           "scripts/test.sh only: pytest-xdist workers (auto = one per core, 0 = serial)"),
    EnvVar("DEEPINFER_TORCH_SPEC", "str", _str, None,
           "scripts/bootstrap.sh only: pip requirement for torch, overriding the accelerator's default"),
)

#: canonical name -> declaration.
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in _DECLARED}
#: alias -> canonical name.
_ALIASES: dict[str, str] = {a: v.name for v in _DECLARED for a in v.aliases}
#: every name the engine accepts (aliases included) -> description.
KNOWN_ENV_VARS: dict[str, str] = {v.name: v.description for v in _DECLARED}
KNOWN_ENV_VARS.update({a: f"alias of {c}" for a, c in _ALIASES.items()})


def _var(name: str) -> EnvVar:
    try:
        return ENV_VARS[_ALIASES.get(name, name)]
    except KeyError:
        raise KeyError(f"{name} is not declared in deepinfer/envs.py") from None


def _parse(var: EnvVar, name: str, raw: str) -> Any:
    try:
        return var.parse(raw)
    except _Invalid as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is invalid; allowed: {exc.allowed}",
                          field=name) from None


def set_name(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Which spelling of the variable ``name`` (itself or an alias) is set; None when none is.

    Raises ConfigError when two spellings are set to different values."""
    var = _var(name)
    env = os.environ if environ is None else environ
    found = [n for n in (var.name, *var.aliases) if n in env]
    if not found:
        return None
    first = _parse(var, found[0], env[found[0]])
    for other in found[1:]:
        if _parse(var, other, env[other]) != first:
            raise ConfigError(f"environment variables {found[0]}={env[found[0]]!r} and {other}={env[other]!r} "
                              f"disagree ({other} is an alias of {var.name}); set only one of them",
                              field=var.name)
    return found[0]


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """True when the variable (or one of its aliases) is in the environment."""
    return set_name(name, environ) is not None


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of ``name`` (or its alias) in ``environ`` (default ``os.environ``),
    else its default."""
    var = _var(name)
    env = os.environ if environ is None else environ
    spelled = set_name(name, env)
    return var.default_value() if spelled is None else _parse(var, spelled, env[spelled])


def unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``DEEPINFER_*`` names in ``environ`` that are not declared (typos, sorted)."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith("DEEPINFER_") and k not in KNOWN_ENV_VARS)


def check(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Parse every declared variable that is set: {canonical name: value}.

    Raises ConfigError on an unknown ``DEEPINFER_*`` name, a bad value or disagreeing aliases."""
    env = os.environ if environ is None else environ
    typos = unknown(env)
    if typos:
        raise ConfigError(f"unknown environment variable(s) {typos}; "
                          f"known DEEPINFER_* variables: {sorted(KNOWN_ENV_VARS)}")
    return {name: get(name, env) for name in ENV_VARS if is_set(name, env)}


def register_env_var(name: str, description: str) -> None:
    """Compatibility shim for modules written before this one: a no-op for a variable
    declared here. Variables are declared in this module only, so an undeclared name is an
    error that says where to declare it."""
    if not name.startswith("DEEPINFER_"):
        raise ValueError(f"env var name must start with 'DEEPINFER_', got {name!r}")
    if name not in KNOWN_ENV_VARS:
        raise ValueError(f"{name} is not declared: add an EnvVar for it to deepinfer/envs.py "
                         f"(every DEEPINFER_* variable is declared there)")


def __getattr__(name: str) -> Any:
    """``envs.DEEPINFER_<NAME>``: the parsed value of ``os.environ`` now, else the default."""
    if name in ENV_VARS or name in _ALIASES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(ENV_VARS))
