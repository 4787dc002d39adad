#!/usr/bin/env python
"""Host cost of admitting a batch of long prompts, and what they cost each full GC after.

    PYTHONPATH=. python3 profiling/prompt_host_cost.py [--batch 256] [--context 16384] [--out DIR]

decode_grid.py saw over a hundred milliseconds of garbage collection per call in its batch
256 x 16k-context cells. The engine held each prompt's ids as Python lists (the request's prompt and all-ids
lists, the detokenizer's copy); a full collection visits every element of every live list.
This times, with no model and no device, the per-call host work a ``generate`` of
``batch`` prompts of ``context`` ids does before the first step (admission's validation,
``Request``, the detokenizer of each, the KV cache's block hashes) and then one full
collection with those requests alive. Run it at two commits to compare; the JSON goes to
``--out`` as ``prompt_host_cost_cpu_<commit>.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import numpy as np  # noqa: E402
from fastpath_bench import commit  # noqa: E402

from deepinfer.detokenizer import IncrementalDetokenizer  # noqa: E402
from deepinfer.engine.admission import prompt_items  # noqa: E402
from deepinfer.engine.kv_cache_manager import HybridKVCacheManager, KVCacheGroupSpec  # noqa: E402
from deepinfer.engine.request import Request  # noqa: E402
from deepinfer.profiling.records import save_json  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402

VOCAB = 129280


class _Chars:
    """A decoder that costs nothing per id (the tokenizer is not what is measured)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, round((time.perf_counter() - t) * 1e3, 2)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=256, help="KV block size of the hashes")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, args.context).tolist() for _ in range(args.batch)]
    engine = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))
    kv = HybridKVCacheManager([KVCacheGroupSpec("full", None)], {"full": 8}, args.block_size, max_num_seqs=1,
                              enable_prefix_caching=True)
    gc.collect()
    gc.freeze()  # what EngineCore does after start: only what this call makes is collected
    items, admit_ms = _timed(lambda: prompt_items(engine, None, prompts))
    sp = SamplingParams(max_tokens=16)
    reqs, request_ms = _timed(lambda: [Request(str(i), ids, sp) for i, (_, ids) in enumerate(items)])
    detoks, detok_ms = _timed(lambda: [IncrementalDetokenizer(_Chars(), r.prompt_token_ids) for r in reqs])
    _, hash_ms = _timed(lambda: [kv._update_hashes(r) for r in reqs])
    del prompts, items  # the caller's lists are the caller's: only what the engine keeps stays
    _, gc_full_ms = _timed(lambda: gc.collect(2))
    record = {"commit": commit(), "hardware": "cpu", "batch": args.batch, "context": args.context,
              "block_size": args.block_size, "admit_ms": admit_ms, "request_ms": request_ms,
              "detokenizer_ms": detok_ms, "block_hash_ms": hash_ms,
              "host_before_first_step_ms": round(admit_ms + request_ms + detok_ms + hash_ms, 2),
              "full_gc_ms_with_requests_alive": gc_full_ms,
              "prompt_ids_type": type(reqs[0].prompt_token_ids).__name__}
    gc.unfreeze()
    print(f"{args.batch} x {args.context} ids: admit {admit_ms} ms, requests {request_ms} ms, detokenizers "
          f"{detok_ms} ms, block hashes {hash_ms} ms; one full GC after: {gc_full_ms} ms "
          f"(ids held as {record['prompt_ids_type']})")
    save_json(args.out, f"prompt_host_cost_cpu_{record['commit'][:7]}.json", record)
    return record


if __name__ == "__main__":
    main()
