"""The host side of a lone short prefill: cProfile of ``LLM.generate`` over one ``--tokens``
prompt with one output token, repeated, on a random bf16 ``mini`` model (the serving
benchmarks' lone-request TTFT is this step). Prints the functions with the most own time
and the most cumulative time, and the step's launches counted by ``LaunchCounter``
(torch ops and Triton launches of the prefill forward).

    python3 profiling/prefill_host_profile.py [--tokens 256] [--repeats 20] [--tiny]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config, write_tiny_checkpoint  # noqa: E402
from deepinfer.profiling.records import save_json  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="CPU stand-in (a smoke run)")
    args = ap.parse_args(argv)
    cfg, dtype = (tiny_config(vocab_size=4096), torch.float32) if args.tiny else (mini_config(), torch.bfloat16)
    ckpt = write_tiny_checkpoint(tempfile.mkdtemp(prefix="prefill_host_"), seed=0, cfg=cfg, dtype=dtype)
    llm = LLM(ckpt, dtype=str(dtype).split(".")[-1], max_num_seqs=16, max_model_len=args.tokens + 64)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def prompt(i: int) -> list[int]:
        return [(i * 7919 + 31 * j) % (cfg.vocab_size - 20) + 10 for j in range(args.tokens)]

    for i in range(3):
        llm.generate(prompt_token_ids=[prompt(100 + i)], sampling_params=sp, use_tqdm=False)
    walls, ttfts = [], []
    for i in range(args.repeats):
        t = time.perf_counter()
        o = llm.generate(prompt_token_ids=[prompt(i)], sampling_params=sp, use_tqdm=False)[0]
        walls.append(time.perf_counter() - t)
        ttfts.append(o.metrics.first_token_time - o.metrics.arrival_time)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(args.repeats):
        llm.generate(prompt_token_ids=[prompt(200 + i)], sampling_params=sp, use_tqdm=False)
    prof.disable()
    counts = None
    fast = getattr(llm.runner, "fast_prefill", None)
    if fast is not None:
        from deepinfer.models.fast.launches import LaunchCounter

        counter = LaunchCounter()
        original = type(fast).forward

        def counted(self, *a, **k):  # noqa: ANN001, ANN202 - the path's own signature
            with counter:
                return original(self, *a, **k)

        type(fast).forward = counted
        try:
            llm.generate(prompt_token_ids=[prompt(999)], sampling_params=sp, use_tqdm=False)
        finally:
            type(fast).forward = original
        counts = counter.summary(25)
    tables = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        tables[key] = buf.getvalue()
        print(f"---- by {key} ({args.repeats} generates) ----")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-(args.top + 4) * 200:])
    hw = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    out = {"hardware": hw, "commit": os.environ.get("DEEPINFER_COMMIT"), "tokens": args.tokens,
           "generate_ms_p50": 1000 * statistics.median(walls), "ttft_ms_p50": 1000 * statistics.median(ttfts),
           "prefill_launches": counts, "cprofile": tables}
    print(json.dumps({k: v for k, v in out.items() if k != "cprofile"}, indent=1))
    tag = "_".join(filter(None, ["h200" if "H200" in hw else "cpu", out["commit"], str(args.tokens)]))
    save_json(args.out, f"prefill_host_profile_{tag}.json", out)
    return out


if __name__ == "__main__":
    main()
