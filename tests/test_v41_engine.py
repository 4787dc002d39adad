"""DeepSeek-V4.1 through the whole engine: greedy batched == one-at-a-time under every
scheduling mode and every bounded-replay mode; compact == mask with chunked prefill
splitting the suffix boundary, prefix-cache hits and preemption; off == compact for
prompts no longer than keep; clear errors for bad replay settings.
(Speculative verify is not in the engine yet, so it is not exercised here.)"""

from __future__ import annotations

import random

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.models.tiny import tiny_config, tiny_v41_config, write_tiny_checkpoint

VOCAB, WINDOW, KEEP, NEW = 1024, 32, 40, 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v41")
    cfg = tiny_v41_config(vocab_size=VOCAB, sliding_window=WINDOW, simulate_kv_quant=False)
    write_tiny_checkpoint(str(path), seed=11, cfg=cfg)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(256)]
    return [
        [rng.randrange(VOCAB) for _ in range(5)],
        shared + [rng.randrange(VOCAB) for _ in range(21)],
        shared + [rng.randrange(VOCAB) for _ in range(40)],
        [rng.randrange(VOCAB) for _ in range(129)],
        shared[:130] + [rng.randrange(VOCAB) for _ in range(3)],
        [rng.randrange(VOCAB) for _ in range(301)],
        [rng.randrange(VOCAB) for _ in range(33)],
        [rng.randrange(VOCAB) for _ in range(KEEP)],  # exactly keep: no truncation
    ]


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def make(checkpoint, mode="off", **kw):
    kw.setdefault("max_model_len", 512)
    kw.setdefault("max_num_seqs", 8)
    return LLM(checkpoint, dtype="float32", swa_replay_mode=mode, swa_replay_keep=KEEP, **kw)


def run(llm, prompts):
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def alone(checkpoint, prompts):
    """Each prompt on its own (no prefix cache, one request per engine step), per mode."""
    out = {}
    for mode in ("off", "mask", "compact"):
        llm = make(checkpoint, mode, enable_prefix_caching=False)
        out[mode] = [run(llm, [p])[0] for p in prompts]
    return out


SCHEDULES = [
    dict(),
    dict(chunked_prefill=False, max_num_batched_tokens=4096),
    dict(max_num_batched_tokens=64),  # chunks that split the suffix boundary of long prompts
    dict(num_kv_blocks=6, max_num_batched_tokens=128),  # forces preemption and recompute
]


@pytest.mark.parametrize("mode", ["off", "mask", "compact"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=["default", "no-chunking", "small-chunks", "preemption"])
def test_batched_equals_one_at_a_time(checkpoint, prompts, alone, mode, schedule):
    llm = make(checkpoint, mode, **schedule)
    preemptions = 0
    for attempt in range(2):  # the second pass starts from the prefix cache the first left
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        preemptions += sum(o.metrics.num_preemptions for o in outs)
        for i, out in enumerate(outs):
            assert out.token_ids == alone[mode][i], f"prompt {i} (len {len(prompts[i])}), {mode}, pass {attempt}"
    cached = [o.metrics.num_cached_tokens for o in outs]
    if mode != "off":  # hits never reach into the replayed suffix
        assert all(c <= max(0, len(p) - KEEP) for c, p in zip(cached, prompts))
    if not schedule.get("num_kv_blocks"):
        assert sum(cached) >= 128, "the second pass should hit the prefix cache"
    else:
        assert preemptions > 0, "the small pool should force preemption"
    llm.kv_manager.assert_consistent()
    for name, pool in llm.kv_manager.pools.items():
        assert pool.num_free == pool.num_blocks, f"group {name} leaked blocks"


def test_compact_equals_mask_and_off_on_short_prompts(alone, prompts):
    assert alone["compact"] == alone["mask"]
    for i, p in enumerate(prompts):
        if len(p) <= KEEP:
            assert alone["off"][i] == alone["compact"][i], f"prompt {i} of {len(p)} <= keep tokens"


def test_replay_settings_and_errors(checkpoint, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"swa_replay_keep=30 is too small.*>= sliding_window \(32\) \+"):
        LLM(checkpoint, dtype="float32", swa_replay_mode="compact", swa_replay_keep=30)
    with pytest.raises(ConfigError, match="swa_replay_mode must be one of"):
        LLM(checkpoint, dtype="float32", swa_replay_mode="truncate")
    monkeypatch.setenv("DEEPINFER_SWA_REPLAY_MODE", "mask")
    monkeypatch.setenv("DEEPINFER_SWA_REPLAY_KEEP", "38")
    llm = LLM(checkpoint, dtype="float32", max_model_len=512)
    assert llm.replay.mode == "mask" and llm.replay.keep == 38 and llm.runner.replay is llm.replay
    monkeypatch.setenv("DEEPINFER_SWA_REPLAY_KEEP", "many")
    with pytest.raises(ConfigError, match="DEEPINFER_SWA_REPLAY_KEEP"):
        LLM(checkpoint, dtype="float32")
    monkeypatch.delenv("DEEPINFER_SWA_REPLAY_KEEP")
    # DeepInfer's names; today's names stay aliases, and an alias that disagrees is an error
    monkeypatch.delenv("DEEPINFER_SWA_REPLAY_MODE")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "39")
    llm = LLM(checkpoint, dtype="float32", max_model_len=512)
    assert llm.replay.mode == "compact" and llm.replay.keep == 39
    monkeypatch.setenv("DEEPINFER_SWA_REPLAY_MODE", "mask")
    with pytest.raises(ConfigError, match="DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE.*DEEPINFER_SWA_REPLAY_MODE"):
        LLM(checkpoint, dtype="float32")
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE")  # the alias alone: mask
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS")
    v4 = write_tiny_checkpoint(str(tmp_path / "v4"), seed=1, cfg=tiny_config(vocab_size=VOCAB))
    with pytest.raises(ConfigError, match="needs a model with V4.1 decoder layers"):
        LLM(v4, dtype="float32")


def test_batch_invariant_compact_equals_mask_bitwise(checkpoint, prompts):
    """LLM(batch_invariant=True): compact and mask give identical tokens and log-probs
    (bit for bit) under chunking that splits the suffix boundary, prefix hits and preemption."""
    got = {}
    for mode in ("mask", "compact"):
        llm = make(checkpoint, mode, batch_invariant=True, num_kv_blocks=6, max_num_batched_tokens=96)
        runs = [llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False) for _ in range(2)]
        got[mode] = [[(o.token_ids, o.logprobs) for o in outs] for outs in runs]
    assert got["compact"] == got["mask"]
    assert all(lp for outs in got["mask"] for _, lp in outs)  # log-probs were compared, not Nones
