"""The start-up warm-up requests (deepinfer/engine/start_warmup.py): served through the
engine's own loop, they leave nothing a user could see (outputs, metrics, KV blocks, prefix
cache, request ids) and the first generate() gives what an engine without them gives; the
start-up heap is frozen out of the garbage collector until shutdown."""

from __future__ import annotations

import gc

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.engine.start_warmup import NEW_TOKENS, warmup_requests

PROMPTS = ["Hello, my name is", "The river ran", "def main():"]
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.8, max_tokens=12, ignore_eos=True, seq_seed=5),
          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, top_logprobs=2)]


def _engine(warm: bool, **kw) -> LLM:
    return LLM(dtype="float32", max_model_len=256, max_num_seqs=4, warmup_requests=warm, **kw)


def _run(llm: LLM) -> list[tuple[list[int], list | None]]:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs]


def _assert_nothing_left(llm: LLM) -> None:
    core = llm.engine
    assert not core.has_unfinished()
    assert not core.scheduler.requests, "a warm-up request is still in the scheduler"
    assert len(llm.metrics.steps_df()) == 0, "the warm-up's steps are in the step metrics"
    for name, pool in core.kv_manager.pools.items():
        assert pool.num_free == pool.num_blocks, f"warm-up blocks still held in group {name}"
        assert not pool._cached, f"warm-up blocks hashed into group {name}'s prefix cache"


@pytest.mark.parametrize("kw", [{}, {"async_scheduling": False}, {"num_speculative_tokens": 1}],
                         ids=["async", "sync", "mtp"])
def test_warm_engine_matches_a_cold_one_and_leaves_nothing_behind(kw: dict) -> None:
    with _engine(False, **kw) as cold:
        assert cold.engine.warmup_requests_served == 0
        want = _run(cold)
    with _engine(True, **kw) as warm:
        assert warm.engine.warmup_requests_served == 2
        _assert_nothing_left(warm)
        if warm.runner.spec is not None:
            assert warm.runner.spec.metrics.steps == 0, "the warm-up's verify steps are in the spec metrics"
        assert _run(warm) == want
        assert [o.request_id for o in warm.generate(PROMPTS[:1], PARAMS[0], use_tqdm=False)] == ["req-3"]
        assert len(warm.metrics.steps_df()) > 0


def test_start_freezes_the_heap_and_shutdown_releases_it() -> None:
    gc.unfreeze()
    with _engine(True) as llm:
        assert gc.get_freeze_count() > 0, "the start-up heap was not frozen"
    assert gc.get_freeze_count() == 0, "shutdown left objects frozen out of the collector"
    with _engine(False):
        assert gc.get_freeze_count() == 0
    assert llm.engine.closed


def test_default_is_on_only_on_a_gpu() -> None:
    with LLM(dtype="float32", max_model_len=128, max_num_seqs=2) as llm:
        assert llm.engine.warmup_requests_served == (2 if llm.engine.device.type == "cuda" else 0)


def test_requests_stay_inside_one_block() -> None:
    for block in (8, 16, 128, 1024):
        reqs = warmup_requests(512, block)
        assert [sp.max_tokens for _, sp in reqs] == [NEW_TOKENS, NEW_TOKENS]
        assert all(0 < len(ids) and len(ids) + NEW_TOKENS < block for ids, _ in reqs)
        assert all(0 <= t < 512 for ids, _ in reqs for t in ids)
    assert warmup_requests(512, 4) == [], "a block too small for prompt + output: no warm-up"


def test_bad_value_names_the_field() -> None:
    with pytest.raises(ConfigError, match="warmup_requests"):
        _engine("yes")  # type: ignore[arg-type]
