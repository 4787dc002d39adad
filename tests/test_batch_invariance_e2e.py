"""End to end, batch-invariant mode on CPU: a seeded sampled request gives bitwise the same
tokens and log-probs whatever traffic shares its steps (batch sizes 1..64, different
prompt lengths, chunked prefill through a small token budget, prefix-cache hits), with
the synchronous loop and with async scheduling (step N+1 scheduled while step N runs).

Run ``python tests/test_batch_invariance_e2e.py [--off] [--dtype bfloat16] [--async]`` to
print the unique-output counts, e.g. with the mode off.
"""

from __future__ import annotations

import random
import sys

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

VOCAB = 512
SEED = 0xC0FFEE_1234_5678  # a fixed uint64 seq_seed
rng0 = random.Random(7)
SHARED = [rng0.randrange(VOCAB) for _ in range(140)]  # > one 128-token block: prefix hits
TARGET = SHARED + [rng0.randrange(VOCAB) for _ in range(9)]
TARGET_PARAMS = SamplingParams(temperature=1.0, seq_seed=SEED, max_tokens=6, ignore_eos=True)


def traffic(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """n varied requests: lengths 3..200, a third share TARGET's prefix, mixed sampling."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([3, 17, 40, 70, 129, 200])
        if rng.random() < 0.35:
            prompt = SHARED[: rng.choice([60, 130, 140])] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(length)]
        kind = rng.randrange(3)
        new = rng.randrange(1, 7)
        params = (SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True) if kind == 0 else
                  SamplingParams(temperature=0.8, top_p=0.9, max_tokens=new, ignore_eos=True) if kind == 1 else
                  SamplingParams(temperature=1.0, top_k=20, max_tokens=new, seq_seed=rng.randrange(2**64),
                                 ignore_eos=True))
        out.append((prompt, params))
    return out


def run_mixed(llm: LLM, n_target: int, others: list[tuple[list[int], SamplingParams]], seed: int,
              cached: list[int] | None = None) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """Submit n_target copies of TARGET shuffled among `others` in one generate() call;
    return (tokens, logprobs) of every copy (and append their prefix-hit lengths to `cached`)."""
    items = [(TARGET, TARGET_PARAMS, True)] * n_target + [(p, sp, False) for p, sp in others]
    random.Random(seed).shuffle(items)
    outs = llm.generate(prompt_token_ids=[p for p, _, _ in items], sampling_params=[sp for _, sp, _ in items],
                        use_tqdm=False)
    mine = [o for o, (_, _, t) in zip(outs, items) if t]
    if cached is not None:
        cached += [o.metrics.num_cached_tokens for o in mine if o.metrics is not None]
    return [(tuple(o.token_ids), tuple(o.logprobs or ())) for o in mine]


def make_llm(path: str, invariant: bool, dtype: str = "float32", async_scheduling: bool = False) -> LLM:
    """Small token budget so prompts are split into chunks that depend on the traffic."""
    llm = LLM(path, dtype=dtype, batch_invariant=invariant, max_model_len=512, max_num_batched_tokens=80,
              max_num_seqs=128, async_scheduling=async_scheduling)
    assert (llm.async_loop is not None) == async_scheduling
    return llm


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("bi_tiny")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


def check(path: str, invariant: bool, dtype: str = "float32", async_scheduling: bool = False) -> dict[str, int]:
    """Run both scenarios; return the number of unique (tokens, logprobs) in each."""
    llm = make_llm(path, invariant, dtype, async_scheduling)
    assert llm.runner.batch_invariant is invariant
    cached: list[int] = []
    alone = run_mixed(llm, 1, [], seed=0, cached=cached)  # cold cache: computed from scratch
    sizes = {f"batch{n}": run_mixed(llm, 1, traffic(n - 1, seed=n), seed=n) for n in (1, 7, 64)}
    others = traffic(40, seed=99)  # the second call hits the prefixes the first one cached
    mixed = run_mixed(llm, 64, others, seed=1, cached=cached) + run_mixed(llm, 64, others, seed=2, cached=cached)
    assert cached[0] == 0 and max(cached) >= 128, "the scenario must include cold runs and prefix hits"
    every = alone + [r for v in sizes.values() for r in v]
    return {"alone_vs_batches": len(set(every)), "mixed_64x2": len(set(mixed)),
            "all": len(set(every + mixed)), "tokens_only": len({t for t, _ in every + mixed})}


def test_seeded_request_is_batch_invariant_fp32(checkpoint: str) -> None:
    counts = check(checkpoint, invariant=True)
    assert counts == {"alone_vs_batches": 1, "mixed_64x2": 1, "all": 1, "tokens_only": 1}, counts


def test_seeded_request_is_batch_invariant_async(checkpoint: str) -> None:
    """64 copies among varied traffic (chunked prefill, prefix hits) with async scheduling:
    one unique output, and the same bits as the synchronous loop gives the request alone."""
    sync_alone = run_mixed(make_llm(checkpoint, True), 1, [], seed=0)
    llm = make_llm(checkpoint, True, async_scheduling=True)
    cached: list[int] = []
    alone = run_mixed(llm, 1, [], seed=0, cached=cached)
    others = traffic(40, seed=99)
    mixed = run_mixed(llm, 64, others, seed=1, cached=cached) + run_mixed(llm, 64, others, seed=2, cached=cached)
    assert len(mixed) == 128 and max(cached) >= 128, "the scenario must include prefix hits"
    assert len(set(sync_alone + alone + mixed)) == 1


def test_seeded_request_is_batch_invariant_bf16(checkpoint: str) -> None:
    llm = make_llm(checkpoint, True, "bfloat16")
    alone = run_mixed(llm, 1, [], seed=0)
    mixed = run_mixed(llm, 8, traffic(12, seed=97), seed=3) + run_mixed(llm, 1, traffic(6, seed=7), seed=7)
    assert len(set(alone + mixed)) == 1


if __name__ == "__main__":  # manual report, e.g. --off to see the mode's effect
    import tempfile

    path = tempfile.mkdtemp()
    write_tiny_checkpoint(path, seed=3, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    dtype = sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv else "float32"
    print(dtype, "batch_invariant=", "--off" not in sys.argv, "async=", "--async" in sys.argv,
          check(path, "--off" not in sys.argv, dtype, "--async" in sys.argv))
