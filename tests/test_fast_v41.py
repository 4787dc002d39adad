"""DeepSeek-V4.1 on the compiled decode path (deepinfer/models/v41/fast/) on CPU: the
batched decode of every layer kind (KV source with ratio-2 pooling and ratio-1
projection, consumers of shared KV, index sources with the two-level candidate filter,
Engram, shifted mHC), run with the kernels' torch references (DEEPINFER_FASTPATH=ref) and
with the interpreted Triton kernels (=triton), must give the reference path's greedy
tokens and log-probs, with and without (emulated) CUDA graphs and bounded replay."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.tiny import tiny_v41_config, write_tiny_checkpoint  # noqa: E402

VOCAB, WINDOW, KEEP = 512, 32, 40


def _checkpoint(tmp_path_factory, name: str, sim: bool) -> str:
    path = tmp_path_factory.mktemp(name)
    # index_topk 8 < the entries of most prompts; 4 candidate blocks of 8 entries < the
    # ratio-1 entries of the long prompts, so the candidate filter prunes for real;
    # head_dim 64 keeps the FP8 (32) / FP4 (16, 32) rounding blocks when ``sim``
    cfg = tiny_v41_config(vocab_size=VOCAB, sliding_window=WINDOW, index_topk=8, candidate_topk_blocks=4,
                          simulate_kv_quant=sim)
    write_tiny_checkpoint(str(path), seed=13, cfg=cfg)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "tiny_v41_fast", sim=False)


@pytest.fixture(scope="module")
def ckpt_sim(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "tiny_v41_fast_sim", sim=True)


PROMPTS = [[(3 * i + 7 * j) % VOCAB for j in range(n)] for i, n in enumerate((1, 6, 37, 90, 200))]


def _run(ckpt, monkeypatch, mode, graphs="0", replay="off", tokens=10, prompts=PROMPTS, **kw):
    monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", graphs)
    llm = LLM(ckpt, dtype="float32", max_model_len=320, max_num_seqs=8, block_size=16, swa_replay_mode=replay,
              swa_replay_keep=KEEP, **kw)
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, top_logprobs=2)
    return llm, llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)


def _same(ref, fast, tol=1e-4):
    for a, b in zip(ref, fast):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert math.isclose(x, y, rel_tol=tol, abs_tol=tol)


@pytest.mark.parametrize("graphs", ["0", "1"])  # "1": the graph path's padded static buffers, run eagerly
def test_v41_fast_decode_matches_reference(ckpt, monkeypatch, graphs):
    ref_llm, ref = _run(ckpt, monkeypatch, "0")
    assert ref_llm.runner.fast is None
    fast_llm, fast = _run(ckpt, monkeypatch, "ref", graphs)
    stats = fast_llm.runner.fast.stats
    assert stats["fast_steps"] >= 9 and (stats["graph_steps"] > 0) == (graphs == "1")
    _same(ref, fast)


def test_v41_fast_decode_triton_kernels(ckpt, monkeypatch):
    """The interpreted Triton kernels (shifted mHC, indexer scores, decode attention, router,
    fused MoE) in the same places; two requests whose contexts pass the candidate filter's
    reach (the interpreter is slow)."""
    prompts = PROMPTS[2:4]
    _, ref = _run(ckpt, monkeypatch, "0", tokens=3, prompts=prompts)
    fast_llm, fast = _run(ckpt, monkeypatch, "triton", "1", tokens=3, prompts=prompts)
    assert fast_llm.runner.fast.stats["fast_steps"] >= 2
    _same(ref, fast)


def test_v41_fast_decode_kv_rounding(ckpt_sim, monkeypatch):
    """The checkpoint's FP8 window / FP4 shared-KV and index rounding on the batched path."""
    _, ref = _run(ckpt_sim, monkeypatch, "0", tokens=6)
    _, fast = _run(ckpt_sim, monkeypatch, "ref", "1", tokens=6)
    _same(ref, fast)


@pytest.mark.parametrize("replay", ["mask", "compact"])
def test_v41_fast_decode_under_bounded_replay(ckpt, monkeypatch, replay):
    """Decode rows see their whole window under bounded replay, so they take the batched
    path (prefill chunks mixed into a step keep it on the reference path)."""
    _, ref = _run(ckpt, monkeypatch, "0", replay=replay)
    fast_llm, fast = _run(ckpt, monkeypatch, "ref", "1", replay=replay, max_num_batched_tokens=64)
    assert fast_llm.runner.fast.stats["fast_steps"] >= 6
    _same(ref, fast)


def test_replay_free_only_when_every_window_lies_after_the_cut():
    """A step whose rows' windows all start at or after their request's cut may skip the
    narrowing (decode rows: keep >= window); a short chunk near the cut may not."""
    from types import SimpleNamespace

    from deepinfer.models.bounded_replay import ReplayConfig, replay_free

    cfg = SimpleNamespace(sliding_window=WINDOW)
    replay = ReplayConfig("mask", KEEP)  # prompt 200 -> cut 160

    def step(*reqs):
        return SimpleNamespace(scheduled=[SimpleNamespace(start_pos=s, num_prompt_tokens=n) for s, n in reqs])

    assert replay_free(step((200, 200), (30, 30)), replay, cfg)  # decode rows; a prompt shorter than keep
    assert replay_free(step((191, 200)), replay, cfg)  # window [160, 191]
    assert not replay_free(step((190, 200)), replay, cfg)  # window [159, 190] reaches below the cut
    assert replay_free(step((170, 200)), ReplayConfig("off", KEEP), cfg) and replay_free(step((170, 200)), None, cfg)


@pytest.mark.parametrize("replay,graphs", [("off", "0"), ("compact", "1")])
def test_v41_verify_rows_on_the_fast_path(ckpt, monkeypatch, replay, graphs):
    """Speculative verify steps (a token and its DSpark drafts per request) run batched on the
    compiled decode program, DSpark's target features captured there: greedy output equals
    the reference path without speculation, and verify steps with drafts really ran there."""
    import random

    _, ref = _run(ckpt, monkeypatch, "0", replay=replay, tokens=12)
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", graphs)
    llm = LLM(ckpt, dtype="float32", max_model_len=320, max_num_seqs=8, block_size=16, swa_replay_mode=replay,
              swa_replay_keep=KEEP, num_speculative_tokens=3, max_num_batched_tokens=64)
    fast, drafter = llm.runner.fast, llm.runner.spec.drafter
    rows_per_request: list[int] = []
    verify = llm.runner.spec.verify_executor(llm.runner)  # the compiled verify steps
    original, propose = verify.run, drafter.propose
    known = {tuple(p): o.token_ids for p, o in zip(PROMPTS, ref)}
    rng = random.Random(3)

    def recorded(so, batch, capture=None, greedy=False):
        out = original(so, batch, capture, greedy)
        if out is not None:
            rows_per_request.append(max(r.num_tokens for r in so.scheduled))
        return out

    def mostly_right(ctx, k):  # random weights accept nothing: a known prefix of varying length
        out = propose(ctx, k)
        for r, emitted in zip(ctx.scheduled, ctx.emitted):
            d, req = out.get(r.req_id), llm.scheduler.requests.get(r.req_id)
            if d is not None and emitted is not None and req is not None:
                done, j = r.output_len + len(emitted), rng.randrange(k + 1)
                d.tokens = (known[tuple(req.prompt_token_ids)][done: done + j] + d.tokens[j:])[: len(d.tokens)]
        return out

    verify.run, drafter.propose = recorded, mostly_right
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert rows_per_request and max(rows_per_request) > 1, "no verify step with drafts ran on the fast path"
    assert llm.runner.spec.metrics.effective_tokens_per_step > 1.2
    assert (fast.stats["graph_steps"] > 0) == (graphs == "1")


def test_v41_fast_decode_one_expert_per_token(tmp_path, monkeypatch):
    """With one routed expert per token the gate's weight stays its score (no
    normalisation), on the batched path as in the reference."""
    cfg = tiny_v41_config(vocab_size=VOCAB, sliding_window=WINDOW, index_topk=8, candidate_topk_blocks=4,
                          num_experts_per_tok=1)
    write_tiny_checkpoint(str(tmp_path), seed=5, cfg=cfg)
    _, ref = _run(str(tmp_path), monkeypatch, "0", tokens=6, prompts=PROMPTS[:3])
    _, fast = _run(str(tmp_path), monkeypatch, "ref", tokens=6, prompts=PROMPTS[:3])
    _same(ref, fast)
