"""Speculative verify steps on the fast path (a token and its drafts per request, batched,
the compressors taking each request's rows in order): greedy output with speculation on
and the fast path forced on the host equals greedy output without either, and the verify
steps really ran there with several rows per request."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402

from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint  # noqa: E402

from spec_common import PARAMS, VOCAB, make_llm, mixed_prompts  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_fast_spec")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


@pytest.fixture(scope="module")
def reference(ckpt):
    outs = make_llm(ckpt).generate(prompt_token_ids=mixed_prompts(), sampling_params=PARAMS, use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("k,varlen,graphs", [(3, False, "0"), (5, True, "1")])  # "1": padded graph buffers
def test_verify_on_fast_path_equals_no_speculation(ckpt, reference, monkeypatch, k, varlen, graphs):
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", graphs)
    llm = make_llm(ckpt, num_speculative_tokens=k, enable_mtp_varlen=varlen, max_num_batched_tokens=64)
    fast = llm.runner.fast
    rows_per_request: list[int] = []
    verify = llm.runner.spec.verify_executor(llm.runner)  # the compiled verify steps
    original = verify.run

    def recorded(so, batch, capture=None, greedy=False):
        out = original(so, batch, capture, greedy)
        if out is not None:
            rows_per_request.append(max(r.num_tokens for r in so.scheduled))
        return out

    verify.run = recorded
    outs = llm.generate(prompt_token_ids=mixed_prompts(), sampling_params=PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert rows_per_request and max(rows_per_request) > 1, "no verify step with drafts ran on the fast path"
    assert llm.runner.spec.metrics.verify_tokens_per_step > 1.0
    assert (fast.stats["graph_steps"] > 0) == (graphs == "1")



def test_dspark_features_from_the_fast_path(tmp_path, monkeypatch):
    """DSpark drafts from the layer inputs the fast path captured (graph buffers emulated):
    the very drafts the reference path's features give, and the same greedy output."""
    from deepinfer.models.tiny import tiny_dspark_config

    write_tiny_checkpoint(str(tmp_path), seed=3, cfg=tiny_dspark_config(vocab_size=VOCAB, sliding_window=32))
    prompts, params = mixed_prompts()[:3], PARAMS[:3]
    runs = {}
    for mode in ("0", "ref"):
        monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
        monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
        llm = make_llm(str(tmp_path), num_speculative_tokens=3, max_num_batched_tokens=64)
        drafter, drafts = llm.runner.spec.drafter, []
        assert drafter.target_layers
        real = drafter.propose

        def propose(ctx, k, real=real, drafts=drafts):
            out = real(ctx, k)
            drafts.append(sorted((rid, d.tokens) for rid, d in out.items()))
            return out

        drafter.propose = propose
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        runs[mode] = ([o.token_ids for o in outs], drafts)
        if mode == "ref":
            assert llm.runner.fast.stats["graph_steps"] > 0
    assert runs["ref"] == runs["0"]
