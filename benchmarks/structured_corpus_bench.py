"""Structured output on the pinned JSONSchemaBench corpus: rejected / valid / invalid / length
and compile time p50 / p95 (issue 27's targets).

    # fetch the pinned corpus (HTTPS tarball, or --git-dir for a local clone), then run
    python benchmarks/structured_corpus_bench.py --fetch /tmp/jsb [--git-dir CLONE.git]
    python benchmarks/structured_corpus_bench.py --corpus /tmp/jsb --per-category 30 --out profiling/results/x.json
    # CI / no corpus: the committed 30-schema sample
    python benchmarks/structured_corpus_bench.py --corpus tests/data/jsonschemabench_sample

Admission (deepinfer's rules, backend choice, parser; no vocabulary) runs over every schema
of the corpus; compilation over the model's vocabulary and generation (temperature 1, one
``LLM.generate`` of all admitted schemas) over ``--per-category`` schemas of each category
(seeded sample, ``--exclude`` lists names to leave out). The default model is deepinfer's
own (``LLM()``), on CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

from deepinfer.structured.corpus import CORPUS_COMMIT, fetch_corpus, load_corpus, sample
from deepinfer.structured.corpus_bench import admission_only, run_corpus


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fetch", help="write the pinned corpus into this folder and exit")
    ap.add_argument("--git-dir", help="with --fetch: read the pinned commit from this git directory")
    ap.add_argument("--corpus", default="tests/data/jsonschemabench_sample", help="folder with data/<category>/")
    ap.add_argument("--per-category", type=int, default=3, help="schemas per category compiled and generated")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model", default=None, help="LLM model (default: deepinfer's own)")
    ap.add_argument("--exclude", default="tests/data/jsonschemabench_sample/SAMPLE.json",
                    help="SAMPLE.json whose schemas are left out of the generation sample ('' for none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.fetch:
        print(json.dumps(fetch_corpus(args.fetch, git_dir=args.git_dir)))
        return

    from deepinfer import LLM

    corpus = load_corpus(args.corpus)
    everything = [(c, n, t) for c in sorted(corpus) for n, t in sorted(corpus[c].items())]
    admission = admission_only(everything)
    exclude = set()
    if args.exclude and Path(args.exclude).exists() and Path(args.exclude).parent != Path(args.corpus):
        exclude = {p.removeprefix("data/").removesuffix(".json") for p in json.loads(
            Path(args.exclude).read_text())["sha256"]}
    items = sample(corpus, args.per_category, seed=args.seed, exclude=exclude)
    llm = LLM(args.model, dtype="float32", max_model_len=4096, max_num_seqs=64) if args.model else \
        LLM(dtype="float32", max_model_len=4096, max_num_seqs=64)
    t0 = time.perf_counter()
    result = run_corpus(llm, items, max_tokens=args.max_tokens, seed=args.seed)
    wall = time.perf_counter() - t0
    targets = [
        {"name": "invalid_stop_outputs", "value": result["invalid"], "target": 0, "met": result["invalid"] == 0},
        {"name": "rejected_frac_whole_corpus", "value": admission["rejected_frac"], "target": 0.10,
         "met": admission["rejected_frac"] <= 0.10},
        {"name": "rejected_frac_sample", "value": result["rejected_frac"], "target": 0.10,
         "met": result["rejected_frac"] <= 0.10},
        {"name": "compile_s_p95", "value": result["compile_s_p95"], "target": 0.1,
         "met": result["compile_s_p95"] <= 0.1},
    ]
    record = {"commit": _commit(), "corpus": {"path": args.corpus, "source_commit": CORPUS_COMMIT,
                                              "schemas": len(everything)},
              "hardware": {"machine": platform.machine(), "processor": platform.processor(),
                           "python": platform.python_version()},
              "config": {"per_category": args.per_category, "seed": args.seed, "max_tokens": args.max_tokens,
                         "model": args.model or "default", "temperature": 1.0, "wall_s": wall},
              "admission_whole_corpus": admission, "sample": result, "targets": targets}
    print(f"{'':24}{'schemas':>8}{'rejected':>9}{'valid':>7}{'invalid':>8}{'length':>7}{'p50 s':>8}{'p95 s':>8}")
    print(f"{'sample':24}{result['schemas']:>8}{result['rejected']:>9}{result['valid']:>7}{result['invalid']:>8}"
          f"{result['length']:>7}{result['compile_s_p50']:>8.3f}{result['compile_s_p95']:>8.3f}")
    print(f"{'admission, whole corpus':24}{admission['schemas']:>8}{admission['rejected']:>9}   "
          f"rejected {100 * admission['rejected_frac']:.1f}%  backends {admission['backends']}")
    for t in targets:
        print(f"  {t['name']}: {t['value']:.4g} (target {t['target']}) {'met' if t['met'] else 'NOT met'}")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
