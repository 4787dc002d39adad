"""Prometheus metrics of `deepinfer serve` (``/metrics``), named as vLLM names its own
with a ``deepinfer:`` prefix so existing dashboards map over.

Latencies are what a client of this server sees, on the engine thread's host clock:
TTFT from the request's arrival at the server to the step that produced its first token,
ITL per token between steps, TPOT = (last - first token) / (tokens - 1), e2e to the last.
Engine state (running / waiting, KV usage, speculative acceptance) is the client's
`EngineStats` snapshot, taken where the engine runs after every step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deepinfer.engine.client_base import EngineStats, RequestTiming
from deepinfer.engine.output_processor import StreamDelta

__all__ = ["ServeMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServeMetrics:
    """The server's collectors in their own registry (several servers in one process stay apart)."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("deepinfer:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY, registry=r).labels(model_name)
        self.itl = Histogram("deepinfer:inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=_TOKEN, registry=r).labels(model_name)
        self.tpot = Histogram("deepinfer:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", labels, buckets=_TOKEN, registry=r).labels(model_name)
        self.e2e = Histogram("deepinfer:e2e_request_latency_seconds", "Arrival to last token", labels,
                             buckets=_LATENCY, registry=r).labels(model_name)
        self.running = Gauge("deepinfer:num_requests_running", "Requests in the running batch", labels,
                             registry=r).labels(model_name)
        self.waiting = Gauge("deepinfer:num_requests_waiting", "Requests waiting to run", labels,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("deepinfer:kv_cache_usage_perc", "Fraction of KV blocks in use (fullest group)",
                              labels, registry=r).labels(model_name)
        self.prefix_hit_rate = Gauge("deepinfer:prefix_cache_hit_rate", "Prompt tokens served from the prefix "
                                     "cache / prompt tokens, over finished requests", labels,
                                     registry=r).labels(model_name)
        self.preemptions = Counter("deepinfer:num_preemptions", "Preemptions of finished requests", labels,
                                   registry=r).labels(model_name)
        self.prompt_tokens = Counter("deepinfer:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("deepinfer:generation_tokens", "Output tokens", labels,
                                         registry=r).labels(model_name)
        self.finished = Counter("deepinfer:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.spec_acceptance = Gauge("deepinfer:spec_decode_draft_acceptance_rate", "Accepted / verified drafts "
                                     "(0 without speculation)", labels, registry=r).labels(model_name)
        self.spec_mean_accepted = Gauge("deepinfer:spec_decode_mean_accepted_length", "Accepted drafts per "
                                        "verified request-step", labels, registry=r).labels(model_name)
        self.steps = Counter("deepinfer:engine_steps", "Engine steps", labels, registry=r).labels(model_name)
        self.step_seconds = Counter("deepinfer:engine_step_seconds", "Seconds the engine spent in its steps "
                                    "(busy time: over wall time, how well the engine is kept fed)", labels,
                                    registry=r).labels(model_name)
        self.model_name = model_name
        self._prompt_total = 0
        self._cached_total = 0

    def on_step(self, deltas: list[StreamDelta], timings: dict[str, RequestTiming], step_s: float,
                stats: EngineStats) -> None:
        """The engine client's hook (one call per engine turn; ``stats`` taken after it)."""
        if step_s > 0:
            self.steps.inc()
            self.step_seconds.inc(step_s)
        tokens = 0
        for d in deltas:
            t = timings.get(d.request_id)
            tokens += len(d.token_ids)
            if t is not None and d.token_ids:
                if t.num_output_tokens == len(d.token_ids) and t.first_token is not None:
                    self.ttft.observe(t.first_token - t.submitted)
                else:
                    for gap in t.itls[-len(d.token_ids):]:
                        self.itl.observe(gap)
            if d.finished:
                self.finished.labels(self.model_name, d.finish_reason).inc()
                out = d.output
                if out is not None and out.metrics is not None:
                    m = out.metrics
                    self.preemptions.inc(m.num_preemptions)
                    self.prompt_tokens.inc(m.num_prompt_tokens)
                    self._prompt_total += m.num_prompt_tokens
                    self._cached_total += m.num_cached_tokens
                if t is not None and t.last_token is not None:
                    self.e2e.observe(t.last_token - t.submitted)
                    if t.num_output_tokens > 1 and t.first_token is not None:
                        self.tpot.observe((t.last_token - t.first_token) / (t.num_output_tokens - 1))
        if tokens:  # one increment per engine turn, not per stream (each takes the metric's lock)
            self.generation_tokens.inc(tokens)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        if self._prompt_total:
            self.prefix_hit_rate.set(self._cached_total / self._prompt_total)
        if stats.spec_acceptance is not None:
            self.spec_acceptance.set(stats.spec_acceptance)
        if stats.spec_mean_accepted is not None:
            self.spec_mean_accepted.set(stats.spec_mean_accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
