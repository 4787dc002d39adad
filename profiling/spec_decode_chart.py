"""Decode chart of the trained default model with speculation off / MTP / DSpark fixed /
DSpark scheduled (issue 14): tokens/s per user vs per device at batch 1, 16, 64, both from
the measured effective tokens per step (accepted drafts + 1).

    python profiling/spec_decode_chart.py [--batches 1,16,64] [--out-dir profiling/results]

One engine per configuration, each through `run_sweep` (decode points only), so the
numbers are the sweep's: steady-state decode steps, host clocks, profiler off. Writes
<name>.csv / .json and the combined decode chart (HTML) under --out-dir; prints a short
table last. Runs on CPU too (the configurations then take minutes, not seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import pandas as pd

from deepinfer.profiling import records
from deepinfer.profiling.sweep import SweepSpec, run_sweep

CONFIGS = {  # label -> (model, engine kwargs)
    "off": ("deepinfer-tiny", {}),
    "mtp-k3": ("deepinfer-tiny", {"num_speculative_tokens": 3}),
    "dspark-k5-fixed": ("deepinfer-tiny-dspark", {"num_speculative_tokens": 5}),
    "dspark-k5-scheduled": ("deepinfer-tiny-dspark", {"num_speculative_tokens": 5, "enable_mtp_varlen": True}),
}


def decode_chart(df: pd.DataFrame, hardware: str):
    """One tok/s-per-user vs tok/s-per-device line per configuration (a plotly Figure)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for label, d in df.groupby("config", sort=False):
        d = d.sort_values("batch_size")
        fig.add_trace(go.Scatter(x=d["tok_s_per_device"], y=d["tok_s_per_user"], mode="lines+markers+text",
                                 text=[f"B={b}" for b in d["batch_size"]], textposition="top right", name=label,
                                 customdata=d["effective_tokens_per_step"],
                                 hovertemplate="%{x:.0f} tok/s/device<br>%{y:.1f} tok/s/user<br>%{text}, "
                                               "%{customdata:.2f} tokens/step<extra>" + label + "</extra>"))
    fig.update_layout(title=f"deepinfer-tiny decode with speculation ({hardware})<br><sub>effective tokens per "
                            "step = accepted drafts + 1</sub>", xaxis_title="tokens/s per device",
                      yaxis_title="tokens/s per user", template="plotly_white", height=460)
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--measure-steps", type=int, default=12)
    p.add_argument("--time-budget", type=float, default=60.0, help="seconds per configuration")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "profiling/results"))
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    spec = SweepSpec(prefill_budgets=(), decode_batch_sizes=batches, concurrency=(), warmup_steps=3,
                     measure_steps=args.measure_steps)
    frames, meta = [], {}
    for label in args.configs.split(","):
        model, kwargs = CONFIGS[label]
        t0 = time.perf_counter()
        res = run_sweep(spec=spec, engine_kwargs={"model": model, "dtype": args.dtype, "max_model_len": 1024,
                                                  **kwargs}, progress=False, time_budget_s=args.time_budget)
        df = res.df.assign(config=label)
        frames.append(df)
        meta[label] = {"seconds": time.perf_counter() - t0, "skipped": res.meta.get("skipped", []),
                       "engine": {"model": model, **kwargs}}
        cols = ["batch_size", "decode_step_ms", "effective_tokens_per_step", "tok_s_per_user", "tok_s_per_device"]
        print(f"[{label}] {meta[label]['seconds']:.0f} s\n" + df[[c for c in cols if c in df]].to_string(index=False),
              flush=True)
    df = pd.concat(frames, ignore_index=True)
    import re

    import torch

    hw = torch.cuda.get_device_name() if torch.cuda.is_available() else records.hardware_name()
    sha, dirty = records.git_commit()
    name = args.name or "spec_decode_chart_" + re.sub(r"[^a-z0-9]+", "_", hw.lower()).strip("_")
    os.makedirs(args.out_dir, exist_ok=True)
    df.to_csv(os.path.join(args.out_dir, f"{name}.csv"), index=False)
    with open(os.path.join(args.out_dir, f"{name}.json"), "w") as f:
        json.dump({"meta": {**meta, "hardware": hw, "commit": sha, "dirty": dirty, "batches": batches},
                   "rows": json.loads(df.to_json(orient="records"))}, f, indent=1)
    try:
        fig = decode_chart(df, hw)
    except ImportError:  # a machine without plotly still records the numbers
        fig = None
    if fig is not None:
        fig.write_html(os.path.join(args.out_dir, f"{name}_decode.html"), include_plotlyjs="cdn")
    cols = ["config", "batch_size", "decode_step_ms", "effective_tokens_per_step", "tok_s_per_user", "tok_s_per_device"]
    print(df[[c for c in cols if c in df]].to_string(index=False, float_format=lambda v: f"{v:,.2f}"))


if __name__ == "__main__":
    main()
