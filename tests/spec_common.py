"""Shared workload for the speculative-decoding engine tests: a mixed batch (a shared
128-token prefix, 5-133-token prompts) with greedy params, and a small-engine factory."""

from __future__ import annotations

import random

from deepinfer import LLM, SamplingParams

VOCAB = 512
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 17, 30, 9, 21)]


def mixed_prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(VOCAB) for _ in range(128)]
    return [[rng.randrange(VOCAB) for _ in range(5)], shared + [rng.randrange(VOCAB) for _ in range(9)],
            [rng.randrange(VOCAB) for _ in range(61)], shared + [rng.randrange(VOCAB) for _ in range(3)],
            [rng.randrange(VOCAB) for _ in range(133)]]


def make_llm(ckpt: str, **kw) -> LLM:
    kw.setdefault("max_model_len", 512)
    kw.setdefault("max_num_seqs", 8)
    return LLM(ckpt, dtype="float32", **kw)
