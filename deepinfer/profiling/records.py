"""Recording sweep results: the metadata beside every number, and the files.

Every result row carries the commit, hardware, device, dtype, context length (the
engine's ``max_model_len``; rows add their own prompt / context lengths) and the full
engine config. Files: ``<name>.csv`` (config as a JSON string column), ``<name>.json``
(``{"meta": ..., "rows": [...]}``), ``<name>_prefill.html`` / ``<name>_decode.html``
(plotly; PNG too when asked for and kaleido works).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import profiler as _autograd_profiler

from deepinfer import envs

if TYPE_CHECKING:
    import pandas as pd

# `llm` is a deepinfer.llm.LLM; not imported, not even for type checking: the engine reaches this module
# (spec.step_curve reads hardware names), so an import back would close a cycle (tests/test_import_cycles.py)

__all__ = ["git_commit", "hardware_name", "device_name", "run_metadata", "write_results", "torch_profiler_active"]

_REPO_ROOT = Path(__file__).resolve().parents[2]


def torch_profiler_active() -> bool:
    """True while a torch profiler is recording in this process."""
    return bool(getattr(_autograd_profiler, "_is_profiler_enabled", False))


def git_commit(root: str | os.PathLike[str] = _REPO_ROOT) -> tuple[str, bool]:
    """(HEAD commit, whether the work tree has uncommitted changes). Outside a git checkout
    (e.g. a copied tree on a remote machine) ``GIT_COMMIT`` / ``GIT_DIRTY=1`` tell them,
    else ("unknown", False)."""
    if envs.DEEPINFER_COMMIT:  # set by whoever sent a copied tree (its .git may be stale)
        return envs.DEEPINFER_COMMIT, os.environ.get("GIT_DIRTY") == "1"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10, check=True).stdout
        return head, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("GIT_COMMIT", "unknown"), os.environ.get("GIT_DIRTY") == "1"


def hardware_name() -> str:
    """The CPU model (``platform.processor()``, else /proc/cpuinfo) and core count."""
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name or platform.machine()} x{os.cpu_count()}"


def device_name(device: torch.device) -> str:
    """The accelerator's name (``torch.cuda.get_device_name``) or ``cpu``."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def result_tag(hardware: str) -> str:
    """The hardware part of a result file's name: ``h200`` for any H200, ``cpu``, else the
    device name in lower case with underscores (``nvidia_h100_80gb_hbm3``)."""
    if "H200" in hardware:
        return "h200"
    return "cpu" if hardware == "cpu" else hardware.replace(" ", "_").lower()


def run_metadata(llm: Any, **extra: Any) -> dict[str, Any]:
    """Everything that has to sit beside a measured number."""
    commit, dirty = git_commit()
    mcfg = llm.model_config
    now = _dt.datetime.now(_dt.timezone.utc)
    device = device_name(llm.device)
    model = os.path.basename(os.path.normpath(llm.model_dir))
    meta: dict[str, Any] = {
        "commit": commit, "dirty": dirty, "hardware": hardware_name(), "device": device, "num_devices": 1,
        "torch": torch.__version__, "python": platform.python_version(), "dtype": str(llm.model.dtype).split(".")[-1],
        "max_model_len": llm.config.max_model_len, "model": model, "model_dir": str(llm.model_dir),
        "model_config": {k: getattr(mcfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                       "head_dim", "n_routed_experts", "num_experts_per_tok",
                                                       "vocab_size") if hasattr(mcfg, k)},
        "num_params": int(sum(p.numel() for p in llm.model.parameters())),
        "engine_config": llm.config.to_dict(), "timestamp": now.isoformat(timespec="seconds"),
        "default_name": f"{model}-{device.replace(' ', '_')}-{now.strftime('%Y%m%d-%H%M%S')}",
    }
    meta.update(extra)
    return meta


def save_json(out_dir: str | os.PathLike[str], name: str, record: dict[str, Any]) -> str:
    """Write one run's record as ``out_dir/name`` (indented JSON, the folder made), print and
    return its path: the last line of every profiling script."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(path)
    return path


def write_results(df: pd.DataFrame, meta: dict[str, Any], figures: dict[str, Any], out_dir: str, name: str,
                  png: bool = False) -> dict[str, str]:
    """Write CSV, JSON and chart HTML, and PNG when ``png`` (opt-in: kaleido starts a headless
    chromium per figure, seconds each; ``deepinfer.workbench.export`` exports any figure)."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    paths = {"csv": base + ".csv", "json": base + ".json"}
    df.to_csv(paths["csv"], index=False)
    rows = json.loads(df.to_json(orient="records"))
    for row in rows:
        row["engine_config"] = json.loads(row["engine_config"])
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    for key, fig in figures.items():
        paths[f"{key}_html"] = f"{base}_{key}.html"
        fig.write_html(paths[f"{key}_html"], include_plotlyjs="cdn")
        if png:
            try:
                fig.write_image(f"{base}_{key}.png", width=900, height=560)
                paths[f"{key}_png"] = f"{base}_{key}.png"
            except Exception as e:  # kaleido needs a browser; HTML stays the record
                meta.setdefault("warnings", []).append(f"PNG export of {key} chart failed: {e}")
    return paths
