#!/usr/bin/env python
"""Capture a profiler trace of N engine steps and summarise it.

    python profiling/trace.py                          # tiny model on CPU, 4 traced steps
    python profiling/trace.py --model /ckpt --dtype bfloat16 --requests 16 --steps 8

Writes <out-dir>/<name>.json (chrome trace: open it in Perfetto UI) and <name>_timeline.html,
and prints per-step host/device times and the device idle gaps between steps. Engine phases
carry NVTX ranges too, so the same run under ``nsys profile`` shows them in Nsight Systems.
From Python: ``deepinfer.profiling.trace.capture_trace``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from deepinfer.llm import LLM
from deepinfer.profiling.trace import capture_trace
from deepinfer.profiling.workload import DEFAULT_WORKLOAD, load_workload, scale_workload, synth_prompts
from deepinfer.sampling_params import SamplingParams

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments; defaults trace the tiny model on CPU."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: embedded tiny model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--requests", type=int, default=4, help="requests in the traced batch")
    p.add_argument("--steps", type=int, default=4, help="engine steps to record")
    p.add_argument("--skip-steps", type=int, default=1, help="untraced steps before the warm-up step")
    p.add_argument("--name", default="trace")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "artifacts" / "traces"))
    return p


def main(argv: list[str] | None = None) -> int:
    """Trace, write the trace and its timeline chart, print the step table and idle gaps."""
    args = build_parser().parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=max(args.requests, 1), max_num_batched_tokens=args.max_num_batched_tokens)
    reqs = scale_workload(load_workload(args.workload), args.requests,
                          output_len=args.skip_steps + args.steps + 4, max_len=args.max_model_len)
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    cap = capture_trace(llm, prompt_token_ids=synth_prompts(reqs, vocab_size=llm.model_config.vocab_size), sampling_params=params, num_steps=args.steps,
                        skip_steps=args.skip_steps, out_dir=args.out_dir, name=args.name)
    html = os.path.join(args.out_dir, f"{args.name}_timeline.html")
    cap.figure().write_html(html, include_plotlyjs="cdn")
    out = sys.stdout
    out.write(cap.steps.to_string(index=False, float_format="%.3f") + "\n\n")
    out.write(cap.gaps.to_string(index=False, float_format="%.3f") + "\n\n")
    out.write(f"trace: {cap.path}\ntimeline: {html}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
