"""Speculative decoding end to end on a tiny V4 model: greedy output with speculation on
(MTP, oracle and random drafters; fixed and confidence-scheduled verification) equals
greedy output with it off, token for token, on a mixed batch under chunked prefill,
prefix caching and preemption; oracle drafts are all accepted; rejected drafts roll back
the compressor rings (a test that fails without `deepinfer/spec/kv.py`)."""

from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.spec import OracleDrafter, RandomDrafter

from spec_common import PARAMS, VOCAB, make_llm, mixed_prompts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_spec")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts()


@pytest.fixture(scope="module")
def reference(ckpt, prompts):
    outs = make_llm(ckpt).generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    return [o.token_ids for o in outs]


def run(llm, prompts, drafter=None):
    if drafter is not None:
        llm.runner.spec.drafter = drafter
    steps = 0
    orig = llm.step

    def counted(*a, **k):
        nonlocal steps
        steps += 1
        return orig(*a, **k)

    llm.step = counted
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    run.preemptions = sum(o.metrics.num_preemptions for o in outs)
    return [o.token_ids for o in outs], steps


@pytest.mark.parametrize("k,varlen", [(1, False), (3, False), (5, True)])
def test_mtp_greedy_equals_no_speculation(ckpt, prompts, reference, k, varlen):
    llm = make_llm(ckpt, num_speculative_tokens=k, enable_mtp_varlen=varlen, max_num_batched_tokens=64)
    got, _ = run(llm, prompts)
    assert got == reference
    m = llm.runner.spec.metrics
    assert m.steps > 0 and m.verify_tokens_per_step > 1.0


def test_oracle_drafts_are_all_accepted_and_save_steps(ckpt, prompts, reference):
    base_llm = make_llm(ckpt)
    _, base_steps = run(base_llm, prompts)
    llm = make_llm(ckpt, num_speculative_tokens=4)
    oracle = OracleDrafter({f"req-{i}": ref for i, ref in enumerate(reference)})
    got, steps = run(llm, prompts, oracle)
    assert got == reference
    m = llm.runner.spec.metrics
    assert m.acceptance_per_position() == [1.0] * 4
    assert m.effective_tokens_per_step > 3.0
    assert steps < base_steps / 2


def test_random_drafts_rejected_output_unchanged_under_preemption(ckpt, prompts, reference):
    # Random drafts: nearly all rejected -> every verify step rolls back k positions in
    # every group (window rows, CSA/HCA entries, indexer keys, compressor rings).
    llm = make_llm(ckpt, num_speculative_tokens=5, num_kv_blocks=5, max_num_batched_tokens=48)
    got, _ = run(llm, prompts, RandomDrafter(VOCAB))
    assert got == reference
    m = llm.runner.spec.metrics
    assert max(m.acceptance_per_position()) < 0.1
    assert run.preemptions > 0, "the pool is small enough to force preemption"
    llm.kv_manager.assert_consistent()
    assert all(p.num_free == p.num_blocks for p in llm.kv_manager.pools.values())


def test_ring_rollback_needs_the_wider_ring(ckpt, prompts, reference, monkeypatch):
    """Without the extra ring rows a rejected draft overwrites the ring slot of an accepted
    history position that the next step's compressor window reads: outputs change."""
    import deepinfer.spec.kv as kv

    monkeypatch.setattr(kv, "widen_compressor_rings", lambda cache, k: None)
    llm = make_llm(ckpt, num_speculative_tokens=5)
    got, _ = run(llm, prompts, RandomDrafter(VOCAB))
    assert got != reference


def test_drafts_respect_max_tokens_and_stop(ckpt, prompts, reference):
    llm = make_llm(ckpt, num_speculative_tokens=4)
    oracle = OracleDrafter({f"req-{i}": ref for i, ref in enumerate(reference)})
    llm.runner.spec.drafter = oracle
    stop_tok = reference[2][5]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok])
    out = llm.generate(prompt_token_ids=[prompts[0], prompts[2]], use_tqdm=False,
                       sampling_params=[PARAMS[0], sp])
    assert out[0].token_ids == reference[0]
    assert out[1].token_ids == reference[2][: reference[2].index(stop_tok) + 1]
