"""Where a speculative decode step's wall time goes, on the host: cProfile over a batch.

    PYTHONPATH=. python3 profiling/spec_host_profile.py [--model deepinfer-tiny-dspark] [--k 5]
        [--batch 16] [--tokens 48] [--varlen] [--out DIR]

Builds the engine, warms it up (graph captures, Triton compiles) with the same batch,
then profiles one ``generate`` of ``--batch`` greedy requests and prints the functions
with the most cumulative and own time, plus the mean wall time per engine step; writes
``spec_host_profile_<model>_k<k>_b<batch>.txt``. Speculative steps sync the host every
step (drafts come from the verified tokens), so host time is step time here.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepinfer-tiny-dspark")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "profiling/results"))
    args = ap.parse_args()
    llm = LLM(args.model, num_speculative_tokens=args.k, enable_mtp_varlen=args.varlen, max_model_len=1024,
              max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch * (args.k + 1)))
    vocab = llm.model_config.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 2) + 2 for j in range(32)] for i in range(args.batch)]
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)  # warm-up at this shape
    llm.metrics.reset()
    t0 = time.perf_counter()  # plain wall time per step first (cProfile inflates Python-heavy code)
    llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    plain_ms = (time.perf_counter() - t0) / max(len(llm.metrics.steps_df()), 1) * 1e3
    ops = ""
    if torch.cuda.is_available():  # host-side cost of each torch op / CUDA runtime call
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        ops = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    llm.metrics.reset()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    steps = llm.metrics.steps_df()
    report = io.StringIO()
    report.write(f"{args.model} k={args.k} varlen={args.varlen} batch={args.batch}: {len(steps)} steps, "
                 f"{wall:.2f} s (under cProfile), {wall / max(len(steps), 1) * 1e3:.1f} ms/step; "
                 f"{plain_ms:.2f} ms/step without a profiler\n")
    if ops:
        report.write("torch profiler, one generate, by self CPU time:\n" + ops + "\n")
    for key, n in (("cumulative", 45), ("tottime", 30)):
        stats = pstats.Stats(prof, stream=report)
        stats.strip_dirs().sort_stats(key).print_stats(n)
    text = report.getvalue()
    print(text)
    os.makedirs(args.out, exist_ok=True)
    name = f"spec_host_profile_{args.model}_k{args.k}_b{args.batch}.txt"
    with open(os.path.join(args.out, name), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
