"""Count the Triton kernels a block of code compiles (in-process JIT cache misses).

A kernel launched with a specialization this process has not compiled yet (another
constexpr, an integer argument that is now 1 or divisible by 16, another pointer
alignment) is compiled on the spot, or loaded from Triton's disk cache when an earlier
process on the host compiled it: hundreds of milliseconds on a fresh host, inside
whatever step launched it. Benchmarks wrap their measured calls in
:class:`TritonCompiles` so a slow row names the kernels that compiled in it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable


def _knobs() -> Any:
    """Triton's runtime knobs, or None where this Triton has no post-compile hook."""
    try:
        from triton import knobs
    except Exception:  # no triton, or one older than knobs
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_post_compile_hook") else None


def _signature(kwargs: dict[str, Any]) -> str:
    """The compiled launch as ``name(arg: type, ...) attrs``: the argument types and the
    specialisation attributes (divisibility by 16, equal to 1) that make it a variant.
    Taken from the hook's ``compile`` record, which Triton versions fill alike; its
    ``repr`` where that record is missing."""
    record = kwargs.get("compile") or {}
    signature = record.get("signature")
    if not isinstance(signature, dict):
        return str(kwargs.get("repr", ""))
    fn = kwargs.get("fn")
    args = ", ".join(f"{k}: {v}" for k, v in signature.items() if v != "constexpr")
    constants = {k: v for k, v in (record.get("constants") or {}).items() if isinstance(v, (int, float, bool, str))}
    configs = record.get("configs") or [None]
    return f"{getattr(fn, 'name', '?')}({args}) constants={constants} attrs={configs[0]}"


class TritonCompiles:
    """Context manager: ``names`` lists the kernel of every compile inside the block
    (in order), ``signatures`` the launch Triton compiled it for (its argument types and
    specialisations, as Triton's hook writes them: what tells two variants apart); the
    hook in place before is chained and put back on exit. ``available`` is False where
    Triton has no post-compile hook (nothing is counted)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.signatures: list[str] = []
        self._runtime = _knobs()
        self.available = self._runtime is not None
        self._previous: Callable[..., Any] | None = None

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        self.names.append(str(getattr(fn, "name", None) or getattr(fn, "__name__", "?")))
        self.signatures.append(_signature(kwargs))
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    def __enter__(self) -> TritonCompiles:
        if self._runtime is not None:
            self._previous = self._runtime.jit_post_compile_hook
            self._runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._previous

    def summary(self, top: int = 12) -> dict[str, Any]:
        """``{"compiles": n, "compiled": {kernel: count}, "signatures": [...]}`` for the
        ``top`` kernels compiled most, and the first ``top`` compiles' signatures."""
        return {"compiles": len(self.names), "compiled": dict(Counter(self.names).most_common(top)),
                "signatures": self.signatures[:top]}
