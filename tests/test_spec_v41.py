"""Speculative decoding on DeepSeek-V4.1 (tiny random checkpoint, DSpark drafter).

Greedy output with speculation (fixed and confidence-scheduled) equals greedy output
without it token for token, batched and one request at a time, under SWA bounded replay
(off / mask / compact), chunked prefill, prefix-cache hits and preemption. Random
weights accept almost no draft, so a prefix of every real draft is replaced by the known
continuation: accepted drafts of every length occur, and the rejected rest must be
rolled back in every V4.1 group (encoder / decoder windows, the sources' shared entries
and index keys, the ratio-2 compressor ring, Engram's token rows). The ring needs its
extra rows: without them the output changes.
"""

from __future__ import annotations

import random

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.models.tiny import tiny_v41_config, write_tiny_checkpoint
from deepinfer.spec.dspark_drafter import DSparkDrafter
from deepinfer.spec.scheduling import StepTimeCurve

VOCAB, WINDOW, KEEP = 1024, 32, 40
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (14, 9, 16, 11, 12)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_v41_spec")
    write_tiny_checkpoint(str(path), seed=11, cfg=tiny_v41_config(vocab_size=VOCAB, sliding_window=WINDOW))
    return str(path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(64)]
    return [[rng.randrange(VOCAB) for _ in range(5)], shared + [rng.randrange(VOCAB) for _ in range(9)],
            [rng.randrange(VOCAB) for _ in range(97)], shared + [rng.randrange(VOCAB) for _ in range(30)],
            [rng.randrange(VOCAB) for _ in range(KEEP)]]


def make(checkpoint: str, mode: str = "off", **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    return LLM(checkpoint, dtype="float32", swa_replay_mode=mode, swa_replay_keep=KEEP, **kw)


def generate(llm: LLM, prompts: list[list[int]], params=PARAMS) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    generate.preemptions = sum(o.metrics.num_preemptions for o in outs)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts) -> dict[str, list[list[int]]]:
    return {mode: generate(make(checkpoint, mode), prompts) for mode in ("off", "mask", "compact")}


def known_prefix_drafts(llm: LLM, by_prompt: dict[tuple[int, ...], list[int]]) -> dict[str, int]:
    """Overwrite the first j (0..k, varying per step) tokens of each real draft with the
    request's known continuation (looked up by prompt, so it works one request at a time)."""
    drafter, scheduler = llm.runner.spec.drafter, llm.scheduler
    real = drafter.propose
    seen = {"steps": 0}

    def propose(ctx, k):
        out = real(ctx, k)
        seen["steps"] += 1
        for r, emitted in zip(ctx.scheduled, ctx.emitted):
            d, req = out.get(r.req_id), scheduler.requests.get(r.req_id)
            if d is None or emitted is None or req is None:
                continue
            ref = by_prompt[tuple(req.prompt_token_ids)]
            done, j = r.output_len + len(emitted), seen["steps"] % (k + 1)
            d.tokens = (ref[done: done + j] + d.tokens[j:])[: len(d.tokens)]
        return out

    drafter.propose = propose
    return seen


@pytest.mark.parametrize("mode,k,varlen,extra", [
    ("off", 3, False, {"max_num_batched_tokens": 64}),
    ("compact", 5, True, {"max_num_batched_tokens": 48}),
    ("mask", 4, False, {"block_size": 16, "num_kv_blocks": 12, "max_num_batched_tokens": 64}),  # preemption
])
def test_v41_greedy_speculation_equals_no_speculation(checkpoint, prompts, reference, mode, k, varlen, extra):
    ref = reference[mode]
    llm = make(checkpoint, mode, num_speculative_tokens=k, enable_mtp_varlen=varlen, **extra)
    if varlen:  # free verify rows: the scheduler admits the (partly known, so accepted) drafts
        llm.runner.spec.curve = StepTimeCurve([1, 1024], [0.01, 0.01])
    assert isinstance(llm.runner.spec.drafter, DSparkDrafter) and llm.runner.spec.drafter.family.name == "deepseek_v41"
    known_prefix_drafts(llm, {tuple(p): r for p, r in zip(prompts, ref)})
    for _ in range(2):  # the second pass starts from prefix-cache hits (capped at the cut with replay on)
        assert generate(llm, prompts) == ref
    m = llm.runner.spec.metrics
    assert m.acceptance_per_position()[0] > 0.3 and 1.3 < m.effective_tokens_per_step < k + 1
    if "num_kv_blocks" in extra:
        assert generate.preemptions > 0
    llm.kv_manager.assert_consistent()
    assert all(p.num_free == p.num_blocks for p in llm.kv_manager.pools.values())


def test_v41_speculation_one_request_at_a_time_equals_batched(checkpoint, prompts, reference):
    llm = make(checkpoint, "compact", num_speculative_tokens=3, enable_prefix_caching=False)
    known_prefix_drafts(llm, {tuple(p): r for p, r in zip(prompts, reference["compact"])})
    alone = [generate(llm, [p], [sp])[0] for p, sp in zip(prompts, PARAMS)]
    assert alone == reference["compact"]
    short = [i for i, p in enumerate(prompts) if len(p) <= KEEP]
    assert short and all(reference["compact"][i] == reference["off"][i] for i in short)  # replay exact there


def test_v41_ring_rollback_needs_the_wider_ring(checkpoint, prompts, reference, monkeypatch):
    """Rejected drafts overwrite the ratio-2 source's ring row of the open group's first
    token unless the ring has k + 1 extra rows: the next step then pools a wrong entry."""
    import deepinfer.spec.kv as kv

    monkeypatch.setattr(kv, "widen_compressor_rings", lambda cache, k: None)
    llm = make(checkpoint, "off", num_speculative_tokens=5)
    assert generate(llm, prompts) != reference["off"]


def test_v41_without_a_dspark_drafter_is_refused_with_a_clear_error(tmp_path):
    """V4.1's `mtp.*` stages are DSpark stages (no e_proj / h_proj): there is no MTP fallback."""
    write_tiny_checkpoint(str(tmp_path), seed=1, cfg=tiny_v41_config(vocab_size=VOCAB, dspark_block_size=0))
    with pytest.raises(ValueError, match="V4.1 checkpoint needs its DSpark drafter"):
        LLM(str(tmp_path), dtype="float32", max_model_len=128, num_speculative_tokens=2)
