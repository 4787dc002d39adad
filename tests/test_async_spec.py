"""Speculative decoding under async scheduling (CPU, tiny model): every step first lands
the step in flight (its drafts come from that step's verification), counted in the loop's
stats; greedy output equals the synchronous loop's, with fixed and confidence-scheduled
verification (whose budget comes from the previous plan's confidences in both loops:
deepinfer/spec/runner.py) and with rejected drafts rolled back under preemption."""

from __future__ import annotations

import pytest

from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.spec import RandomDrafter

from spec_common import PARAMS, VOCAB, make_llm, mixed_prompts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_async_spec")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


@pytest.mark.parametrize("k,varlen", [(3, False), (5, True)])
def test_async_spec_greedy_equals_sync_spec(ckpt, k, varlen):
    prompts = mixed_prompts()
    kw = dict(num_speculative_tokens=k, enable_mtp_varlen=varlen, max_num_batched_tokens=64)
    outs = {}
    for mode in (False, True):
        llm = make_llm(ckpt, async_scheduling=mode, **kw)
        outs[mode] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS,
                                                       use_tqdm=False)]
        assert llm.runner.spec.metrics.verify_tokens_per_step > 1.0  # drafts were verified
    assert outs[True] == outs[False]
    loop = llm.async_loop
    assert loop is not None
    if varlen:  # the second and later plans took their budget from the previous plan
        assert llm.runner.spec.older_confidences is not None
    # every step after the first waited for its predecessor: the sync fallback, counted
    assert loop.num_sync_fallbacks == loop.stats.speculative_syncs > 0
    assert loop.stats.overlapped == 0 and not loop.busy


def test_async_spec_random_drafts_under_preemption(ckpt):
    """Nearly every draft rejected (rollback every step) with a pool small enough to preempt."""
    prompts = mixed_prompts()
    ref = [o.token_ids for o in make_llm(ckpt, async_scheduling=False).generate(
        prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)]
    llm = make_llm(ckpt, num_speculative_tokens=5, num_kv_blocks=5, max_num_batched_tokens=48)
    llm.runner.spec.drafter = RandomDrafter(VOCAB)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert max(llm.runner.spec.metrics.acceptance_per_position()) < 0.1
    llm.kv_manager.assert_consistent()
    assert all(p.num_free == p.num_blocks for p in llm.kv_manager.pools.values())
