"""Count what a step launches, on any device: torch ops that run a kernel (views and
allocations excluded), Triton kernel launches, and host syncs (``.item()`` / ``.tolist()``
style reads, which a CUDA graph capture forbids).

On CUDA nearly every counted torch op is one kernel launch and every Triton launch is
one, so ``total`` predicts the kernel count of a graphed decode step; the CPU tests use it
to keep that count from creeping back up (every launch adds to the graphed step's time;
docs/measurements.md).

    with count_fast_runs(llm.runner.fast) as steps:
        llm.generate(...)
    steps[-1].total, steps[-1].torch_ops.most_common(5), steps[-1].triton, steps[-1].host_syncs
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

#: Ops that launch nothing (metadata, allocation) or are counted as host syncs.
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
         "_to_copy_noop", "is_nonzero", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size",
         "stride", "numel", "is_same_size", "resize_"}
_SYNC = {"_local_scalar_dense", "item"}


class LaunchCounter(TorchDispatchMode):
    """Context manager counting kernel-launching torch ops and Triton launches."""

    def __init__(self) -> None:
        super().__init__()
        self.torch_ops: Counter[str] = Counter()
        self.triton: Counter[str] = Counter()
        self.host_syncs = 0
        self._in_triton = 0  # the interpreter's own tensor copies are not the step's launches
        self._patched: list[tuple[Any, Any]] = []

    @contextmanager
    def skipping(self) -> Iterator[None]:
        """Count nothing inside (e.g. a graph replay, to count what a step launches outside its graphs)."""
        self._in_triton += 1
        try:
            yield
        finally:
            self._in_triton -= 1

    @property
    def total(self) -> int:
        return sum(self.torch_ops.values()) + sum(self.triton.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._schema.name.split("::")[-1]
        if self._in_triton:
            pass
        elif name in _SYNC:
            self.host_syncs += 1
        elif not (func.is_view or name in _FREE):
            self.torch_ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> LaunchCounter:
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit

        for cls in (jit.JITFunction, interp.InterpretedFunction):
            original = cls.run

            def run(fn_self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if not kwargs.get("warmup", False):
                    self.triton[getattr(fn_self, "__name__", None) or str(fn_self)] += 1
                self._in_triton += 1
                try:
                    return _original(fn_self, *args, **kwargs)
                finally:
                    self._in_triton -= 1

            cls.run = run
            self._patched.append((cls, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for cls, original in self._patched:
            cls.run = original
        self._patched.clear()
        super().__exit__(*exc)

    def summary(self, top: int = 12) -> dict:
        """JSON-ready counts."""
        return {"total": self.total, "torch_ops": sum(self.torch_ops.values()), "triton": sum(self.triton.values()),
                "host_syncs": self.host_syncs, "top_torch_ops": dict(self.torch_ops.most_common(top)),
                "triton_kernels": dict(self.triton)}


@contextmanager
def count_fast_runs(fast: Any) -> Iterator[list[LaunchCounter]]:
    """Within the block, every fast-path step (``fast.run``, or ``fast.run_graph`` when the
    runner calls that directly: the model + logits, graphed or eager; the sampler excluded)
    is counted into its own :class:`LaunchCounter`."""
    counters: list[LaunchCounter] = []
    active = [False]

    def wrap(method: Any) -> Any:
        def counted(so: Any, batch: Any) -> Any:
            if active[0]:  # run -> run_graph: one step, one counter
                return method(so, batch)
            counter, active[0] = LaunchCounter(), True
            try:
                with counter:
                    out = method(so, batch)
            finally:
                active[0] = False
            if out is not None:
                counters.append(counter)
            return out
        return counted

    fast.run, fast.run_graph = wrap(fast.run), wrap(fast.run_graph)
    try:
        yield counters
    finally:
        del fast.run, fast.run_graph  # the instance attributes; the methods show through again
