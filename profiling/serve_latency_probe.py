"""Where a lone request's time to first token goes in each engine client, stage by stage.

``benchmarks/serve_h200.py`` measures the added TTFT through HTTP; this study takes the
engine clients without HTTP and splits one lone request's TTFT on host clocks.
``time.monotonic`` is system-wide on Linux, so the engine process's RequestMetrics (arrival,
first token) compare with the server process's clocks:

* ``admit``: the admission checks (a round trip to the engine process for that client);
* ``to_engine``: submit -> the engine's Request exists (the add command's hop);
* ``engine``: Request created -> the engine saw its first token (what LLM.generate's TTFT is);
* ``to_client``: the engine saw it -> the client dispatched it (the step's message hop);
* ``to_consumer``: dispatched -> the asyncio consumer has it.

Variants: the thread client, and the process client at several engine-process GIL switch
intervals (``ProcessEngineClient(switch_interval_s=)``). Offline ``LLM.generate`` TTFT of
the same requests comes first, in the same run. Writes ``serve_latency_probe_<hw>.json``.

    python3 profiling/serve_latency_probe.py [--tiny] [--repeats 12] [--intervals 0.005,0.0005]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config, write_tiny_checkpoint  # noqa: E402

STAGES = ("admit", "to_engine", "engine", "to_client", "to_consumer", "total")


def prompt(i: int, length: int, vocab: int) -> list[int]:
    return [(i * 7919 + 31 * j) % (vocab - 20) + 10 for j in range(length)]


async def lone_requests(client, args, vocab: int) -> list[dict[str, float]]:
    sp = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    warm = [client.generate(f"w{i}", prompt(1000 + i, args.prompt_len, vocab), sp.for_request())
            for i in range(8)]
    for it in warm:
        async for _ in it:
            pass
    rows = []
    for i in range(args.repeats):
        t0 = time.monotonic()
        ids, params = await client.admit(None, prompt(i, args.prompt_len, vocab), [sp])
        t1 = time.monotonic()
        rid = f"r{i}"
        stream = client.generate(rid, ids, params[0])
        timing = client.timing(rid)
        first = last = None
        async for d in stream:
            if first is None and d.token_ids:
                first = time.monotonic()
            last = d
        m = last.output.metrics
        rows.append({"admit": t1 - t0, "to_engine": m.arrival_time - timing.submitted,
                     "engine": m.first_token_time - m.arrival_time,
                     "to_client": timing.first_token - m.first_token_time,
                     "to_consumer": first - timing.first_token, "total": first - t0})
    return rows


def offline(ckpt: str, engine: dict, args, vocab: int) -> list[float]:
    llm = LLM(ckpt, **engine)
    sp = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt(1000 + i, args.prompt_len, vocab) for i in range(8)], sampling_params=sp,
                 use_tqdm=False)
    ttft = []
    for i in range(args.repeats):
        o = llm.generate(prompt_token_ids=[prompt(i, args.prompt_len, vocab)], sampling_params=sp, use_tqdm=False)[0]
        ttft.append(o.metrics.first_token_time - o.metrics.arrival_time)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ttft


def run_client(kind: str, interval: float | None, ckpt: str, engine: dict, args, vocab: int) -> list[dict]:
    kwargs = {"model": ckpt, **engine}
    if kind == "thread":
        from deepinfer.engine.async_client import AsyncEngineClient
        from deepinfer.engine.core import EngineCore

        client = AsyncEngineClient(EngineCore(**kwargs))
    else:
        from deepinfer.engine.process_client import ProcessEngineClient

        client = ProcessEngineClient(kwargs, switch_interval_s=interval)
    client.start()
    try:
        return asyncio.run(lone_requests(client, args, vocab))
    finally:
        client.shutdown()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--intervals", default="0.005,0.0005", help="engine-process switch intervals (s) to try")
    ap.add_argument("--tiny", action="store_true", help="CPU stand-in (a smoke run)")
    args = ap.parse_args(argv)
    if args.tiny:
        cfg, dtype, engine = tiny_config(vocab_size=4096), torch.float32, {"dtype": "float32"}
    else:
        cfg, dtype, engine = mini_config(), torch.bfloat16, {"dtype": "bfloat16"}
    engine |= {"max_num_seqs": 16, "max_model_len": args.prompt_len + args.new + 64}
    ckpt = write_tiny_checkpoint(tempfile.mkdtemp(prefix="serve_probe_"), seed=0, cfg=cfg, dtype=dtype)
    hw = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    off = offline(ckpt, engine, args, cfg.vocab_size)
    variants = {"thread": run_client("thread", None, ckpt, engine, args, cfg.vocab_size)}
    for iv in (float(x) for x in args.intervals.split(",") if x.strip()):
        variants[f"process@{iv * 1000:g}ms"] = run_client("process", iv, ckpt, engine, args, cfg.vocab_size)
    p50 = {name: {s: 1000 * statistics.median(r[s] for r in rows) for s in STAGES} for name, rows in variants.items()}
    out = {"hardware": hw, "torch": torch.__version__, "commit": os.environ.get("DEEPINFER_COMMIT"),
           "args": vars(args) | {"out": None}, "engine": engine, "offline_ttft_ms_p50": 1000 * statistics.median(off),
           "p50_ms": p50, "rows_s": variants}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"serve_latency_probe_{'h200' if 'H200' in hw else 'cpu'}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"offline TTFT p50 {out['offline_ttft_ms_p50']:.2f} ms")
    print(f"{'client':<18}" + "".join(f"{s:>12}" for s in STAGES))
    for name, row in p50.items():
        print(f"{name:<18}" + "".join(f"{row[s]:>12.3f}" for s in STAGES))
    print(path)
    return out


if __name__ == "__main__":
    main()
