"""The one module that answers device questions: which device, which ``torch.distributed``
backend, how to synchronize, stream, query memory and capture graphs, and which kernel
implements each dispatched op. ``get_platform()`` picks CPU, NVIDIA (CUDA) or Ascend (NPU
through ``torch_npu``).

``torch_npu`` is imported in exactly one place, :func:`_import_torch_npu`, only when Ascend
is requested or an Ascend install is visible, and every failure (ImportError, OSError from
a missing CANN library, RuntimeError from a driver mismatch) is caught there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from deepinfer.errors import ConfigError
from deepinfer.platform_ops import (_ascend_fused_ops, ref_attention, ref_moe_gating, ref_rms_norm, ref_rope,
                                     reference_ops)

__all__ = ["Platform", "CpuPlatform", "CudaPlatform", "AscendPlatform", "NullStream", "NullEvent",
           "get_platform", "platform_for_device", "detect_accelerator", "reference_ops",
           "ref_rms_norm", "ref_rope", "ref_moe_gating", "ref_attention"]

#: Environment variables set by the CANN toolkit's set_env.sh (an Ascend install is present).
ASCEND_ENV_MARKERS: tuple[str, ...] = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
_ASCEND_HELP = ("install Huawei's Ascend CANN toolkit, load its environment "
                "(source /usr/local/Ascend/ascend-toolkit/set_env.sh) and run "
                "`pip install deepinfer[ascend]` (torch_npu matching this torch), "
                "or pick DEEPINFER_ACCELERATOR=cpu or nvidia")


# ---- CPU stand-ins for streams and events --------------------------------------------------
class NullEvent:
    """CPU stand-in for ``torch.cuda.Event``: records host time; waits are no-ops."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for: CPU work is already ordered."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end: NullEvent) -> float:
        """Milliseconds between this event's and ``end``'s ``record()``."""
        if self._t is None or end._t is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end._t - self._t) * 1000.0


class NullStream:
    """CPU stand-in for ``torch.cuda.Stream`` so async code is written once."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def record_event(self, event: NullEvent | None = None) -> NullEvent:
        event = event or NullEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True


# ---- platforms ---------------------------------------------------------------------------
class Platform:
    """Device facts and device services; subclasses override what differs."""

    name: str = "cpu"
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    kernel_backend: str = "torch"

    def device(self, index: int | None = None) -> torch.device:
        """The torch device; ``index=None`` is the process's current device."""
        return torch.device(self.device_type) if index is None else torch.device(self.device_type, index)

    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        """Make ``index`` the current device (no-op on CPU)."""

    def synchronize(self, device: Any = None) -> None:
        """Wait for all queued device work (no-op on CPU)."""

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """(free, total) bytes of host memory: psutil if installed, else /proc/meminfo."""
        try:
            import psutil
            vm = psutil.virtual_memory()
            return int(vm.available), int(vm.total)
        except ImportError:
            info: dict[str, int] = {}
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    info[key] = int(rest.split()[0]) * 1024
            return info.get("MemAvailable", info.get("MemFree", 0)), info.get("MemTotal", 0)

    def Stream(self, device: Any = None, priority: int = 0) -> Any:  # noqa: N802 (torch's name)
        return NullStream(device, priority)

    def Event(self, enable_timing: bool = False) -> Any:  # noqa: N802 (torch's name)
        return NullEvent(enable_timing)

    def current_stream(self) -> Any:
        return NullStream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context that makes ``stream`` current (``torch.cuda.stream`` equivalent)."""
        return contextlib.nullcontext(stream)

    @property
    def supports_graph_capture(self) -> bool:
        return False

    def new_graph(self) -> Any:
        """An empty device graph to capture into."""
        raise RuntimeError(f"graph capture is not available on the {self.name} platform")

    def graph_capture(self, graph: Any, pool: Any = None, stream: Any = None
                      ) -> contextlib.AbstractContextManager[Any]:
        """Context that records the enclosed device work into ``graph``."""
        raise RuntimeError(f"graph capture is not available on the {self.name} platform")

    def _kernel_ops(self) -> dict[str, Callable[..., Any]]:
        """Platform kernels that replace references (none by default)."""
        return {}

    def op(self, name: str) -> Callable[..., Any]:
        """The implementation of dispatched op ``name`` on this platform; resolve it once
        (at module construction), not per call."""
        ops = reference_ops()
        if name not in ops:
            raise KeyError(f"unknown op {name!r}; dispatched ops: {sorted(ops)}")
        return self._kernel_ops().get(name, ops[name])

    def op_sources(self) -> dict[str, str]:
        """Op name -> qualified name of the implementation ``op()`` returns."""
        return {n: getattr(self.op(n), "__qualname__", repr(self.op(n))) for n in reference_ops()}


class CpuPlatform(Platform):
    """Host-only execution: torch reference kernels, gloo for torch.distributed."""


class _AcceleratorPlatform(Platform):
    """A device reached through a ``torch.cuda``-shaped module (``torch.cuda``/``torch.npu``)."""

    def __init__(self, mod: Any) -> None:
        self._mod = mod

    def device_count(self) -> int:
        return int(self._mod.device_count())

    def set_device(self, index: int) -> None:
        self._mod.set_device(index)

    def synchronize(self, device: Any = None) -> None:
        self._mod.synchronize(device)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        free, total = self._mod.mem_get_info(device)
        return int(free), int(total)

    def Stream(self, device: Any = None, priority: int = 0) -> Any:  # noqa: N802
        return self._mod.Stream(device=device, priority=priority)

    def Event(self, enable_timing: bool = False) -> Any:  # noqa: N802
        return self._mod.Event(enable_timing=enable_timing)

    def current_stream(self) -> Any:
        return self._mod.current_stream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._mod.stream(stream)


class CudaPlatform(_AcceleratorPlatform):
    """NVIDIA GPUs: CUDA graphs, NCCL, Triton kernels where registered."""

    name, device_type, dist_backend = "nvidia", "cuda", "nccl"

    def __init__(self) -> None:
        super().__init__(torch.cuda)
        self.kernel_backend = "triton" if importlib.util.find_spec("triton") is not None else "torch"

    @property
    def supports_graph_capture(self) -> bool:
        return True

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def graph_capture(self, graph: Any, pool: Any = None, stream: Any = None
                      ) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.graph(graph, pool=pool, stream=stream)


class AscendPlatform(_AcceleratorPlatform):
    """Huawei Ascend NPUs through ``torch_npu``: HCCL, NPU graphs when torch_npu has them,
    torch_npu fused ops where the module exposes them (else the torch references)."""

    name, device_type, dist_backend, kernel_backend = "ascend", "npu", "hccl", "torch_npu"

    def __init__(self, torch_npu: ModuleType) -> None:
        super().__init__(getattr(torch, "npu"))  # registered on torch by `import torch_npu`
        self.torch_npu = torch_npu
        self._fused = _ascend_fused_ops(torch_npu)

    @property
    def supports_graph_capture(self) -> bool:
        return hasattr(self._mod, "NPUGraph")

    def new_graph(self) -> Any:
        if not self.supports_graph_capture:
            return super().new_graph()
        return self._mod.NPUGraph()

    def graph_capture(self, graph: Any, pool: Any = None, stream: Any = None
                      ) -> contextlib.AbstractContextManager[Any]:
        if not self.supports_graph_capture:
            return super().graph_capture(graph, pool, stream)
        if hasattr(self._mod, "graph"):
            return self._mod.graph(graph, pool=pool, stream=stream)
        return self._manual_capture(graph, pool, stream)

    @contextlib.contextmanager
    def _manual_capture(self, graph: Any, pool: Any, stream: Any) -> Iterator[Any]:
        """capture_begin/capture_end on a side stream, for torch_npu without ``torch.npu.graph``."""
        side = stream if stream is not None else self.Stream()
        with self.stream(side):
            graph.capture_begin(*(() if pool is None else (pool,)))
            try:
                yield graph
            finally:
                graph.capture_end()

    def _kernel_ops(self) -> dict[str, Callable[..., Any]]:
        return self._fused


# ---- selection ------------------------------------------------------------------------------
def _ascend_marker_present() -> bool:
    """True when an Ascend install is visible, judged WITHOUT importing torch_npu."""
    if any(os.environ.get(var) for var in ASCEND_ENV_MARKERS):
        return True
    if "torch_npu" in sys.modules:
        return sys.modules["torch_npu"] is not None
    try:
        return importlib.util.find_spec("torch_npu") is not None  # locates, does not execute
    except (ImportError, ValueError):
        return False


def _import_torch_npu() -> tuple[ModuleType | None, str]:
    """(torch_npu, "") or (None, why it failed). The only import of torch_npu in deepinfer."""
    try:
        import torch_npu
    except (ImportError, OSError, RuntimeError) as exc:  # OSError: CANN shared libraries missing
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return torch_npu, ""


def _npu_available() -> bool:
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except RuntimeError:
        return False


def detect_accelerator() -> str:
    """'nvidia' if CUDA is usable, else 'ascend' if an Ascend install imports and shows an
    NPU, else 'cpu'. torch_npu is never imported without an Ascend marker."""
    if torch.cuda.is_available():
        return "nvidia"
    if _ascend_marker_present() and _import_torch_npu()[0] is not None and _npu_available():
        return "ascend"
    return "cpu"


def get_platform(accelerator: str | None = None) -> Platform:
    """The platform for ``accelerator`` ('nvidia' | 'ascend' | 'cpu'; None/'auto' detects).

    Raises ConfigError naming what is missing when the requested accelerator is unusable.
    """
    acc = (accelerator or "auto").lower()
    if acc == "auto":
        acc = detect_accelerator()
    if acc == "cpu":
        return CpuPlatform()
    if acc == "nvidia":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU-only build" if torch.version.cuda is None
                   else "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
            raise ConfigError(
                f"accelerator 'nvidia' (DEEPINFER_ACCELERATOR=nvidia) needs CUDA, but "
                f"torch.cuda.is_available() is False: {why}; run DEEPINFER_ACCELERATOR=nvidia ./build.sh "
                "or pick DEEPINFER_ACCELERATOR=cpu", field="accelerator")
        return CudaPlatform()
    if acc == "ascend":
        mod, why = _import_torch_npu()
        if mod is None:
            raise ConfigError(
                "accelerator 'ascend' (DEEPINFER_ACCELERATOR=ascend) needs the torch_npu package, "
                f"which could not be imported ({why}); {_ASCEND_HELP}", field="accelerator")
        if not _npu_available():
            raise ConfigError(
                "accelerator 'ascend' (DEEPINFER_ACCELERATOR=ascend): torch_npu imported but "
                "torch.npu.is_available() is False, so no Ascend NPU is visible; check `npu-smi info`, "
                "ASCEND_RT_VISIBLE_DEVICES and the CANN driver", field="accelerator")
        return AscendPlatform(mod)
    raise ConfigError(f"accelerator must be one of 'nvidia', 'ascend', 'cpu', 'auto', got {accelerator!r}",
                      field="accelerator")


def platform_for_device(device: torch.device | str | Any) -> Platform:
    """The platform owning ``device`` (e.g. for memory queries on a tensor's device)."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return get_platform({"cuda": "nvidia", "npu": "ascend"}.get(kind, "cpu"))
