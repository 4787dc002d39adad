"""Batch-invariant mode: the switch, its tile constants and the kernel dispatch table.

In batch-invariant mode every reduction whose order could depend on the batch runs in
a fixed order per token, so a token's hidden states, logits, log-probs and sampled
token are bitwise identical whatever else shares its step (batch size, batch order,
chunked-prefill boundaries, prefix-cache hits). It is what
``DEEPINFER_BATCH_INVARIANT=1`` / ``LLM(batch_invariant=True)`` turns on; with a fixed
``seq_seed`` (the sampler's counter-based RNG, :mod:`deepinfer.engine.rng`) a request
replays exactly.

The mode is a context variable, scoped explicitly::

    from deepinfer.batch_invariant import batch_invariant_mode
    with batch_invariant_mode(True):
        logits = model.compute_logits(model(batch, cache))

``ModelRunner.execute`` runs inside ``batch_invariant_mode(runner.batch_invariant)``
(see :func:`scoped`), so two engines with different settings can share a process.

How invariance is obtained (CPU, by construction; see
:mod:`deepinfer.models.invariant_ops` and :mod:`deepinfer.models.invariant_attention`):

* every GEMM runs at a fixed shape: rows in tiles of :data:`ROW_TILE` (the last tile
  zero-padded), and, where the other operand's length depends on the step (the keys of
  attention and of the indexer), its rows in blocks of :data:`KEY_BLOCK`;
* reductions over a step-dependent length (attention's softmax denominator and its
  weighted sum over keys) add fixed-size blocks one after another in a fixed order;
* element-wise ops whose vectorised and scalar-tail CPU code paths disagree
  (sigmoid, SiLU, softplus in float32) are written with ops that agree (exp, add, div).

The GPU half plugs in through :func:`register_kernel`: a compiled kernel registered for
``(op, device_type)`` replaces the torch reference for that op (names in :data:`OPS`).
The Triton kernels of ``kernels/batch_invariant_*.py`` (:data:`BUILTIN_KERNELS`) are
registered for "cuda" the first time the mode asks for a CUDA kernel (when Triton
imports); :func:`load_builtin_kernels` registers them explicitly (tests do so for "cpu"
under ``TRITON_INTERPRET=1``) and :func:`set_autoload` turns the automatic loading off
(to measure the torch fallbacks). Each keeps one launch configuration per dtype and
model width, never one chosen from the step's row count: GEMMs without split-K,
attention over one key order per query, the MoE's expert GEMMs at one tiling with a
combine in ascending expert id, and the row reductions torch's CUDA kernels would lay
out by row count (RMSNorm's mean of squares, the sampler's top-p cumsum). V4's compiled
executor (decode CUDA graphs, the prefill path) runs in the mode with the op namespace of
deepinfer/models/fast/invariant.py, every row through the same per-row kernels in decode,
prefill and mixed steps; speculative decoding and V4.1 keep the reference path in it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["ROW_TILE", "KEY_BLOCK", "QUERY_TILE", "OPS", "BUILTIN_KERNELS", "enabled", "set_enabled",
           "batch_invariant_mode", "scoped", "register_kernel", "get_kernel", "registered_kernels",
           "load_builtin_kernels", "set_autoload"]

#: Rows per GEMM call in batch-invariant mode (activations are zero-padded to a multiple).
ROW_TILE: int = 32
#: Keys (compressed entries, indexer keys) per block of an attention / indexer reduction.
KEY_BLOCK: int = 32
#: Query rows per attention tile (zero-padded), so every attention GEMM has one shape.
QUERY_TILE: int = 32

#: Ops a compiled batch-invariant kernel may replace, with the contract each must keep.
OPS: dict[str, str] = {
    "linear": "(x [M, K], w [N, K]) -> [M, N]; row i never depends on M or on other rows",
    "matmul_nt": "(a [M, K], b [N, K]) -> [M, N]; element (i, j) depends on neither M nor N",
    "attention": "invariant_attention.attend(...) signature; one fixed key order per query",
    "moe": "(moe module, x [T, D], input_ids [T]) -> [T, D]; fixed per-token combine order",
    "row_sum": "(x [..., D], square: bool) -> float32 [...]; sum over D (of squares) in an order fixed by D",
    "row_cumsum": "(x [R, V]) -> float32 [R, V]; prefix sums of each row in an order fixed by V",
}

#: op -> (module of deepinfer_kernels, function): the Triton kernels of the mode.
BUILTIN_KERNELS: dict[str, tuple[str, str]] = {
    "linear": ("batch_invariant_matmul", "linear"),
    "matmul_nt": ("batch_invariant_matmul", "matmul_nt"),
    "attention": ("batch_invariant_attention", "attention"),
    "moe": ("batch_invariant_moe", "moe"),
    "row_sum": ("batch_invariant_row_sum", "row_sum"),
    "row_cumsum": ("batch_invariant_cumsum", "row_cumsum"),
}

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("deepinfer_batch_invariant", default=False)
_KERNELS: dict[tuple[str, str], Callable[..., Any]] = {}
_AUTOLOAD = {"cuda": True}  # device types whose built-in kernels load on first use
_LOAD_LOCK = threading.Lock()
F = TypeVar("F", bound=Callable[..., Any])


def enabled() -> bool:
    """True inside batch-invariant mode."""
    return _ENABLED.get()


def set_enabled(flag: bool) -> None:
    """Switch the mode for the current context (prefer :func:`batch_invariant_mode`)."""
    if not isinstance(flag, bool):
        raise TypeError(f"batch-invariant flag must be a bool, got {flag!r}")
    _ENABLED.set(flag)


@contextlib.contextmanager
def batch_invariant_mode(flag: bool = True) -> Iterator[None]:
    """Run the enclosed code with the mode set to ``flag``; the previous value comes back."""
    if not isinstance(flag, bool):
        raise TypeError(f"batch-invariant flag must be a bool, got {flag!r}")
    token = _ENABLED.set(flag)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def scoped(method: F) -> F:
    """Decorate a method of an object with a ``batch_invariant`` bool attribute: the
    method runs inside ``batch_invariant_mode(self.batch_invariant)``."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with batch_invariant_mode(bool(getattr(self, "batch_invariant", False))):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def register_kernel(op: str, device_type: str, fn: Callable[..., Any] | None) -> None:
    """Make ``fn`` the batch-invariant implementation of ``op`` on ``device_type``
    ("cuda", "npu", "cpu"); ``None`` removes it (back to the torch reference).

    Compiled kernels in ``deepinfer_kernels`` call this when imported on a machine that can run
    them; they must keep the contract in :data:`OPS` (tests/test_batch_invariance.py
    checks it bitwise for whatever is registered)."""
    if op not in OPS:
        raise KeyError(f"unknown batch-invariant op {op!r}; known: {sorted(OPS)}")
    if fn is None:
        _KERNELS.pop((op, device_type), None)
    else:
        _KERNELS[(op, device_type)] = fn


def get_kernel(op: str, device_type: str) -> Callable[..., Any] | None:
    """The registered kernel for ``op`` on ``device_type``, or None (torch reference).
    The first CUDA lookup registers the built-in Triton kernels (see :func:`set_autoload`)."""
    if _AUTOLOAD.get(device_type):
        with _LOAD_LOCK:
            if _AUTOLOAD.get(device_type):
                _AUTOLOAD[device_type] = False
                try:
                    load_builtin_kernels(device_type)
                except ImportError as exc:  # no Triton: the torch references (fixed shapes) run instead
                    warnings.warn(f"batch-invariant mode on {device_type} runs the torch references: {exc}",
                                  stacklevel=2)
    return _KERNELS.get((op, device_type))


def set_autoload(device_type: str, flag: bool) -> None:
    """Whether the first lookup for ``device_type`` registers the built-in kernels (on
    for "cuda"). Turning it off does not remove kernels already registered."""
    _AUTOLOAD[device_type] = bool(flag)


def load_builtin_kernels(device_type: str, ops: list[str] | None = None) -> list[str]:
    """Register the Triton kernels of :data:`BUILTIN_KERNELS` (all, or ``ops``) for
    ``device_type``; returns the ops registered. Triton runs them on CUDA tensors, or on
    CPU tensors when ``TRITON_INTERPRET=1`` was set before they were imported."""
    names = list(BUILTIN_KERNELS) if ops is None else ops
    for op in names:
        module, fn = BUILTIN_KERNELS[op]
        register_kernel(op, device_type, getattr(_kernels_module(module), fn))
    return names


def _kernels_module(name: str) -> Any:
    """``deepinfer_kernels.<name>`` (imported on first use: Triton loads only when the mode is on)."""
    return importlib.import_module(f"deepinfer_kernels.{name}")


def registered_kernels() -> dict[tuple[str, str], str]:
    """(op, device type) -> qualified name of every registered kernel."""
    return {k: getattr(v, "__qualname__", repr(v)) for k, v in _KERNELS.items()}
