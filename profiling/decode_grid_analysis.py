"""The decode grid's analysis (profiling/decode_grid.py): cliffs against each row's trend and
against the same cell elsewhere, the targets, and a diagnosis of every cell that is slower
on a warmed engine than on a fresh one.

The trend of a row (one batch size, contexts c) is affine, ``t(c) = a + b * c`` with
``a, b >= 0``: a decode step costs a fixed part (weights, launches, the host) and a part
that grows with the context its attention reads. A least-squares line of log t over log c
(the first version) bends the wrong way through a row that is flat at short contexts and
linear at long ones, so it called the fastest cells of such rows far "over trend". A cell
is a cliff when its step time is more than ``SLOW`` times the affine fit through the row's
other cells.
"""

from __future__ import annotations

SLOW = 1.5  # a cell this much slower than its trend / its twin is flagged
MEM_TOL = 0.05  # graph memory measured vs accounted before the cache was sized
DIAGNOSE = 1.2  # a warmed cell this much slower than fresh gets a diagnosis


def affine_fit(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b x with a, b >= 0 (each bound tried once:
    a negative slope becomes a flat line through the mean, a negative intercept a line
    through the origin)."""
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    if b < 0:
        return my, 0.0
    if a < 0:
        sx2 = sum(p[0] ** 2 for p in pts)
        return 0.0, (sum(p[0] * p[1] for p in pts) / sx2 if sx2 > 0 else 0.0)
    return a, b


def trend_flags(xs: list[float], ys: list[float]) -> list[float | None]:
    """For each point, y over the affine trend of the others (:func:`affine_fit`); None
    where fewer than two others exist or the trend is not positive. A cliff is > SLOW."""
    out: list[float | None] = []
    for i in range(len(xs)):
        pts = [(x, y) for j, (x, y) in enumerate(zip(xs, ys)) if j != i and y > 0]
        if len(pts) < 2 or ys[i] <= 0:
            out.append(None)
            continue
        a, b = affine_fit(pts)
        pred = a + b * xs[i]
        out.append(round(ys[i] / pred, 3) if pred > 0 else None)
    return out


def _cells(eng: dict, state: str) -> list[dict]:
    return [c for c in eng.get(state, []) if "step_ms" in c]


def diagnose(fresh: dict, warmed: dict) -> dict:
    """Where a warmed cell's extra step time went, from the two cells' steady-call probes:
    the device time of one replay of the step's graph, host time per step not spent waiting
    for the device, allocator retries / device mallocs, GC time."""
    def per_step(c: dict, key: str) -> float | None:
        d = c.get("diag") or {}
        return d.get(key)

    out: dict = {"batch": fresh["batch"], "context": fresh["context"],
                 "step_ratio": round(warmed["step_ms"] / fresh["step_ms"], 3)}
    for key in ("graph_gpu_ms", "host_busy_ms_per_step", "wait_ms_per_step", "gc_ms",
                "alloc_retries", "device_mallocs", "device_frees"):
        f, w = per_step(fresh, key), per_step(warmed, key)
        out[key] = [f, w]
    out["window_pages_2mib"] = [((c.get("diag") or {}).get("window_blocks") or {}).get("pages_2mib")
                                for c in (fresh, warmed)]
    g, h = out["graph_gpu_ms"], out["host_busy_ms_per_step"]
    gpu = g[0] and g[1] and g[1] / g[0]
    host = h[0] and h[1] and h[1] / h[0]
    if gpu and gpu > DIAGNOSE:
        out["verdict"] = f"device: the step's graph replays {gpu:.2f}x slower (same shape, other data)"
    elif host and host > DIAGNOSE:
        out["verdict"] = f"host: {host:.2f}x the host time per step outside device waits"
    elif any((out[k][1] or 0) > (out[k][0] or 0) for k in ("alloc_retries", "device_mallocs")):
        out["verdict"] = "allocator: device mallocs / retries during decode"
    else:
        out["verdict"] = "unclear: neither the graph's device time nor the host time per step grew"
    return out


def analyse(engines: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(flagged cells, targets, warmed-cell diagnoses)."""
    flags, firsts, twins, diagnoses = [], [], [], []
    for name, eng in engines.items():
        for state in ("fresh", "warmed"):
            cells = _cells(eng, state)
            for b in sorted({c["batch"] for c in cells}):
                row = sorted((c for c in cells if c["batch"] == b), key=lambda c: c["context"])
                for c, r in zip(row, trend_flags([c["context"] for c in row], [c["step_ms"] for c in row])):
                    c["over_row_trend"] = r
                    if r is not None and r > SLOW:
                        flags.append({"engine": name, "state": state, "why": "row trend",
                                      **{k: v for k, v in c.items() if k != "diag"}})
            firsts += [c["first_over_steady"] for c in cells]
    index = {(n, s, c["batch"], c["context"]): c for n, e in engines.items() for s in ("fresh", "warmed")
             for c in _cells(e, s)}
    for (n, s, b, ctx), c in index.items():
        for other in [(m, s, b, ctx) for m in engines if m != n] + [(n, "fresh", b, ctx)] * (s == "warmed"):
            if other in index:
                r = c["step_ms"] / index[other]["step_ms"]
                twins.append(r)
                if r > SLOW:
                    flags.append({"engine": n, "state": s, "why": f"vs {other[0]} {other[1]}", "ratio": round(r, 3),
                                  **{k: v for k, v in c.items() if k != "diag"}})
                if s == "warmed" and other[1] == "fresh" and other[0] == n and r > DIAGNOSE:
                    diagnoses.append({"engine": n, **diagnose(index[other], c)})
    first_call = [e["first_generate"]["ratio"] for e in engines.values() if "first_generate" in e]
    mem = [e["graphs"]["measured_bytes"] / e["graphs"]["accounted_bytes"] for e in engines.values()
           if e.get("graphs", {}).get("measured_bytes") and e["graphs"].get("accounted_bytes")]
    worst_mem = max(mem, key=lambda m: abs(m - 1), default=float("nan"))
    checks = [e.get("check", {}) for e in engines.values()]
    same = bool(checks) and all(c.get("equal") for c in checks)
    rows = [("cells slower than 1.5x their row trend or twin", len(flags), 0, len(flags) == 0),
            ("worst step-time ratio vs the same cell on the other engine / fresh", max(twins, default=float("nan")),
             SLOW, bool(twins) and max(twins) <= SLOW),
            ("first generate after start / steady state", max(first_call, default=float("nan")), 1.1,
             bool(first_call) and max(first_call) <= 1.1),
            ("worst first / steady call of any cell", max(firsts, default=float("nan")), 1.1,
             bool(firsts) and max(firsts) <= 1.1),
            ("graph captures after start", sum(e.get("graphs", {}).get("captures_after_start", 0)
                                               for e in engines.values()), 0, None),
            ("graph memory measured / accounted (within 5%)", worst_mem, 1.0,
             bool(mem) and abs(worst_mem - 1) <= MEM_TOL),
            ("greedy tokens equal on every engine, fresh and warmed", float(same), 1.0, same)]
    targets = [{"name": n, "value": round(v, 3) if isinstance(v, float) else v, "target": t,
                "met": m if m is not None else v == t} for n, v, t, m in rows]
    return flags, targets, diagnoses


__all__ = ["DIAGNOSE", "MEM_TOL", "SLOW", "affine_fit", "analyse", "diagnose", "trend_flags"]
