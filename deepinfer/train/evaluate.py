"""Measure an exported checkpoint through the engine (not the training code).

    python -m deepinfer.train.evaluate loss --model deepinfer-tiny --tokens build/tokens
    python -m deepinfer.train.evaluate accept --model deepinfer-tiny --tokens build/tokens -k 3
    python -m deepinfer.train.evaluate accept --model deepinfer-tiny-dspark --tokens build/tokens -k 5 --varlen

`loss`: mean next-token cross-entropy over evenly spaced held-out crops, each prefilled by
the engine's reference path from the loaded (FP8 / FP4) checkpoint, so the number the
model card quotes is what `LLM()` computes. `accept`: greedy continuations of held-out
prompts with speculative decoding on, the engine's acceptance counters per draft position,
mean accepted length and effective tokens per step.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from deepinfer.models.default_model import resolve_model
from deepinfer.models.loader import load_model
from deepinfer.models.standalone import StandaloneRunner


def heldout_crops(tokens: np.ndarray, seq_len: int, count: int) -> list[list[int]]:
    """`count` evenly spaced crops of seq_len + 1 tokens (the fixed evaluation set)."""
    starts = np.linspace(0, len(tokens) - seq_len - 2, count).astype(np.int64)
    return [tokens[s: s + seq_len + 1].astype(np.int64).tolist() for s in starts]


@torch.no_grad()
def heldout_loss(model: str, tokens: np.ndarray, seq_len: int = 512, count: int = 32,
                 dtype: str = "float32", device: str = "cpu") -> dict:
    """Mean CE (nats/token) and perplexity of the engine's forward over held-out crops."""
    net = load_model(resolve_model(model), dtype=dtype, device=device)
    runner = StandaloneRunner(net, max_seqs=1, max_len=seq_len + 1, block_size=128)
    total, n = 0.0, 0
    for crop in tqdm(heldout_crops(tokens, seq_len, count), desc="held-out loss", mininterval=5):
        runner.lengths.clear()
        logits = runner.step([(0, crop[:-1])])[0]
        total += float(F.cross_entropy(logits.float(), torch.tensor(crop[1:], device=logits.device), reduction="sum"))
        n += seq_len
    ce = total / n
    return {"model": model, "ce": ce, "perplexity": math.exp(ce), "tokens": n, "seq_len": seq_len,
            "crops": count, "dtype": dtype}


def acceptance(model: str, tokens: np.ndarray, k: int, varlen: bool = False, prompts: int = 16,
               prompt_len: int = 64, max_tokens: int = 48, temperature: float = 0.0) -> dict:
    """Speculative decoding on held-out prompts through `LLM`: the engine's acceptance counters."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=model, num_speculative_tokens=k, enable_mtp_varlen=varlen, max_model_len=1024)
    crops = heldout_crops(tokens, prompt_len, prompts)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seq_seed=1)
    llm.generate(prompt_token_ids=[c[:prompt_len] for c in crops], sampling_params=params, use_tqdm=False)
    metrics = llm.runner.spec.metrics
    spec, acc = metrics.summary(), metrics.accepted
    spec["conditional_acceptance"] = [acc[0] / max(1, metrics.proposed[0])] + [
        acc[j] / max(1, acc[j - 1]) for j in range(1, len(acc))]
    return {"model": model, "k": k, "varlen": varlen, "temperature": temperature, "prompts": prompts,
            "prompt_len": prompt_len, "max_tokens": max_tokens, **spec}


def main(argv: list[str] | None = None) -> None:
    from .data import load_tokens

    p = argparse.ArgumentParser(description="Evaluate an exported checkpoint through the engine.")
    p.add_argument("what", choices=["loss", "accept"])
    p.add_argument("--model", default="deepinfer-tiny")
    p.add_argument("--tokens", required=True, help="tokenized corpus dir (its val split is used)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--count", type=int, default=32)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--varlen", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    val = load_tokens(args.tokens, "val")
    if args.what == "loss":
        out = heldout_loss(args.model, val, args.seq_len, args.count)
    else:
        out = acceptance(args.model, val, args.k, args.varlen, temperature=args.temperature)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
