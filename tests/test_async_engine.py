"""Async scheduling end to end on the tiny model (CPU): identical outputs to the
synchronous loop across a mixed workload, the device-side gather with debug sentinels,
and the structured-output fallback."""

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
        llm.async_loop.runner.debug = True  # sentinels: a wrong gather fails loudly
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
    runner = llm.async_loop.runner
    bt = {g: [0] for g in llm.kv_manager.pools}
    so = SchedulerOutput([ScheduledRequest("x", [5, PLACEHOLDER_TOKEN_ID], 0, bt, 3, True, True,
                                           SamplingParams(), 0, 2)], 2)
    with pytest.raises(RuntimeError, match="placeholder"):
        runner._build_batch_hook(so)  # slot 3 never sampled: the sentinel -1 is gathered
    runner.last_tokens[3] = 42
    batch = runner._build_batch_hook(so)
    assert batch.input_ids.tolist() == [5, 42]
    assert runner.last_tokens[3].item() == PLACEHOLDER_TOKEN_ID  # consumed (debug poison)
    with pytest.raises(RuntimeError, match="placeholder"):
        runner._build_batch_hook(so)  # a second read of the same sample is a wrong gather


def test_structured_output_falls_back_to_sync_steps():
    pytest.importorskip("xgrammar")
    kw = dict(dtype="float32", max_model_len=384, max_num_batched_tokens=48, max_num_seqs=8)
    prompts = ["Answer yes or no. " * 6, "Free text here.", "Pick one."]
    params = [SamplingParams(max_tokens=16, temperature=0.0, structured_output={"regex": r"(yes|no|maybe)"}),
              SamplingParams(max_tokens=10, temperature=1.0, seq_seed=5),
              SamplingParams(max_tokens=16, temperature=1.0, seq_seed=9,
                             structured_output={"json": {"type": "object", "properties": {
                                 "a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}})]
    ref = [(o.token_ids, o.finish_reason) for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    asy = LLM(async_scheduling=True, **kw)
    asy.async_loop.runner.debug = True
    got = [(o.token_ids, o.finish_reason) for o in asy.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert asy.async_loop.num_sync_fallbacks > 0
    assert not asy.structured.grammars and not asy.async_loop.busy


def test_step_clock_measures_both_modes(ckpt):
    from deepinfer.profiling.overlap import StepClock
    from deepinfer.profiling.timeline import idle_gaps

    ids, sp = [[3 + i] * 20 for i in range(4)], SamplingParams(max_tokens=6, ignore_eos=True)
    for mode in (False, True):
        llm = make_llm(ckpt, mode)
        rec = StepClock.attach(llm)
        llm.generate(prompt_token_ids=ids, sampling_params=sp, use_tqdm=False)
        rec.detach()
        assert "execute" not in vars(llm.runner) and "step" not in vars(llm)
        s = rec.summary()
        assert s["device_steps"] == 6 and s["steps"] >= 6 and 0 < s["device_busy_frac"] <= 1.0 + 1e-9
        assert s["host_ms_per_step"] > 0 and s["mean_gap_ms"] >= 0
        ev = rec.events()
        assert set(ev["lane"]) == {"step", "device"} and len(idle_gaps(ev)) > 0
        if mode:  # the device's work ran in the worker thread
            assert set(ev[ev["lane"] == "device"]["tid"]) == {"deepinfer-step_0"}
