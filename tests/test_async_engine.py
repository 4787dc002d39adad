"""Async scheduling end to end on the tiny model (CPU): identical outputs to the
synchronous loop across a mixed workload, the device-side gather with debug sentinels,
structured output composed with it (forward of N+1 before N's token reaches the grammar),
the GPU fast path's decode steps, the explicit fallback of data/expert-parallel ranks and
the switch that turns it off."""

from __future__ import annotations

import random

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.engine.request import PLACEHOLDER_TOKEN_ID
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_async")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


def make_llm(ckpt: str, async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("max_model_len", 512)
    kw.setdefault("max_num_seqs", 16)
    llm = LLM(ckpt, dtype="float32", async_scheduling=async_scheduling, **kw)
    assert (llm.async_loop is not None) == async_scheduling
    if llm.async_loop is not None:
        llm.async_loop.tokens.debug = True  # sentinels: a wrong gather fails loudly
    return llm


def mixed_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Shared prefixes (prefix hits), long prompts (chunked prefill), greedy and seeded
    rows, short and long outputs."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(200)]
    prompts, params = [], []
    for i in range(16):
        body = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 100))]
        prompts.append((shared[: rng.choice([0, 130, 200])] + body)[:400])
        greedy = i % 3 == 0
        params.append(SamplingParams(temperature=0.0 if greedy else rng.uniform(0.6, 1.2),
                                     top_k=rng.choice([-1, 20]), top_p=rng.choice([1.0, 0.9]),
                                     max_tokens=rng.randrange(1, 24), seq_seed=1000 + i, ignore_eos=True))
    return prompts, params


def run(llm: LLM, prompts, params):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.token_ids, o.finish_reason, o.stop_reason, o.text) for o in outs], outs


def assert_clean(llm: LLM) -> None:
    llm.kv_manager.assert_consistent()
    for name, pool in llm.kv_manager.pools.items():
        assert pool.num_free == pool.num_blocks, f"group {name} leaked blocks"
    assert llm.kv_manager.num_free_slots == llm.config.max_num_seqs
    assert not llm.scheduler.has_unfinished()
    assert llm.async_loop is None or not llm.async_loop.busy


@pytest.mark.parametrize("mode", [
    dict(max_num_batched_tokens=64),  # chunked prefill, prefix hits
    dict(num_kv_blocks=4, max_num_batched_tokens=128),  # preemption
])
def test_async_equals_sync_on_a_mixed_workload(ckpt, mode):
    prompts, params = mixed_workload(7)
    sync = make_llm(ckpt, False, **mode)
    ref, ref_outs = run(sync, prompts, params)
    # Stop strings and early stops, chosen from the sync outputs so they do fire.
    for i, (toks, _, _, text) in enumerate(ref):
        if i % 4 == 1 and len(toks) > 4:
            params[i] = SamplingParams(**{**_kw(params[i]), "stop_token_ids": [toks[len(toks) // 2]]})
        elif i % 4 == 2 and len(text) > 6:
            params[i] = SamplingParams(**{**_kw(params[i]), "stop": [text[len(text) // 2: len(text) // 2 + 2]]})
    ref, ref_outs = run(sync, prompts, params)
    assert any(isinstance(r[2], int) for r in ref) and any(isinstance(r[2], str) for r in ref), \
        "the workload should stop some requests early, by stop token and by stop string"
    asy = make_llm(ckpt, True, **mode)
    for attempt in range(2):  # the second pass hits the prefix cache left by the first
        got, outs = run(asy, prompts, params)
        assert got == ref, f"pass {attempt}"
        for a, b in zip(outs, ref_outs):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert_clean(asy)
    if mode.get("num_kv_blocks"):
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool should force preemption"
    else:
        assert sum(o.metrics.num_cached_tokens for o in outs) > 0, "the second pass should hit the cache"
    assert asy.metrics.num_steps > 0


def _kw(sp: SamplingParams) -> dict:
    return dict(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, max_tokens=sp.max_tokens,
                seq_seed=sp.seq_seed, ignore_eos=sp.ignore_eos)


def test_async_stress_with_preemption_and_early_eos(ckpt):
    """Every sampled token can be EOS (eos of the tiny model is honoured): early stops
    land while the next step is already planned."""
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 300))] for _ in range(40)]
    params = [SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 16),
                             seq_seed=i, stop_token_ids=[rng.randrange(VOCAB) for _ in range(40)])
              for i in range(40)]
    ref, _ = run(make_llm(ckpt, False, max_num_seqs=32, num_kv_blocks=8, max_num_batched_tokens=256),
                 prompts, params)
    asy = make_llm(ckpt, True, max_num_seqs=32, num_kv_blocks=8, max_num_batched_tokens=256)
    got, outs = run(asy, prompts, params)
    assert got == ref
    assert sum(r[1] == "stop" for r in ref) > 3
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert_clean(asy)


def test_wrong_gather_fails_loudly(ckpt):
    llm = make_llm(ckpt, True)
    buf = llm.async_loop.tokens
    bt = {g: [0] for g in llm.kv_manager.pools}
    so = SchedulerOutput([ScheduledRequest("x", [5, PLACEHOLDER_TOKEN_ID], 0, bt, 3, True, True,
                                           SamplingParams(), 0, 2)], 2)
    with pytest.raises(RuntimeError, match="placeholder"):
        llm.runner.build_batch(so)  # slot 3 never sampled: the sentinel -1 is gathered
    buf.last[3] = 42
    batch = llm.runner.build_batch(so)
    assert batch.input_ids.tolist() == [5, 42]
    assert buf.last[3].item() == PLACEHOLDER_TOKEN_ID  # consumed (debug poison)
    with pytest.raises(RuntimeError, match="placeholder"):
        llm.runner.build_batch(so)  # a second read of the same sample is a wrong gather


def _spy(monkeypatch, cls, name, record):
    """Wrap a real method so each call is logged (the method still runs)."""
    orig = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        record(self, *args)
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapped)


def test_structured_output_composes_with_async(monkeypatch):
    """The forward of step N+1 is launched before step N's token reaches the grammar; only
    its sampling waits for the bitmask. Outputs equal the synchronous loop's, and neither
    the matchers nor the detokenizer ever see a placeholder."""
    pytest.importorskip("xgrammar")
    from deepinfer.detokenizer import IncrementalDetokenizer
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.structured.manager import StructuredOutputManager
    from deepinfer.structured.matcher import RequestGrammar

    kw = dict(dtype="float32", max_model_len=384, max_num_batched_tokens=48, max_num_seqs=8)
    prompts = ["Answer yes or no. " * 6, "Free text here.", "Pick one."]
    params = [SamplingParams(max_tokens=16, temperature=0.0, structured_output={"regex": r"(yes|no|maybe)"}),
              SamplingParams(max_tokens=10, temperature=1.0, seq_seed=5),
              SamplingParams(max_tokens=16, temperature=1.0, seq_seed=9,
                             structured_output={"json": {"type": "object", "properties": {
                                 "a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}})]
    ref = [(o.token_ids, o.finish_reason) for o in LLM(async_scheduling=False, **kw).generate(
        prompts, params, use_tqdm=False)]
    seen: list[int] = []
    log: list[tuple] = []
    _spy(monkeypatch, RequestGrammar, "accept", lambda g, token: seen.append(token))
    _spy(monkeypatch, IncrementalDetokenizer, "update", lambda d, ids: seen.extend(ids))
    _spy(monkeypatch, ModelRunner, "launch", lambda r, so: log.extend(
        ("launch", s.req_id, s.output_len) for s in so.scheduled if s.needs_sample))
    _spy(monkeypatch, StructuredOutputManager, "advance",
         lambda m, req: log.append(("advance", req.req_id, req.num_output_tokens)))
    asy = LLM(**kw)  # async scheduling is the default
    asy.async_loop.tokens.debug = True
    outs = asy.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in outs] == ref
    assert seen and min(seen) >= 0, "a placeholder reached a matcher or the detokenizer"
    stats = asy.async_loop.stats
    assert stats.grammar_waits > 0 and asy.async_loop.num_sync_fallbacks == 0
    # constrained request r: a launch that samples output index m came before the advance
    # that fed output m - 1 (its input, a placeholder on the device) to r's matcher
    constrained = {outs[0].request_id, outs[2].request_id}
    early = [e for k, e in enumerate(log) if e[0] == "launch" and e[1] in constrained and e[2] > 0
             and any(a == ("advance", e[1], e[2]) for a in log[k + 1:])]
    assert early, "no constrained step was launched before its previous token reached the grammar"
    assert not asy.structured.grammars and not asy.async_loop.busy


def test_fast_path_decode_steps_compose_with_async(ckpt, monkeypatch):
    """The fast path (torch references on CPU, graph buffers emulated) reads decode input ids
    from the device batch, where the placeholders were gathered: async == sync."""
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    prompts = [[(3 * i + 7 * j) % VOCAB for j in range(n)] for i, n in enumerate((1, 9, 40))]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, top_logprobs=2)
    got = {}
    for mode in (False, True):
        llm = make_llm(ckpt, mode, max_num_seqs=4)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        got[mode] = [(o.token_ids, o.top_logprobs) for o in outs]
        assert llm.runner.fast.stats["graph_steps"] > 0
    assert got[True] == got[False]
    assert llm.async_loop.tokens.num_gathered >= 3 * 6  # decode inputs came from the device buffer


def test_parallel_ranks_fall_back_explicitly(ckpt):
    from deepinfer.parallel.comm import EPComm
    from deepinfer.parallel.rank_engine import RankLLM

    rank = RankLLM(ckpt, comm=EPComm(), dtype="float32", max_model_len=256, max_num_seqs=4)
    assert rank.config.async_scheduling and rank.async_loop is None
    assert "lockstep" in rank.async_fallback
    outs = rank.generate_rank(prompt_token_ids=[[1, 2, 3]], sampling_params=[SamplingParams(max_tokens=3)])
    assert len(outs[0].token_ids) == 3
    assert make_llm(ckpt, True).async_fallback is None


def test_async_scheduling_switch():
    from deepinfer.config import EngineConfig
    from deepinfer.errors import ConfigError

    assert EngineConfig.from_kwargs(environ={}).async_scheduling
    assert not EngineConfig.from_kwargs(environ={"DEEPINFER_ASYNC_SCHEDULING": "0"}).async_scheduling
    assert EngineConfig.from_kwargs(environ={"DEEPINFER_ASYNC_SCHEDULING": "0"}, async_scheduling=True).async_scheduling
    with pytest.raises(ConfigError, match="DEEPINFER_ASYNC_SCHEDULING"):
        EngineConfig.from_kwargs(environ={"DEEPINFER_ASYNC_SCHEDULING": "yes"})
