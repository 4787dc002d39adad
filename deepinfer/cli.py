"""`deepinfer` console command.

    deepinfer generate --prompt "Hello" [--model DIR] [--max-tokens 32] [--temperature 0]
    deepinfer write-tiny OUT_DIR [--seed 0] [--quantize]
    deepinfer config            # print the resolved engine configuration and the DEEPINFER_* variables set
    deepinfer serve [--model DIR] [--host 127.0.0.1] [--port 8000] [engine args]   # OpenAI-compatible server
    deepinfer bench serve --base-url URL [--request-rate R|inf] [--max-concurrency C] ...
"""

from __future__ import annotations

import argparse
import json
import sys


def _generate(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seq_seed=args.seed)
    prompts = args.prompt or ["Hello, my name is"]
    outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "seq_seed": out.seq_seed}))
        else:
            print(f"--- prompt: {out.prompt!r}\n{out.text}\n[finish_reason={out.finish_reason}, "
                  f"tokens={len(out.token_ids)}, seq_seed={out.seq_seed}]")
    return 0


def _write_tiny(args: argparse.Namespace) -> int:
    from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

    print(write_tiny_checkpoint(args.out_dir, seed=args.seed, quantize=args.quantize,
                                cfg=tiny_config(vocab_size=args.vocab_size)))
    return 0


def _config(args: argparse.Namespace) -> int:
    from deepinfer import envs
    from deepinfer.config import EngineConfig

    values = envs.check()  # every DEEPINFER_* variable set: known, valid, aliases agreeing
    print(EngineConfig.from_kwargs().describe())
    rows = [(name, repr(value), envs.set_name(name)) for name, value in values.items()]
    if rows:
        widths = [max(len(r[i]) for r in rows + [("variable", "value", "set as")]) for i in range(3)]
        print("\nDEEPINFER_* variables set (declared in deepinfer/envs.py)")
        for r in [("variable", "value", "set as"), tuple("-" * w for w in widths), *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _serve(args: argparse.Namespace) -> int:
    from deepinfer.serve.server import serve
    return serve(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from deepinfer.serve.bench import run_cli
    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4 inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for one or more prompts")
    gen.add_argument("--model", default=None, help="checkpoint dir (default: DEEPINFER_HF_MODEL_DIR or the tiny model)")
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None, help="seq_seed for sampling")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="one JSON object per output")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(func=_generate)
    tiny = sub.add_parser("write-tiny", help="write a random-weight checkpoint in the official layout")
    tiny.add_argument("out_dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--quantize", action="store_true")
    tiny.add_argument("--vocab-size", type=int, default=129280)
    tiny.set_defaults(func=_write_tiny)
    cfg = sub.add_parser("config", help="print the engine configuration resolved from the environment")
    cfg.set_defaults(func=_config)
    from deepinfer.serve.bench import add_bench_arguments
    from deepinfer.serve.server import add_serve_arguments

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, SSE, /metrics)")
    add_serve_arguments(srv)
    srv.set_defaults(func=_serve)
    bench = sub.add_parser("bench", help="benchmarks against a running server").add_subparsers(
        dest="bench", required=True)
    bs = bench.add_parser("serve", help="open-loop load test of a server: TTFT/TPOT/ITL/e2e percentiles, goodput")
    add_bench_arguments(bs)
    bs.set_defaults(func=_bench_serve)
    # listed for --help only: main() hands `eval ...` to deepinfer.eval.cli before parsing
    sub.add_parser("eval", help="offline benchmarks: `deepinfer eval generate|score` (see --help there)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "eval":  # `deepinfer eval ...` has its own parser
        from deepinfer.eval.cli import main as eval_main
        return eval_main(argv[1:])
    args = build_parser().parse_args(argv)
    from deepinfer.errors import DeepInferError

    try:
        return args.func(args)
    except (DeepInferError, ValueError, FileNotFoundError) as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
