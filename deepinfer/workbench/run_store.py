"""A run store: every sweep, panel point and benchmark run saved with what has to sit beside
its numbers (commit, dirty tree, hardware, device, dtype, the full engine config, the
workload), so two runs from different days or machines can be loaded and overlaid.

One run is one JSON file under the store's folder (default ``artifacts/runs``):
``{"id", "kind", "name", "meta", "workload", "summary", "tables": {name: records}}``.
Tables are the engine's own frames (``llm.metrics.requests_df()``, ``steps_df()``,
``itl_df()``) or a sweep's rows, kept whole so CDFs and time series can be redrawn.

    store = RunStore()
    run = store.save_llm(llm, kind="panel", name="seqs=4", workload="datasets/workloads/tiny_chat.jsonl")
    store.index()                             # one row per saved run
    a, b = (store.load(i) for i in store.ids()[-2:])
    latency_cdf_figure({a.label: a.tables["requests"], b.label: b.tables["requests"]}, "ttft_s")
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from deepinfer.profiling.records import run_metadata

__all__ = ["RunStore", "SavedRun"]

_KIND = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def _jsonable(value: Any) -> Any:
    """JSON-safe copy: numpy scalars to Python, NaN / inf to None (JSON has neither)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


@dataclass
class SavedRun:
    """One run as loaded back: metadata, workload, headline numbers and its tables."""

    id: str
    kind: str
    name: str
    meta: dict[str, Any]
    workload: Any
    summary: dict[str, Any]
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    path: str = ""

    @property
    def label(self) -> str:
        """A short name for legends: the run name, commit and device."""
        return f"{self.name} @{str(self.meta.get('commit', '?'))[:7]} {self.meta.get('device', '')}".strip()


class RunStore:
    """Saved runs in one folder (created on first save)."""

    def __init__(self, root: str | os.PathLike[str] = "artifacts/runs") -> None:
        self.root = os.fspath(root)

    def save(self, kind: str, name: str, meta: dict[str, Any], tables: dict[str, pd.DataFrame] | None = None,
             summary: dict[str, Any] | None = None, workload: Any = None) -> SavedRun:
        """Write one run; ``kind`` names where it came from (``sweep``, ``panel``, ``bench``...)."""
        if not _KIND.fullmatch(kind):
            raise ValueError(f"kind={kind!r}: must match {_KIND.pattern} (e.g. 'sweep', 'panel', 'bench')")
        for key in ("commit", "hardware", "engine_config"):
            if key not in meta:
                raise ValueError(f"meta has no {key!r}: pass deepinfer.profiling.records.run_metadata(llm)")
        os.makedirs(self.root, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = f"{stamp}-{kind}-{re.sub(r'[^A-Za-z0-9_.=-]+', '_', name)[:60]}"
        run_id, n = base, 1
        while os.path.exists(os.path.join(self.root, f"{run_id}.json")):
            n += 1
            run_id = f"{base}-{n}"
        tables = dict(tables or {})
        body = {"id": run_id, "kind": kind, "name": name, "meta": _jsonable(meta), "workload": _jsonable(workload),
                "summary": _jsonable(summary or {}),
                "tables": {k: _jsonable(df.to_dict(orient="records")) for k, df in tables.items()}}
        path = os.path.join(self.root, f"{run_id}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, path)  # a reader never sees half a run
        return SavedRun(run_id, kind, name, body["meta"], body["workload"], body["summary"], tables, path)

    def save_llm(self, llm: Any, kind: str, name: str, workload: Any = None, **extra: Any) -> SavedRun:
        """Save what ``llm.metrics`` holds now (requests, steps, per-token ITL, summary)
        with :func:`~deepinfer.profiling.records.run_metadata` of ``llm``."""
        m = llm.metrics
        tables = {"requests": m.requests_df(), "steps": m.steps_df(), "itl": m.itl_df()}
        return self.save(kind, name, run_metadata(llm, **extra), tables, m.summary(), workload)

    def ids(self) -> list[str]:
        """Saved run ids, oldest first."""
        if not os.path.isdir(self.root):
            return []
        return sorted(f[:-5] for f in os.listdir(self.root) if f.endswith(".json"))

    def load(self, run_id: str) -> SavedRun:
        """One saved run with its tables as DataFrames."""
        path = os.path.join(self.root, f"{run_id}.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no run {run_id!r} in {self.root} (saved: {self.ids()[-5:]})")
        with open(path) as f:
            body = json.load(f)
        tables = {k: pd.DataFrame(v) for k, v in body.get("tables", {}).items()}
        return SavedRun(body["id"], body["kind"], body["name"], body["meta"], body.get("workload"),
                        body.get("summary", {}), tables, path)

    def index(self) -> pd.DataFrame:
        """One row per saved run: id, kind, name, commit, dirty, device, dtype, timestamp and
        the headline numbers when the run has them."""
        rows = []
        for run_id in self.ids():
            r = self.load(run_id)
            rows.append({"id": r.id, "kind": r.kind, "name": r.name, "commit": str(r.meta.get("commit", ""))[:10],
                         "dirty": r.meta.get("dirty"), "device": r.meta.get("device"), "dtype": r.meta.get("dtype"),
                         "timestamp": r.meta.get("timestamp"),
                         **{k: r.summary.get(k) for k in ("output_tok_per_s", "p50_ttft_ms", "p50_tpot_ms")
                            if k in r.summary}})
        return pd.DataFrame(rows)
