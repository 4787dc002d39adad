"""The sweep's decode points with speculative decoding: effective tokens per step are the
accepted drafts + 1 (REFERENCE.md section 4), tok/s per user and per device use them, the
row carries the speculative metrics and the decode chart names the setting.

A drafter that proposes the target's own greedy continuation (computed by an engine
without speculation, looked up by prompt) is accepted every time, so the number the
chart must show is known: k + 1 tokens per step, minus the steps capped by max_tokens."""

from __future__ import annotations

import json

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.profiling.sweep import SweepSpec, run_sweep
from deepinfer.spec import Draft, Drafter

K = 3
SPEC = SweepSpec(prefill_budgets=(), decode_batch_sizes=(1, 2), concurrency=(), warmup_steps=1, measure_steps=3)


class GreedyContinuationDrafter(Drafter):
    """Drafts the next k tokens of the request's greedy output (always accepted)."""

    def __init__(self, llm: LLM, reference: LLM) -> None:
        self.llm, self.reference, self.cache = llm, reference, {}

    def continuation(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self.cache:
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            self.cache[key] = self.reference.generate(prompt_token_ids=[prompt], sampling_params=sp,
                                                      use_tqdm=False)[0].token_ids
        return self.cache[key]

    def propose(self, ctx, k):
        out = {}
        for r, emitted in zip(ctx.scheduled, ctx.emitted):
            req = self.llm.scheduler.requests.get(r.req_id)
            if emitted is None or req is None:
                continue
            ref = self.continuation(req.prompt_token_ids, req.sampling_params.max_tokens)
            done = r.output_len + len(emitted)
            out[r.req_id] = Draft(ref[done: done + k], None, [1.0] * len(ref[done: done + k]))
        return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_spec_sweep")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(sliding_window=32))  # the sweep's prompts: V4 ids
    return str(path)


def test_decode_points_use_accepted_plus_one_tokens_per_step(ckpt):
    kw = dict(dtype="float32", max_model_len=512, max_num_seqs=2, max_num_batched_tokens=256, async_scheduling=False)
    llm = LLM(ckpt, num_speculative_tokens=K, **kw)
    llm.runner.spec.drafter = GreedyContinuationDrafter(llm, LLM(ckpt, **kw))
    res = run_sweep(llm, SPEC, progress=False)
    dec = res.df[res.df["kind"] == "decode"]
    assert dec["batch_size"].tolist() == [1, 2] and (dec["steps_measured"] == SPEC.measure_steps).all()
    assert (dec["effective_tokens_per_step"] == K + 1).all()  # steady state: every draft accepted
    step_s = dec["decode_step_ms"] / 1e3
    assert dec["tok_s_per_user"].tolist() == pytest.approx((dec["effective_tokens_per_step"] / step_s).tolist())
    assert dec["tok_s_per_device"].tolist() == pytest.approx((dec["tok_s_per_user"] * dec["batch_size"]).tolist())
    assert (dec["spec_num_speculative_tokens"] == K).all() and (dec["spec_method"] == "GreedyContinuationDrafter").all()
    assert dec["spec_mean_accepted_length"].between(2.0, K).all() and (dec["spec_verify_tokens_per_step"] > 3.0).all()
    assert all(json.loads(a)[0] == 1.0 for a in dec["spec_acceptance_per_position"])
    fig = res.figures["decode"]
    assert list(fig.data[0].customdata[:, 0]) == [K + 1, K + 1]
    assert f"k={K} fixed" in fig.layout.title.text and "effective tokens/step 4.00" in fig.layout.title.text
