"""Engine metrics: per-request latencies and per-step batch figures, as pandas DataFrames.

``LLM`` owns one :class:`MetricsCollector` (``llm.metrics``) and feeds it once per step,
after ``Scheduler.update``, with host timestamps (``time.perf_counter``). Nothing here
reads a device tensor or synchronises a device: token ids are already on the host when
the runner returns, so recording costs O(batch) Python work per step.

    llm.generate(prompts, params)
    llm.metrics.requests_df()   # TTFT, TPOT, inter-token latencies, queue time, tokens
    llm.metrics.steps_df()      # batch size, scheduled/prefill/decode tokens, step ms, KV blocks
    llm.metrics.summary()       # one dict of headline numbers
    llm.metrics.reset()

Definitions: TTFT = first token's arrival on the host - request arrival; TPOT = (last
token - first token) / (output tokens - 1); an inter-token latency (ITL) is the gap
between consecutive tokens of one request (0 for tokens emitted in the same step). A
scheduled chunk counts as *decode* when all its tokens are generated ones (it starts at
or after the end of the prompt), otherwise as *prefill* (this includes recompute after a
preemption).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pandas is imported lazily: the engine runs without it
    import pandas as pd

    from deepinfer.engine.outputs import SchedulerOutput
    from deepinfer.engine.request import Request
    from deepinfer.engine.scheduler import Scheduler

__all__ = ["MetricsCollector", "RequestRecord"]

_FLOAT_COLUMNS = ("arrival_s", "queue_time_s", "ttft_s", "tpot_s", "mean_itl_s", "max_itl_s", "e2e_s")
_REQUEST_COLUMNS = ["req_id", *_FLOAT_COLUMNS, "num_prompt_tokens", "num_cached_tokens", "num_output_tokens",
                    "num_preemptions", "finish_reason", "finished"]


@dataclass
class RequestRecord:
    """What the collector keeps per request (times on the ``perf_counter`` clock)."""

    req_id: str
    arrival: float
    first_scheduled: float | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)


def _pct(values: Iterable[float], q: float) -> float:
    """Percentile of ``values`` in the same unit, NaN when empty."""
    arr = np.asarray(list(values), dtype=float)
    return float(np.percentile(arr, q)) if arr.size else float("nan")


class MetricsCollector:
    """Collects step and request metrics from the engine loop; cheap enough to stay on."""

    def __init__(self, scheduler: Scheduler | None = None, max_steps: int = 200_000,
                 max_requests: int = 100_000) -> None:
        """``scheduler`` gives queue lengths and KV block pools (optional in unit tests);
        the oldest records are dropped past ``max_steps`` / ``max_requests``."""
        self.scheduler = scheduler
        self.enabled = True
        self.max_requests = max_requests
        self._max_steps = max_steps
        #: Callables run after every recorded step (the trace capture advances its schedule here).
        self.step_hooks: list[Callable[[], None]] = []
        self.reset()

    def reset(self) -> None:
        """Forget every step and request; times restart from now."""
        self.t0 = time.perf_counter()
        # Scheduler timestamps use time.monotonic; map them onto perf_counter.
        self._mono_to_perf = time.perf_counter() - time.monotonic()
        self._steps: deque[dict[str, Any]] = deque(maxlen=self._max_steps)
        self._requests: OrderedDict[str, RequestRecord] = OrderedDict()
        self._num_steps = 0
        self._last_end = float("-inf")  # perf_counter time the previous recorded step landed

    # ------------------------------------------------------------------ feeding
    def _record_for(self, req: Request) -> RequestRecord:
        rec = self._requests.get(req.req_id)
        if rec is None:
            first = req.first_scheduled_time
            rec = RequestRecord(req.req_id, req.arrival_time + self._mono_to_perf,
                                None if first is None else first + self._mono_to_perf, req.num_prompt_tokens)
            self._requests[req.req_id] = rec
            while len(self._requests) > self.max_requests:
                self._requests.popitem(last=False)
        return rec

    def record_step(self, sched_out: SchedulerOutput, touched: list[Request], t_start: float,
                    t_end: float | None = None) -> None:
        """Record one engine step. ``touched``: the requests ``Scheduler.update`` returned
        (new tokens or finished), read after stop-string handling; ``t_start``/``t_end``:
        ``time.perf_counter()`` around the step (``t_end`` defaults to now).

        With async scheduling a step is launched before the previous one lands, so launch
        to landing spans two engine calls and consecutive steps overlap. ``step_ms`` is
        therefore counted from the later of ``t_start`` and the previous step's landing:
        the steps tile the timeline and add up to the wall time in both loops (the full
        launch-to-landing time is kept as ``in_flight_ms``)."""
        t_end = time.perf_counter() if t_end is None else t_end
        if self.enabled:
            self._record(sched_out, touched, t_start, t_end)
        for hook in self.step_hooks:
            hook()

    def _record(self, sched_out: SchedulerOutput, touched: list[Request], t_start: float, t_end: float) -> None:
        by_id = {r.req_id: r for r in touched}
        prefill = decode = decode_reqs = 0
        for s in sched_out.scheduled:
            req = by_id.get(s.req_id)
            if req is not None and s.start_pos >= req.num_prompt_tokens:
                decode += s.num_tokens
                decode_reqs += 1
            else:
                prefill += s.num_tokens
        emitted = finished = 0
        for req in touched:
            rec = self._record_for(req)
            new = req.num_output_tokens - len(rec.token_times)
            if new > 0:
                rec.token_times.extend([t_end] * new)
                emitted += new
            rec.num_output_tokens = req.num_output_tokens
            rec.num_cached_tokens = req.num_cached_tokens
            rec.num_preemptions = req.num_preemptions
            if rec.first_scheduled is None and req.first_scheduled_time is not None:
                rec.first_scheduled = req.first_scheduled_time + self._mono_to_perf
            if req.is_finished and rec.finished is None:
                rec.finished, rec.finish_reason = t_end, req.finish_reason
                finished += 1
        start = max(t_start, self._last_end)
        self._last_end = max(self._last_end, t_end)
        row: dict[str, Any] = {
            "step": self._num_steps, "t_start_s": start - self.t0, "step_ms": max(t_end - start, 0.0) * 1e3,
            "in_flight_ms": (t_end - t_start) * 1e3,
            "batch_size": len(sched_out.scheduled), "num_decode_reqs": decode_reqs,
            "num_prefill_reqs": len(sched_out.scheduled) - decode_reqs,
            "scheduled_tokens": sched_out.num_batched_tokens, "prefill_tokens": prefill, "decode_tokens": decode,
            "output_tokens": emitted, "preemptions": len(sched_out.preempted_req_ids), "finished": finished,
        }
        if self.scheduler is not None:
            row["num_running"], row["num_waiting"] = self.scheduler.num_running, self.scheduler.num_waiting
            for name, pool in self.scheduler.kv.pools.items():
                row[f"kv_blocks_{name}"] = pool.num_used
            row["kv_usage"] = max(p.num_used / p.num_blocks for p in self.scheduler.kv.pools.values())
        self._steps.append(row)
        self._num_steps += 1

    # ------------------------------------------------------------------ reading
    @property
    def num_steps(self) -> int:
        """Steps recorded since the last reset (including any dropped from the window)."""
        return self._num_steps

    def last_step(self) -> dict[str, Any] | None:
        """The newest step's row (as in :meth:`steps_df`), ``None`` before the first step."""
        return self._steps[-1] if self._steps else None

    def steps_df(self) -> pd.DataFrame:
        """One row per step: batch size, scheduled / prefill / decode / emitted tokens,
        step wall time (ms, non-overlapping: they add up to the busy wall time), launch to
        landing time (``in_flight_ms``, overlapping under async scheduling), preemptions, finished requests, queue lengths, KV blocks in
        use per group (``kv_blocks_<group>``) and the fullest pool's usage fraction."""
        import pandas as pd

        return pd.DataFrame(list(self._steps))

    def requests_df(self) -> pd.DataFrame:
        """One row per request seen producing tokens or finishing (times in seconds)."""
        import pandas as pd

        rows = []
        for r in self._requests.values():
            tt = r.token_times
            itl = np.diff(tt) if len(tt) > 1 else np.empty(0)
            end = r.finished if r.finished is not None else (tt[-1] if tt else None)
            rows.append({
                "req_id": r.req_id, "arrival_s": r.arrival - self.t0,
                "queue_time_s": None if r.first_scheduled is None else r.first_scheduled - r.arrival,
                "ttft_s": tt[0] - r.arrival if tt else None,
                "tpot_s": (tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) > 1 else None,
                "mean_itl_s": float(itl.mean()) if itl.size else None,
                "max_itl_s": float(itl.max()) if itl.size else None,
                "e2e_s": None if end is None else end - r.arrival,
                "num_prompt_tokens": r.num_prompt_tokens, "num_cached_tokens": r.num_cached_tokens,
                "num_output_tokens": r.num_output_tokens, "num_preemptions": r.num_preemptions,
                "finish_reason": r.finish_reason, "finished": r.finished is not None,
            })
        df = pd.DataFrame(rows, columns=_REQUEST_COLUMNS)
        return df.astype({c: float for c in _FLOAT_COLUMNS})

    def itl_df(self) -> pd.DataFrame:
        """Long form: one row per output token (req_id, index, time_s, itl_s; itl of the
        first token is its TTFT)."""
        import pandas as pd

        rows = []
        for r in self._requests.values():
            prev = r.arrival
            for i, t in enumerate(r.token_times):
                rows.append((r.req_id, i, t - self.t0, t - prev))
                prev = t
        return pd.DataFrame(rows, columns=["req_id", "index", "time_s", "itl_s"])

    def summary(self) -> dict[str, float]:
        """Headline numbers: counts, throughput over the busy span, latency percentiles (ms)."""
        reqs = list(self._requests.values())
        steps = list(self._steps)
        ttft = [(r.token_times[0] - r.arrival) * 1e3 for r in reqs if r.token_times]
        tpot = [(r.token_times[-1] - r.token_times[0]) * 1e3 / (len(r.token_times) - 1)
                for r in reqs if len(r.token_times) > 1]
        itl = [d * 1e3 for r in reqs for d in np.diff(r.token_times)] if reqs else []
        queue = [(r.first_scheduled - r.arrival) * 1e3 for r in reqs if r.first_scheduled is not None]
        out_tokens = sum(r.num_output_tokens for r in reqs)
        start = min((r.arrival for r in reqs), default=self.t0)
        end = max((s["t_start_s"] + s["step_ms"] / 1e3 for s in steps), default=0.0) + self.t0
        span = max(end - start, 1e-9)
        sizes = [s["batch_size"] for s in steps if s["batch_size"]]
        out: dict[str, float] = {
            "num_requests": len(reqs), "num_finished": sum(r.finished is not None for r in reqs),
            "num_steps": self._num_steps, "wall_s": span if reqs else 0.0, "output_tokens": out_tokens,
            "prompt_tokens": sum(r.num_prompt_tokens for r in reqs),
            "output_tok_per_s": out_tokens / span if reqs else 0.0,
            "mean_batch_size": float(np.mean(sizes)) if sizes else 0.0, "max_batch_size": max(sizes, default=0),
            "mean_step_ms": float(np.mean([s["step_ms"] for s in steps])) if steps else float("nan"),
            "preemptions": sum(s["preemptions"] for s in steps),
            "mean_queue_ms": float(np.mean(queue)) if queue else float("nan"),
        }
        for name, vals in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
            out[f"mean_{name}"] = float(np.mean(vals)) if vals else float("nan")
            for q in (50, 90, 99):
                out[f"p{q}_{name}"] = _pct(vals, q)
        return out
