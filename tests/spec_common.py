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


def run_recording_drafts(monkeypatch, model: str, k: int, prompts: list[str], after_verify: bool):
    """Greedy speculation (24 tokens per prompt) with the verify and draft graphs captured at
    start (emulated on the host), each step's attached drafts recorded as {req_id: (tokens,
    confidences)}; ``after_verify=False`` drafts from the host result instead of behind the
    verify graph. Returns (spec decoder, output tokens, recorded steps)."""
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    # the synchronous loop: a plan made ahead (async) caps drafts near max_tokens by the
    # optimistic in-flight count, so the host path's steps would differ at the end
    llm = LLM(model, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
              num_speculative_tokens=k, async_scheduling=False)
    spec = llm.runner.spec
    if not after_verify:
        monkeypatch.setattr(spec.drafter, "draft_after_verify", lambda *args: None)
    steps, attach = [], spec.attach

    def recording_attach(scheduler, structured=None, in_flight=frozenset()):
        steps.append({rid: (d.tokens, d.confidences) for rid, d in spec.drafts.items()})
        attach(scheduler, structured, in_flight)

    monkeypatch.setattr(spec, "attach", recording_attach)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return spec, [o.token_ids for o in outs], steps


def assert_same_drafts(steps: list[dict], want_steps: list[dict]) -> None:
    """Step by step the same requests, the same draft tokens, confidences within float32 rounding."""
    import pytest

    assert len(steps) == len(want_steps)
    for got, want in zip(steps, want_steps):
        assert sorted(got) == sorted(want)
        for rid, (toks, confs) in got.items():
            assert toks == want[rid][0]
            assert confs == pytest.approx(want[rid][1], rel=1e-4, abs=1e-6)
