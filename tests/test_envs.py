"""deepinfer.envs: every DEEPINFER_* variable declared once, strict parsing, aliases, and
every entry point knowing every variable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError
from deepinfer.models.bounded_replay import DEFAULT_KEEP, ReplayConfig

ROOT = Path(__file__).resolve().parents[1]
#: where the engine, its kernels, benchmarks and scripts read variables
READERS = ("deepinfer", "deepinfer_kernels", "benchmarks", "profiling", "scripts", "examples", "build.sh", "Makefile")
NAME = re.compile(r"\bDEEPINFER_[A-Z0-9_]+")


def _read_names() -> dict[str, str]:
    """Every DEEPINFER_* name written in the readers' sources -> a file that names it."""
    found: dict[str, str] = {}
    for top in READERS:
        path = ROOT / top
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in (".py", ".sh")]
        for f in files:
            for name in NAME.findall(f.read_text(errors="replace")):
                if not name.endswith("_"):  # a prefix in prose, e.g. DEEPINFER_EPLB_*
                    found.setdefault(name, str(f.relative_to(ROOT)))
    return found


def test_every_variable_read_anywhere_is_declared() -> None:
    names = _read_names()
    assert "DEEPINFER_FP8_GEMM" in names and "DEEPINFER_TORCH_SPEC" in names  # the scan sees .py and .sh
    missing = {n: f for n, f in names.items() if n not in envs.KNOWN_ENV_VARS}
    assert not missing, f"declare these in deepinfer/envs.py: {missing}"


def test_declarations_are_complete() -> None:
    for var in envs.ENV_VARS.values():
        assert var.name.startswith("DEEPINFER_") and var.description and var.type
        assert all(a.startswith("DEEPINFER_") and a not in envs.ENV_VARS for a in var.aliases)
        if var.default is not None:  # a default is a value the parser gives back
            raw = str(int(var.default)) if isinstance(var.default, bool) else str(var.default)
            assert var.parse(raw) == var.default, var.name


def test_get_parses_strictly_and_defaults() -> None:
    assert envs.get("DEEPINFER_FP8_GEMM", {}) == "auto"
    assert envs.get("DEEPINFER_FP8_GEMM", {"DEEPINFER_FP8_GEMM": " Dequant"}) == "dequant"
    assert envs.get("DEEPINFER_EP_TIMING", {"DEEPINFER_EP_TIMING": "true"}) is True
    assert envs.get("DEEPINFER_DIST_TIMEOUT_S", {"DEEPINFER_DIST_TIMEOUT_S": "2.5"}) == 2.5
    assert envs.get("DEEPINFER_CACHE_DIR", {}).endswith(os.path.join(".cache", "deepinfer"))
    for name, raw, allowed in [("DEEPINFER_FP8_GEMM", "dense", "auto, triton, ref, dequant"),
                               ("DEEPINFER_EPLB_WINDOW_SIZE", "0", "an integer >= 1"),
                               ("DEEPINFER_DIST_TIMEOUT_S", "nan", "a number > 0"),
                               ("DEEPINFER_EP_TIMING", "yes", "0, 1, true, false")]:
        with pytest.raises(ConfigError, match=f"{name}={raw!r} is invalid; allowed: {allowed}") as info:
            envs.get(name, {name: raw})
        assert info.value.field == name
    with pytest.raises(KeyError, match="not declared"):
        envs.get("DEEPINFER_NOPE", {})


def test_module_attributes_read_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_MOE_W8A8", "1")
    assert envs.DEEPINFER_MOE_W8A8 == "1"
    monkeypatch.delenv("DEEPINFER_MOE_W8A8")
    assert envs.DEEPINFER_MOE_W8A8 == "auto"
    with pytest.raises(AttributeError):
        envs.DEEPINFER_NOPE  # noqa: B018


def test_deepinfer_names_for_bounded_replay_and_their_aliases() -> None:
    assert ReplayConfig.resolve({}, {}) == ReplayConfig("off", DEFAULT_KEEP) and DEFAULT_KEEP == 140
    new = {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "150"}
    old = {"DEEPINFER_SWA_REPLAY_MODE": "compact", "DEEPINFER_SWA_REPLAY_KEEP": "150"}
    assert ReplayConfig.resolve({}, new) == ReplayConfig.resolve({}, old) == ReplayConfig("compact", 150)
    assert ReplayConfig.resolve({}, {**new, **old}) == ReplayConfig("compact", 150)  # agreeing: fine
    assert ReplayConfig.resolve({"swa_replay_mode": "mask"}, new).mode == "mask"  # kwargs win
    for alias, value in [("DEEPINFER_SWA_REPLAY_MODE", "mask"), ("DEEPINFER_SWA_REPLAY_KEEP", "141")]:
        with pytest.raises(ConfigError) as info:
            ReplayConfig.resolve({}, {**new, alias: value})
        canonical = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE" if "MODE" in alias else "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"
        assert canonical in str(info.value) and alias in str(info.value)
    with pytest.raises(ConfigError, match="DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE='truncate'.*off, mask, compact"):
        ReplayConfig.resolve({}, {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "truncate"})


def test_engine_config_accepts_declared_names_and_aliases() -> None:
    assert envs.unknown({"DEEPINFER_SWA_REPLAY_KEEP": "1", "DEEPINFER_TORCH_SPEC": "torch", "DEEPINFER_X": "1"}) \
        == ["DEEPINFER_X"]
    EngineConfig.from_kwargs(environ={"DEEPINFER_SWA_REPLAY_MODE": "compact", "DEEPINFER_EP_TIMING": "1",
                                      "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "200"})


def test_deepinfer_config_knows_every_variable() -> None:
    """The issue's repro: `DEEPINFER_SWA_REPLAY_MODE=compact deepinfer config` (a fresh process,
    so no module that used to register a variable was imported first)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env = {**base, "DEEPINFER_ACCELERATOR": "cpu", "DEEPINFER_SWA_REPLAY_MODE": "compact",
           "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "150", "DEEPINFER_SPEC_STEP_CURVE": "profile",
           "DEEPINFER_EPLB_POLICY": "global", "DEEPINFER_MOE_W8A8": "0"}
    proc = subprocess.run([sys.executable, "-m", "deepinfer.cli", "config"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE\s+'compact'\s+DEEPINFER_SWA_REPLAY_MODE", proc.stdout)
    assert re.search(r"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS\s+150", proc.stdout)
    env["DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"] = "mask"
    proc = subprocess.run([sys.executable, "-m", "deepinfer.cli", "config"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE='mask'" in proc.stderr and "DEEPINFER_SWA_REPLAY_MODE" in proc.stderr
