"""`deepinfer bench serve`: an open-loop load test of an OpenAI-compatible server.

    deepinfer bench serve --base-url http://127.0.0.1:8000 --dataset random --num-prompts 200 \\
        --random-input-len 64 --random-output-len 32 --request-rate 8 --arrival poisson \\
        --max-concurrency 64 --slo-ttft-ms 1000 --slo-tpot-ms 50 --out result.json

Requests are sent on a fixed schedule (open loop): inter-arrival gaps are drawn from an
exponential (``poisson``) or a gamma distribution of shape ``--burstiness`` (``gamma``;
shape 1 is Poisson, < 1 burstier) with mean 1 / rate, and a request is sent at its time
whether or not earlier ones finished; ``--request-rate inf`` sends all at once.
``--max-concurrency`` caps requests in flight (a late send waits for a slot, as
`vllm bench serve` does). Every request streams (``stream_options.include_usage``) so
the client measures TTFT (first token chunk), ITL (gaps between chunks: a chunk that
carries several tokens, as the server's merged deltas do under load, counts once), TPOT
((e2e - TTFT) / (output tokens - 1)) and e2e itself.

Goodput = requests per second that met every SLO given (TTFT, TPOT, e2e). The JSON
result carries the commit, the hardware and the full config beside every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import subprocess
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["BenchConfig", "RequestResult", "add_bench_arguments", "run_bench", "summarize", "run_cli"]


@dataclass
class BenchConfig:
    """Everything that decides a run (recorded in the result)."""

    base_url: str
    model: str | None = None
    endpoint: str = "completions"  # completions | chat
    dataset: str = "random"  # random | path to a JSONL workload (prompt_len / output_len or prompt)
    num_prompts: int = 100
    random_input_len: int = 64
    random_output_len: int = 32
    request_rate: float = math.inf
    arrival: str = "poisson"  # poisson | gamma
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2e_ms: float | None = None
    api_key: str | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0

    def check(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"--endpoint must be completions or chat, got {self.endpoint!r}")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"--arrival must be poisson or gamma, got {self.arrival!r}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 or inf, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
            raise ValueError(f"--base-url must be the server's root, e.g. http://127.0.0.1:8000, got {self.base_url!r}")
        if self.num_prompts < 1 or self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass
class RequestResult:
    """One request as the client saw it (seconds from the start of the run)."""

    sent: float
    ok: bool = False
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---- workload ------------------------------------------------------------------------------
def build_requests(cfg: BenchConfig, vocab_size: int) -> list[tuple[Any, int]]:
    """(prompt, max_tokens) per request: token ids for completions, text for chat."""
    from deepinfer.profiling.workload import WorkloadRequest, load_workload, synth_prompts

    rng = random.Random(cfg.seed)
    if cfg.dataset == "random":
        shapes = [WorkloadRequest(cfg.random_input_len, cfg.random_output_len) for _ in range(cfg.num_prompts)]
        texts = None
    else:
        texts = _jsonl_prompts(cfg.dataset)
        if texts is None:
            shapes = load_workload(cfg.dataset)
        else:
            shapes = [WorkloadRequest(1, n) for _, n in texts]
        picks = [rng.randrange(len(shapes)) for _ in range(cfg.num_prompts)]
        shapes = [shapes[i] for i in picks]
        texts = [texts[i] for i in picks] if texts is not None else None
    if texts is not None:
        return [(t, n) for t, n in texts]
    ids = synth_prompts(shapes, cfg.seed, vocab_size)
    if cfg.endpoint == "chat":  # chat takes text: words the tokenizer keeps apart, about one token each
        return [(" ".join(f"w{t}" for t in p), s.output_len) for p, s in zip(ids, shapes)]
    return [(p, s.output_len) for p, s in zip(ids, shapes)]


def _jsonl_prompts(path: str) -> list[tuple[str, int]] | None:
    """(text, max_tokens) when the JSONL lines carry a ``prompt`` (else None: a length workload)."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            rec = json.loads(line)
            if "prompt" not in rec:
                return None
            out.append((str(rec["prompt"]), int(rec.get("output_len", rec.get("max_tokens", 32)))))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def arrival_times(cfg: BenchConfig, n: int) -> list[float]:
    """Send times (seconds from the start) of an open-loop schedule."""
    if math.isinf(cfg.request_rate):
        return [0.0] * n
    rng = random.Random(cfg.seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if cfg.arrival == "poisson":
            t += rng.expovariate(cfg.request_rate)
        else:  # gamma with mean 1 / rate
            t += rng.gammavariate(cfg.burstiness, 1.0 / (cfg.request_rate * cfg.burstiness))
    return out


# ---- one request ---------------------------------------------------------------------------
async def _one(http: Any, cfg: BenchConfig, model: str, prompt: Any, max_tokens: int, t0: float) -> RequestResult:
    res = RequestResult(sent=time.perf_counter() - t0)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        url = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
        body["thinking"] = {"type": "disabled"}
    else:
        url = "/v1/completions"
        body["prompt"] = prompt
    start = time.perf_counter()
    last = start
    try:
        async with http.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return res
            async for raw in resp.content:  # one SSE line at a time
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(_carries_output(c) for c in chunk.get("choices") or ()):
                    continue  # the usage chunk, chat's role-only first chunk, a finish-only last chunk
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
        res.e2e = time.perf_counter() - start
        res.ok = res.ttft is not None
    except Exception as exc:  # noqa: BLE001 - recorded per request, the run goes on
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def _carries_output(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice brings generated output: completion text, or a chat delta's
    content, reasoning or tool calls (TTFT and ITL count these chunks only, as vLLM's client does)."""
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


async def run_bench(cfg: BenchConfig) -> tuple[list[RequestResult], float, dict[str, Any]]:
    """Run the schedule; (per-request results, wall seconds, server info)."""
    # aiohttp, not httpx: the client must not be what a run measures, and httpx's streaming
    # costs ~6x aiohttp's CPU per SSE event (profiling/serve_host_cost.py), more than the server's
    import aiohttp

    cfg.check()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with aiohttp.ClientSession(cfg.base_url.rstrip("/"), headers=headers,
                                     connector=aiohttp.TCPConnector(limit=0),  # no connection cap
                                     timeout=aiohttp.ClientTimeout(sock_connect=cfg.timeout_s,
                                                                   sock_read=cfg.timeout_s)) as http:
        async with http.get("/v1/models") as r:
            models = (await r.json())["data"]
        model = cfg.model or models[0]["id"]
        vocab = int(models[0].get("vocab_size", 129_280))  # deepinfer lists it; others: the V4 vocabulary
        reqs = build_requests(cfg, vocab)
        times = arrival_times(cfg, len(reqs))
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        t0 = time.perf_counter()

        async def scheduled(i: int) -> RequestResult:
            delay = times[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await _one(http, cfg, model, *reqs[i], t0)
            async with sem:
                return await _one(http, cfg, model, *reqs[i], t0)

        results = await asyncio.gather(*(scheduled(i) for i in range(len(reqs))))
        wall = time.perf_counter() - t0
    return list(results), wall, {"model": model, "models": models}


# ---- report --------------------------------------------------------------------------------
def _pcts(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(values)

    def q(p: float) -> float:  # linear interpolation, numpy's default
        k = (len(v) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return (v[lo] + (v[hi] - v[lo]) * (k - lo)) * scale

    return {"mean": sum(v) / len(v) * scale, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(cfg: BenchConfig, results: list[RequestResult], wall: float) -> dict[str, Any]:
    """Percentiles (ms), throughput and goodput of one run."""
    ok = [r for r in results if r.ok]

    def meets(r: RequestResult) -> bool:
        return ((cfg.slo_ttft_ms is None or (r.ttft or 0) * 1000 <= cfg.slo_ttft_ms)
                and (cfg.slo_tpot_ms is None or r.tpot is None or r.tpot * 1000 <= cfg.slo_tpot_ms)
                and (cfg.slo_e2e_ms is None or (r.e2e or 0) * 1000 <= cfg.slo_e2e_ms))

    good = [r for r in ok if meets(r)]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": wall,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_throughput": out_tokens / wall if wall else 0.0,
        "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": out_tokens,
        "goodput": len(good) / wall if wall else 0.0, "good_fraction": len(good) / len(results),
        "ttft_ms": _pcts([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _pcts([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _pcts([g for r in ok for g in r.itls]),
        "e2e_ms": _pcts([r.e2e for r in ok if r.e2e is not None]),
    }


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(cfg: BenchConfig, summary: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
    """The JSON a run writes: commit, hardware and the full config beside the numbers."""
    conf = asdict(cfg)
    conf["api_key"] = None if cfg.api_key is None else "<set>"
    conf["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    return {"bench": "deepinfer bench serve", "commit": _commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "hardware": {"client_host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
                         "python": platform.python_version()},
            "config": conf, "server": server, **summary}


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id (default: the server's first /v1/models entry)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--dataset", default="random", help="random, or a JSONL file (datasets/workloads/*.jsonl)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=64)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, or inf")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: exact output lengths)")
    p.add_argument("--out", default=None, help="write the JSON result here")


def run_cli(args: argparse.Namespace) -> int:
    fields = {f for f in BenchConfig.__dataclass_fields__}
    cfg = BenchConfig(**{k: v for k, v in vars(args).items() if k in fields})
    cfg.check()
    results, wall, server = asyncio.run(run_bench(cfg))
    rec = record(cfg, summarize(cfg, results, wall), server)
    text = json.dumps(rec, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    rows = [("completed / failed", f"{rec['completed']} / {rec['failed']}"),
            ("duration s", f"{rec['duration_s']:.2f}"),
            ("requests/s", f"{rec['request_throughput']:.2f}"), ("output tok/s", f"{rec['output_throughput']:.1f}"),
            ("goodput req/s", f"{rec['goodput']:.2f}")]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = rec[key]
        rows.append((f"{key[:-3]} p50/p90/p99 ms", "/".join("-" if p[q] is None else f"{p[q]:.1f}"
                                                          for q in ("p50", "p90", "p99"))))
    for name, value in rows:
        print(f"{name:<24} {value}")
    return 0 if rec["failed"] == 0 else 1
