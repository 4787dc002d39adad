"""deepinfer.platform: selection, device services, op dispatch and the clear errors.

Ascend is exercised through a fake ``torch_npu`` (a module in ``sys.modules`` whose fused
ops follow torch_npu's documented semantics in plain torch) plus a fake ``torch.npu``
namespace; nothing here needs CANN or an NPU.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import deepinfer.platform as plat
from deepinfer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
OPS = ("rms_norm", "rope", "moe_gating", "attention")
REAL_TORCH_NPU = plat._ascend_marker_present() and "torch_npu" not in sys.modules


# ---- fakes ----------------------------------------------------------------------------------
def fake_torch_npu(ops: tuple[str, ...] = OPS, old_scale_name: bool = False) -> types.ModuleType:
    """A torch_npu stand-in whose fused ops compute the documented math on CPU; ``calls``
    counts how often each was used."""
    mod = types.ModuleType("torch_npu")
    mod.calls = Counter()  # type: ignore[attr-defined]

    def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
        mod.calls["rms_norm"] += 1
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
        return x * rstd * gamma, rstd

    def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"):
        mod.calls["rope"] += 1
        assert x.dim() == 4 and rotary_mode == "half"
        x1, x2 = x.chunk(2, dim=-1)
        return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)

    def npu_moe_gating_top_k_softmax(x: torch.Tensor, finished: Any = None, k: int = 1):
        mod.calls["moe_gating"] += 1
        y, idx = torch.topk(x.softmax(-1), k, dim=-1)
        return y, idx.int(), torch.arange(x.shape[0] * k).reshape(k, -1).t()

    def npu_fused_infer_attention_score(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                        atten_mask: torch.Tensor, num_heads: int, num_key_value_heads: int,
                                        input_layout: str, softmax_lse_flag: bool, **kw: Any):
        if old_scale_name and "scale" in kw:
            raise TypeError("unexpected keyword argument 'scale'")
        mod.calls["attention"] += 1
        assert input_layout == "BSND" and softmax_lse_flag and query.shape[2] == num_heads
        rep = num_heads // num_key_value_heads
        q = query.float().transpose(1, 2)
        k, v = (t.float().transpose(1, 2).repeat_interleave(rep, 1) for t in (key, value))
        s = (q @ k.transpose(-1, -2)) * kw.get("scale", kw.get("scale_value"))
        s = s.masked_fill(atten_mask.bool(), float("-inf"))
        out = (s.softmax(-1) @ v).transpose(1, 2).to(query.dtype)
        return out, torch.logsumexp(s, -1, keepdim=True)  # lse: [B, N, S, 1]

    for name, fn in [("rms_norm", npu_rms_norm), ("rope", npu_rotary_mul),
                     ("moe_gating", npu_moe_gating_top_k_softmax),
                     ("attention", npu_fused_infer_attention_score)]:
        if name in ops:
            setattr(mod, fn.__name__, fn)
    return mod


class FakeNPUGraph:
    def __init__(self) -> None:
        self.events: list[str] = []

    def capture_begin(self, *pool: Any) -> None:
        self.events.append("begin")

    def capture_end(self) -> None:
        self.events.append("end")


def fake_torch_dot_npu(available: bool = True, graphs: bool = True, graph_ctx: bool = True) -> Any:
    """A ``torch.npu`` namespace as torch_npu registers it."""
    ns = types.SimpleNamespace(log=[])
    ns.is_available = lambda: available
    ns.device_count = lambda: 2
    ns.set_device = lambda i: ns.log.append(("set_device", i))
    ns.synchronize = lambda device=None: ns.log.append(("synchronize", device))
    ns.mem_get_info = lambda device=None: (60 << 30, 64 << 30)
    ns.Stream = lambda device=None, priority=0: ("npu-stream", device, priority)
    ns.Event = lambda enable_timing=False: ("npu-event", enable_timing)
    ns.current_stream = lambda: "npu-current"
    ns.stream = lambda s: contextlib.nullcontext(s)
    if graphs:
        ns.NPUGraph = FakeNPUGraph
    if graphs and graph_ctx:
        @contextlib.contextmanager
        def graph(g: Any, pool: Any = None, stream: Any = None) -> Iterator[Any]:
            ns.log.append(("graph", pool, stream))
            yield g
        ns.graph = graph
    return ns


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def ascend(monkeypatch: pytest.MonkeyPatch, no_cuda: None) -> tuple[types.ModuleType, Any]:
    mod, ns = fake_torch_npu(), fake_torch_dot_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setattr(torch, "npu", ns, raising=False)
    return mod, ns


class _BrokenFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import torch_npu`` find a module whose import raises ``exc`` (as a torch_npu
    wheel does without CANN's shared libraries)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.machinery.ModuleSpec(name, self) if name == "torch_npu" else None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        raise self.exc


def _broken(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenFinder(exc)] + sys.meta_path)


# ---- CPU --------------------------------------------------------------------------------------
def test_cpu_platform() -> None:
    p = plat.get_platform("cpu")
    assert isinstance(p, plat.CpuPlatform)
    assert (p.name, p.device_type, p.dist_backend, p.kernel_backend) == ("cpu", "cpu", "gloo", "torch")
    assert p.device() == torch.device("cpu") and p.device_count() == 1
    free, total = p.mem_get_info()
    assert 0 < free <= total
    assert not p.supports_graph_capture
    with pytest.raises(RuntimeError, match="not available on the cpu"):
        p.graph_capture(None)
    s, e0, e1 = p.Stream(), p.Event(enable_timing=True), p.Event(enable_timing=True)
    e0.record(s)
    with p.stream(s):
        s.wait_stream(p.current_stream())
        s.wait_event(e0)
    s.record_event(e1)
    p.synchronize()
    assert e0.query() and s.query() and e1.elapsed_time(e1) == 0.0 and e0.elapsed_time(e1) >= 0
    assert all(p.op(n) is plat.reference_ops()[n] for n in OPS)
    with pytest.raises(KeyError, match="unknown op"):
        p.op("flash")


def test_cpu_memory_without_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo")
    monkeypatch.setitem(sys.modules, "psutil", None)
    free, total = plat.CpuPlatform().mem_get_info()
    assert 0 < free <= total


def test_reference_ops_match_the_model_modules() -> None:
    from deepinfer.models.moe import Gate
    from deepinfer.models.norm import RMSNorm
    norm = RMSNorm(64, 1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(plat.ref_rms_norm(x, norm.weight, norm.eps), norm(x))
    gate = Gate(32, 8, 2, False, 100, "sqrtsoftplus", 1.5, True, torch.float32)
    torch.nn.init.normal_(gate.weight)
    torch.nn.init.normal_(gate.bias)
    h = torch.randn(6, 32)
    want = gate(h, torch.zeros(6, dtype=torch.long))
    got = plat.ref_moe_gating(h @ gate.weight.t(), gate.bias, 2, "sqrtsoftplus", True, 1.5)
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0])


# ---- Ascend selection, services and errors ------------------------------------------------
def test_ascend_selected_with_fake_torch_npu(ascend: tuple[types.ModuleType, Any]) -> None:
    from deepinfer.config import EngineConfig
    _, ns = ascend
    assert plat.detect_accelerator() == "ascend" and EngineConfig().accelerator == "ascend"
    p = plat.get_platform()
    assert isinstance(p, plat.AscendPlatform)
    assert (p.name, p.device_type, p.dist_backend, p.kernel_backend) == ("ascend", "npu", "hccl", "torch_npu")
    assert p.device_count() == 2 and p.mem_get_info() == (60 << 30, 64 << 30)
    p.set_device(1)
    p.synchronize()
    assert ns.log == [("set_device", 1), ("synchronize", None)]
    assert p.Stream()[0] == "npu-stream" and p.Event(True) == ("npu-event", True)
    assert p.current_stream() == "npu-current"
    assert plat.platform_for_device(types.SimpleNamespace(type="npu")).name == "ascend"


def test_ascend_graph_capture(monkeypatch: pytest.MonkeyPatch, ascend: tuple[types.ModuleType, Any]) -> None:
    p = plat.get_platform("ascend")
    assert p.supports_graph_capture
    g = p.new_graph()
    with p.graph_capture(g, pool="pool", stream="s") as captured:
        assert captured is g
    assert torch.npu.log[-1] == ("graph", "pool", "s")
    monkeypatch.setattr(torch, "npu", fake_torch_dot_npu(graph_ctx=False))  # NPUGraph, no torch.npu.graph
    p = plat.get_platform("ascend")
    g = p.new_graph()
    with p.graph_capture(g):
        assert g.events == ["begin"]
    assert g.events == ["begin", "end"]
    monkeypatch.setattr(torch, "npu", fake_torch_dot_npu(graphs=False))
    p = plat.get_platform("ascend")
    assert not p.supports_graph_capture
    with pytest.raises(RuntimeError, match="graph capture is not available on the ascend"):
        p.new_graph()


def _assert_clear_ascend_error(info: pytest.ExceptionInfo[ConfigError], cause: str) -> None:
    msg = str(info.value)
    assert info.value.field == "accelerator" and "\n" not in msg
    for part in ("torch_npu", "CANN", "pip install deepinfer[ascend]", cause):
        assert part in msg, (part, msg)
    assert info.value.__context__ is None  # no chained ImportError traceback


def test_ascend_missing_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` -> ImportError
    with pytest.raises(ConfigError) as info:
        plat.get_platform("ascend")
    _assert_clear_ascend_error(info, "ModuleNotFoundError")


@pytest.mark.parametrize("exc", [ImportError("torch_npu built for another torch"),
                                 OSError("libascendcl.so: cannot open shared object file"),
                                 RuntimeError("CANN version mismatch")])
def test_ascend_broken_install_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, no_cuda: None,
                                                exc: BaseException) -> None:
    _broken(monkeypatch, exc)
    assert plat.detect_accelerator() == "cpu"  # auto-detection survives a broken torch_npu
    with pytest.raises(ConfigError) as info:
        plat.get_platform("ascend")
    _assert_clear_ascend_error(info, f"{type(exc).__name__}: {exc}")


def test_ascend_without_visible_npu(monkeypatch: pytest.MonkeyPatch, ascend: tuple[types.ModuleType, Any]) -> None:
    monkeypatch.setattr(torch, "npu", fake_torch_dot_npu(available=False))
    assert plat.detect_accelerator() == "cpu"
    with pytest.raises(ConfigError, match=r"torch.npu.is_available\(\) is False"):
        plat.get_platform("ascend")


@pytest.mark.skipif(REAL_TORCH_NPU, reason="a real torch_npu is installed here")
def test_auto_detect_never_imports_torch_npu_without_a_marker(monkeypatch: pytest.MonkeyPatch,
                                                              no_cuda: None) -> None:
    for var in plat.ASCEND_ENV_MARKERS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(plat, "_import_torch_npu", lambda: pytest.fail("torch_npu import attempted"))
    assert plat.detect_accelerator() == "cpu" and plat.get_platform().name == "cpu"


def test_nvidia_without_cuda_is_a_clear_error(no_cuda: None) -> None:
    with pytest.raises(ConfigError, match=r"needs CUDA, but torch.cuda.is_available\(\) is False") as info:
        plat.get_platform("nvidia")
    assert info.value.field == "accelerator"
    with pytest.raises(ConfigError, match="one of 'nvidia', 'ascend', 'cpu', 'auto'"):
        plat.get_platform("tpu")


def test_kv_budget_queries_npu_memory(ascend: tuple[types.ModuleType, Any]) -> None:
    from deepinfer.config import EngineConfig
    from deepinfer.engine.kv_sizing import kv_budget_bytes
    budget = int((64 << 30) * 0.9) - (4 << 30)
    got = kv_budget_bytes(EngineConfig(accelerator="cpu"), types.SimpleNamespace(type="npu"), 0)
    assert got == budget - max(1 << 30, budget // 10)


# ---- dispatch -------------------------------------------------------------------------------
def test_dispatch_picks_the_fused_adapters(ascend: tuple[types.ModuleType, Any]) -> None:
    mod, _ = ascend
    p = plat.get_platform("ascend")
    assert p.op_sources() == {n: f"_ascend_fused_ops.<locals>.npu_{n}" for n in OPS}
    ref = plat.reference_ops()
    x, w = torch.randn(4, 3, 64), torch.randn(64)
    assert torch.allclose(p.op("rms_norm")(x, w, 1e-6), ref["rms_norm"](x, w, 1e-6), atol=1e-6)
    xb = torch.randn(5, 4, 48, dtype=torch.bfloat16)
    cos, sin = torch.randn(5, 8).cos(), torch.randn(5, 8).sin()
    assert torch.equal(p.op("rope")(xb, cos, sin), ref["rope"](xb, cos, sin))
    assert torch.equal(p.op("rope")(xb[:, 0], cos, sin), ref["rope"](xb[:, 0], cos, sin))
    logits = torch.randn(6, 16)
    w_got, id_got = p.op("moe_gating")(logits, None, 3, "softmax", True, 2.0)
    w_ref, id_ref = ref["moe_gating"](logits, None, 3, "softmax", True, 2.0)
    order_got, order_ref = id_got.sort(-1), id_ref.sort(-1)  # top-k order is free
    assert id_got.dtype == torch.int64 and torch.equal(order_got.values, order_ref.values)
    assert torch.allclose(w_got.gather(1, order_got.indices), w_ref.gather(1, order_ref.indices))
    q, kv = torch.randn(5, 4, 32, dtype=torch.bfloat16), torch.randn(9, 32, dtype=torch.bfloat16)
    mask, sink = torch.rand(5, 9) < 0.7, torch.randn(4)
    mask[:, 0] = True
    got, want = p.op("attention")(q, kv, mask, sink, 32 ** -0.5), ref["attention"](q, kv, mask, sink, 32 ** -0.5)
    assert got.dtype == want.dtype and torch.allclose(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert mod.calls == Counter({n: 1 for n in OPS}) + Counter(rope=1)


def test_dispatch_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch,
                                              ascend: tuple[types.ModuleType, Any]) -> None:
    mod, _ = ascend
    p = plat.get_platform("ascend")
    bias, logits = torch.randn(16), torch.randn(6, 16)
    for args in [(bias, 2, "softmax"), (None, 2, "sqrtsoftplus")]:  # V4's gate is not fused
        assert torch.equal(p.op("moe_gating")(logits, *args, True, 1.0)[1],
                           plat.ref_moe_gating(logits, *args, True, 1.0)[1])
    q, kv, mask = torch.randn(3, 2, 8), torch.randn(4, 8), torch.ones(3, 4, dtype=torch.bool)
    assert torch.equal(p.op("attention")(q, kv, mask, torch.zeros(2), 0.3),
                       plat.ref_attention(q, kv, mask, torch.zeros(2), 0.3))  # float32: reference
    assert mod.calls == Counter()
    old = fake_torch_npu(ops=("attention",), old_scale_name=True)  # scale_value, no other fused op
    monkeypatch.setitem(sys.modules, "torch_npu", old)
    p = plat.get_platform("ascend")
    assert [n for n, src in p.op_sources().items() if "npu_" in src] == ["attention"]
    qb, kvb = q.bfloat16(), kv.bfloat16()
    assert p.op("attention")(qb, kvb, mask, torch.zeros(2), 0.3).shape == qb.shape
    assert old.calls == Counter(attention=1)


# ---- torch_npu stays behind the platform ----------------------------------------------------
def _torch_npu_imports(tree: ast.AST) -> list[tuple[ast.AST, list[ast.AST]]]:
    """(node, ancestors) for every import of torch_npu, static or through importlib/__import__."""
    found: list[tuple[ast.AST, list[ast.AST]]] = []

    def visit(node: ast.AST, parents: list[ast.AST]) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            if func.endswith("import_module") or func == "__import__":
                names = [str(node.args[0].value)]
        if any(n == "torch_npu" or n.startswith("torch_npu.") for n in names):
            found.append((node, parents))
        for child in ast.iter_child_nodes(node):
            visit(child, parents + [node])

    visit(tree, [])
    return found


def test_only_platform_imports_torch_npu_inside_a_guard() -> None:
    hits: dict[str, int] = {}
    for path in sorted((ROOT / "deepinfer").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node, parents in _torch_npu_imports(ast.parse(path.read_text(encoding="utf-8"))):
            assert rel == "deepinfer/platform.py", f"{rel}:{node.lineno} imports torch_npu"
            assert any(isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)) for p in parents), \
                f"{rel}:{node.lineno} imports torch_npu at module level"
            guards = [p for p in parents if isinstance(p, ast.Try) and any(node in ast.walk(b) for b in p.body)]
            caught = {ast.unparse(h.type) for g in guards for h in g.handlers if h.type is not None}
            assert all(e in " ".join(caught) for e in ("ImportError", "OSError")), \
                f"{rel}:{node.lineno}: torch_npu import not guarded for ImportError and OSError"
            hits[rel] = hits.get(rel, 0) + 1
    assert hits == {"deepinfer/platform.py": 1}


def _run(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "ASCEND_"))}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.skipif(REAL_TORCH_NPU, reason="a real torch_npu is installed here")
def test_llm_with_ascend_and_no_torch_npu_fails_fast() -> None:
    proc = _run("from deepinfer import LLM; LLM()", {"DEEPINFER_ACCELERATOR": "ascend"}, timeout=60)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0
    assert last.startswith("deepinfer.errors.ConfigError: accelerator 'ascend'"), proc.stderr
    for part in ("torch_npu", "CANN", "pip install deepinfer[ascend]"):
        assert part in last
    assert "Traceback" in proc.stderr and "During handling" not in proc.stderr


FAKE_MODULE = '''
import types, torch
torch.utils.rename_privateuse1_backend("npu")
torch.npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1)
'''


def test_installed_fake_torch_npu(tmp_path: Path) -> None:
    """A findable torch_npu is imported by auto-detection and gives 'npu' devices, but an
    explicit cpu engine never imports it."""
    (tmp_path / "torch_npu.py").write_text(FAKE_MODULE, encoding="utf-8")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "CUDA_VISIBLE_DEVICES": ""}
    proc = _run("import sys, torch; from deepinfer.config import EngineConfig; "
                "from deepinfer.platform import get_platform; p = get_platform(); "
                "assert 'torch_npu' in sys.modules and EngineConfig().accelerator == 'ascend'; "
                "assert p.device(0) == torch.device('npu', 0) and p.device().type == 'npu'; print('ok')",
                env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    proc = _run("import sys, deepinfer.llm, deepinfer.engine.kv_sizing, deepinfer.models.v4.model; "
                "from deepinfer.config import EngineConfig; from deepinfer.platform import get_platform; "
                "EngineConfig.from_kwargs(); get_platform('cpu').op('rms_norm'); "
                "assert 'torch_npu' not in sys.modules; print('ok')",
                {**env, "DEEPINFER_ACCELERATOR": "cpu"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
