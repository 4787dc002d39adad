"""Why offline `LLM.generate` of several waves of requests can run slower per step than one wave.

serve_h200's saturation row submits ``waves x batch`` requests to one `LLM.generate` call with
``batch`` in flight, and its mean step time came out about twice the server's on the same engine
settings. This study runs one wave and then several in one process on a random bf16 ``mini`` model
and reports, per wave, the step kinds (pure decode, prefill, mixed), their step times
(`llm.metrics.steps_df`) and the fast path's counters (graph replays, eager and uncaptured steps),
under async scheduling and the sync loop, so the slow steps get a name.

The server's saturation row keeps ``batch`` requests in flight the way `deepinfer bench serve`
does: a finished request is replaced only after its last delta has reached the client and the
next request has come back over HTTP, so replacements land a few engine steps late and spread
over several steps. The ``closed_loop_rtt<r>`` cases drive the engine core the same way without
a server (each finished request is replaced after a random 0..r steps), so the cost of that
staggering (more, smaller mixed steps) is measured apart from HTTP and the engine process.

    python3 profiling/offline_waves.py [--batch 64 --prompt-len 256 --new 128 --waves 4 --rtt-steps 0,4] [--tiny]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.engine.admission import admit_generate  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config, write_tiny_checkpoint  # noqa: E402
from deepinfer.profiling.compiles import TritonCompiles  # noqa: E402
from deepinfer.profiling.records import result_tag, save_json  # noqa: E402


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def step_kinds(df) -> dict[str, dict[str, float]]:
    """Step count, mean and p90 step ms per kind (decode: no prefill token; prefill: no decode
    token; mixed: both)."""
    kind = (df.prefill_tokens > 0).map({True: "prefill", False: "decode"})
    kind[(df.prefill_tokens > 0) & (df.decode_tokens > 0)] = "mixed"
    out = {}
    for name, group in df.groupby(kind):
        out[name] = {"steps": int(len(group)), "mean_ms": float(group.step_ms.mean()),
                     "p90_ms": float(group.step_ms.quantile(0.9)), "batch_mean": float(group.batch_size.mean())}
    return out


@contextlib.contextmanager
def measured(llm: LLM) -> Iterator[dict]:
    """Time the block's engine steps: the caller sets ``rec["tokens"]``; on exit ``rec`` gains the
    wall time, tok/s, step count and kinds, the fast path's counters and the Triton compiles
    (a kernel compiled inside the measured call costs its steps)."""
    fast = llm.runner.fast
    before = dict(fast.stats) if fast else {}
    llm.metrics.reset()
    rec: dict = {}
    with TritonCompiles() as compiles:
        t = time.perf_counter()
        yield rec
        wall = time.perf_counter() - t
    df = llm.metrics.steps_df()
    after = dict(fast.stats) if fast else {}
    rec |= {"wall_s": wall, "tok_s": rec["tokens"] / wall, "steps": int(len(df)),
            "wall_ms_per_step": 1000 * wall / max(len(df), 1),
            "step_ms_sum_over_wall": float(df.step_ms.sum() / 1000 / wall), "kinds": step_kinds(df),
            "fast_path": {k: after[k] - before.get(k, 0) for k in after}, **compiles.summary()}


def run_case(llm: LLM, n: int, args: argparse.Namespace, vocab: int, seed: int) -> dict:
    sp = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    with measured(llm) as rec:
        outs = llm.generate(prompt_token_ids=prompts(n, args.prompt_len, vocab, seed), sampling_params=sp,
                            use_tqdm=False)
        rec["tokens"] = sum(len(o.token_ids) for o in outs)
    return {"requests": n, **rec}


def run_closed_loop(llm: LLM, n: int, args: argparse.Namespace, vocab: int, seed: int, rtt_steps: int) -> dict:
    """``n`` requests through the engine core, at most ``args.batch`` in flight; each finished one
    is replaced after a random 0..``rtt_steps`` engine steps (a client's round trip)."""
    core, rng = llm.engine, random.Random(seed)
    sp = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    pending = prompts(n, args.prompt_len, vocab, seed)
    due: list[int] = [0] * args.batch  # the step at which each free client sends its next request
    step = tokens = 0

    def send() -> None:
        items, params = admit_generate(core, prompts=None, sampling_params=[sp], prompt_token_ids=[pending.pop()])
        core.add_request(f"closed-{seed}-{len(pending)}", items[0][1], params[0])

    with measured(llm) as rec:
        while pending or core.has_unfinished():
            while pending and due and min(due) <= step:
                due.remove(min(due))
                send()
            for delta in core.step():
                if delta.finished:
                    tokens += len(core.output(delta.request_id).token_ids)
                    due.append(step + rng.randint(0, rtt_steps))
            step += 1
        rec["tokens"] = tokens
    return {"requests": n, "rtt_steps": rtt_steps, **rec}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--rtt-steps", default="0,4",
                    help="closed-loop cases: a finished request is replaced after up to this many steps")
    ap.add_argument("--tiny", action="store_true", help="CPU stand-in (tests of this script)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if args.tiny:
        cfg, dtype, engine = tiny_config(vocab_size=4096), torch.float32, {"dtype": "float32"}
    else:
        cfg, dtype, engine = mini_config(), torch.bfloat16, {"dtype": "bfloat16"}
    engine |= {"max_num_seqs": args.batch, "max_model_len": args.prompt_len + args.new + 64}
    ckpt = write_tiny_checkpoint(tempfile.mkdtemp(prefix="offline_waves_"), seed=0, cfg=cfg, dtype=dtype)
    hw = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    results = {}
    for mode in ("async", "sync"):
        os.environ["DEEPINFER_ASYNC_SCHEDULING"] = "1" if mode == "async" else "0"
        llm = LLM(ckpt, **engine)
        results[mode] = {"warmup": run_case(llm, args.batch, args, cfg.vocab_size, 0)}  # compiles, graphs
        results[mode] |= {f"waves_{w}": run_case(llm, w * args.batch, args, cfg.vocab_size, 10 + w)
                         for w in (1, args.waves)}
        if mode == "async":  # the engine loop a served engine runs
            results[mode] |= {f"closed_loop_rtt{r}": run_closed_loop(llm, args.waves * args.batch, args,
                                                                     cfg.vocab_size, 20 + r, r)
                              for r in (int(x) for x in args.rtt_steps.split(","))}
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    os.environ.pop("DEEPINFER_ASYNC_SCHEDULING", None)
    commit = os.environ.get("DEEPINFER_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip() or None
    out = {"hardware": hw, "commit": commit, "config": vars(args) | {"engine": engine}, "results": results}
    print(f"{'mode':<6} {'waves':>6} {'tok/s':>8} {'steps':>5} {'ms/step':>8} {'compiles':>8}  kinds (steps, mean ms)"
          "  fast path")
    for mode, cases in results.items():
        for name, r in cases.items():
            kinds = " ".join(f"{k}:{v['steps']}@{v['mean_ms']:.2f}" for k, v in r["kinds"].items())
            print(f"{mode:<6} {name.removeprefix('waves_').replace('closed_loop_', 'cl'):>6} {r['tok_s']:>8.0f} {r['steps']:>5} "
                  f"{r['wall_ms_per_step']:>8.3f} {r['compiles']:>8}  {kinds}  {r['fast_path']}")
    tag = result_tag(hw)
    save_json(args.out, f"offline_waves_{tag}_{commit}.json", out)
    return out


if __name__ == "__main__":
    main()
