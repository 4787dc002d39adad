"""DSpark drafter on a tiny DSpark checkpoint: greedy output with DSpark speculation (fixed
and confidence-scheduled verification, chunked prefill, prefix caching, preemption) equals
greedy output without speculation, token for token; drafts, draft distributions and
confidences have the right shapes and ranges and are deterministic for a seed; the
Markov bias, the confidence and the sequential draft rule match a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.models.tiny import tiny_dspark_config, write_tiny_checkpoint
from deepinfer.models.v4.dspark import ConfidenceHead, MarkovHead
from deepinfer.spec.dspark_drafter import DSparkDrafter

from spec_common import PARAMS, VOCAB, make_llm, mixed_prompts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_dspark")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_dspark_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts()


def generate(llm, prompts, params=PARAMS):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    generate.preemptions = sum(o.metrics.num_preemptions for o in outs)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(ckpt, prompts):
    return generate(make_llm(ckpt), prompts)


def test_dspark_checkpoint_gets_the_dspark_drafter(ckpt):
    llm = make_llm(ckpt, num_speculative_tokens=4)
    d = llm.runner.spec.drafter
    assert isinstance(d, DSparkDrafter)
    assert d.target_layers == (1, 2, 3) and d.gamma == 5 and d.lookahead == 0
    with pytest.raises(ValueError, match="block size"):
        make_llm(ckpt, num_speculative_tokens=6)


@pytest.mark.parametrize("k,varlen,extra", [
    (3, False, {}),
    (5, True, {}),
    (5, False, {"num_kv_blocks": 5, "max_num_batched_tokens": 48}),  # forces preemption
])
def test_dspark_greedy_equals_no_speculation(ckpt, prompts, reference, k, varlen, extra):
    kw = {"max_num_batched_tokens": 64, **extra}
    llm = make_llm(ckpt, num_speculative_tokens=k, enable_mtp_varlen=varlen, **kw)
    assert generate(llm, prompts) == reference
    m = llm.runner.spec.metrics
    assert m.steps > 0 and m.verify_tokens_per_step > 1.0
    if "num_kv_blocks" in extra:
        assert generate.preemptions > 0
        llm.kv_manager.assert_consistent()


def test_dspark_with_accepted_drafts_equals_no_speculation(ckpt, prompts, reference):
    """Random weights accept ~nothing; overwrite a prefix of each real DSpark draft with the
    known continuation so accepted drafts (their feature rows, rollback of the rest) occur."""
    llm = make_llm(ckpt, num_speculative_tokens=4, enable_mtp_varlen=True, max_num_batched_tokens=64)
    drafter = llm.runner.spec.drafter
    ref = {f"req-{i}": r for i, r in enumerate(reference)}
    real = drafter.propose
    calls = {"n": 0}

    def propose(ctx, k):
        out = real(ctx, k)
        for r, emitted in zip(ctx.scheduled, ctx.emitted):
            d = out.get(r.req_id)
            if d is None:
                continue
            done = r.output_len + len(emitted)
            good = ref[r.req_id][done: done + k]
            m = calls["n"] % (k + 1)  # 0..k correct drafts, then the drafter's own
            calls["n"] += 1
            d.tokens[:m] = good[:m]
            d.confidences = [0.9] * len(d.tokens)
        return out

    drafter.propose = propose
    assert generate(llm, prompts) == reference
    m = llm.runner.spec.metrics
    assert m.acceptance_per_position()[0] > 0.3 and m.effective_tokens_per_step > 1.5


def _full_features(model, drafter, tokens: list[int]) -> list[torch.Tensor]:
    """Per stage: the context K/V of every position of ``tokens`` from ONE plain forward."""
    from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
    from deepinfer.models.standalone import StandaloneRunner

    sr = StandaloneRunner(model, max_seqs=1, max_len=len(tokens) + 8)
    batch = ForwardBatch(torch.tensor(tokens), torch.arange(len(tokens)),
                         [SeqMeta(0, len(tokens), 0, sr._table(0), 0, True, len(tokens))])
    hidden = dict.fromkeys(drafter.target_layers)
    with torch.no_grad():
        model(batch, sr.cache, capture=hidden)
        main_x = drafter.features(hidden, torch.arange(len(tokens)))
        return [st.context_kv(main_x, torch.arange(len(tokens)), model.rotary_main) for st in drafter.stages]


def test_dspark_window_rows_equal_plain_forward_features(ckpt, prompts, reference):
    """Every context row a block reads (chunked prefill, prefix-cache hits, accepted and
    rolled-back drafts) equals the feature K/V a single plain forward gives that position."""
    from deepinfer.models.v4.kv_cache import GROUP_SWA
    from deepinfer.models.paged_batch import gather_rows

    llm = make_llm(ckpt, num_speculative_tokens=4, max_num_batched_tokens=64)
    drafter = llm.runner.spec.drafter
    full = {f"req-{i}": p + r for i, (p, r) in enumerate(zip(prompts, reference))}
    ref = {f"req-{i}": r for i, r in enumerate(reference)}
    real, reads = drafter.propose, []
    calls = {"n": 0}

    def propose(ctx, k):
        out = real(ctx, k)
        W = drafter.cfg.sliding_window
        for i, (r, emitted) in enumerate(zip(ctx.scheduled, ctx.emitted)):
            if r.req_id not in out:
                continue
            seq = ctx.batch.seqs[i]
            p = seq.start + ctx.valid[i] - 1
            lo = max(0, p + 2 - W)
            rows = [gather_rows(drafter.cache.swa[drafter._cache_id(s)], seq.block_table[GROUP_SWA], lo, p + 1)
                    for s in range(len(drafter.stages))]
            reads.append((r.req_id, lo, p, rows))
            done = r.output_len + len(emitted)
            m = calls["n"] % (k + 1)
            calls["n"] += 1
            out[r.req_id].tokens[:m] = ref[r.req_id][done: done + m]  # some accepted drafts
        return out

    drafter.propose = propose
    assert generate(llm, prompts) == reference
    assert llm.runner.spec.metrics.acceptance_per_position()[0] > 0.3
    want = {rid: _full_features(llm.model, drafter, toks) for rid, toks in full.items()}
    assert len(reads) > 20
    for rid, lo, p, rows in reads:
        for s, got in enumerate(rows):
            assert torch.allclose(got.float(), want[rid][s][lo: p + 1].float(), atol=1e-4, rtol=1e-4), (rid, lo, p, s)


def _record(llm):
    drafter = llm.runner.spec.drafter
    real, seen = drafter.propose, []

    def propose(ctx, k):
        out = real(ctx, k)
        seen.append({rid: (list(d.tokens), None if d.probs is None else d.probs.clone(), list(d.confidences))
                     for rid, d in out.items()})
        return out

    drafter.propose = propose
    return seen


def test_dspark_drafts_shapes_ranges_and_seed_determinism(ckpt, prompts):
    k = 4
    params = [SamplingParams(temperature=0.9, top_p=0.95, seq_seed=11 + i, max_tokens=12, ignore_eos=True)
              for i in range(3)] + [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    runs = []
    for _ in range(2):
        llm = make_llm(ckpt, num_speculative_tokens=k, max_num_batched_tokens=64)
        seen = _record(llm)
        outs = generate(llm, prompts[:4], params)
        runs.append((outs, seen))
    (o1, s1), (o2, s2) = runs
    assert o1 == o2 and len(s1) == len(s2) and any(s1)
    greedy_id = "req-3"
    for step1, step2 in zip(s1, s2):
        assert step1.keys() == step2.keys()
        for rid, (toks, probs, conf) in step1.items():
            t2, p2, c2 = step2[rid]
            assert toks == t2 and conf == c2
            assert len(toks) == k and len(conf) == k
            assert all(0 <= t < VOCAB for t in toks)
            assert all(0.0 < c < 1.0 for c in conf)
            if rid == greedy_id:  # deterministic proposal: no q, or one-hot in a mixed batch
                assert probs is None or torch.equal(probs, torch.nn.functional.one_hot(
                    torch.tensor(toks), VOCAB).to(probs.dtype))
            else:
                assert probs.shape == (k, VOCAB) and torch.equal(probs, p2)
                assert torch.allclose(probs.sum(-1), torch.ones(k), atol=1e-4)
                assert all(probs[j, t] > 0 for j, t in enumerate(toks))


def test_markov_bias_and_confidence_by_hand():
    torch.manual_seed(0)
    V, r, D = 7, 3, 4
    mk, ch = MarkovHead(V, r, torch.float32), ConfidenceHead(D, r, torch.float32)
    for p in [*mk.parameters(), *ch.parameters()]:
        torch.nn.init.normal_(p)
    prev = torch.tensor([2, 5])
    h = torch.randn(2, D)
    bias, conf = mk(prev), ch(h, mk.embedding(prev))
    W1, W2, w = mk.markov_w1.weight.tolist(), mk.markov_w2.weight.tolist(), ch.proj.weight[0].tolist()
    for i, t in enumerate(prev.tolist()):
        for v in range(V):
            assert bias[i, v].item() == pytest.approx(sum(W2[v][j] * W1[t][j] for j in range(r)), abs=1e-5)
        feat = h[i].tolist() + W1[t]
        z = sum(a * b for a, b in zip(w, feat))
        assert conf[i].item() == pytest.approx(1 / (1 + math.exp(-z)), abs=1e-6)


def test_sequential_markov_draft_rule(ckpt):
    """draft(): d_{j+1} = argmax(logits_j + W2 W1[x_j]), c_{j+1} = sigmoid(w.[h_j ; W1[x_j]]),
    x_0 = the last accepted token, x_j = d_j (greedy)."""
    llm = make_llm(ckpt, num_speculative_tokens=5)
    drafter = llm.runner.spec.drafter
    last = drafter.stages[-1]
    torch.manual_seed(1)
    G, D = drafter.gamma, drafter.cfg.hidden_size
    logits, h = torch.randn(2, G, VOCAB) * 3, torch.randn(2, G, D)
    x0 = [17, 300]
    sp = [SamplingParams(temperature=0)] * 2
    drafts = drafter.draft(logits, h, x0, [10, 40], sp, G)
    W1, W2 = last.markov_head.markov_w1.weight, last.markov_head.markov_w2.weight
    w = last.confidence_head.proj.weight[0]
    for r in range(2):
        prev = x0[r]
        for j in range(G):
            tok = int((logits[r, j] + W2 @ W1[prev]).argmax())
            c = torch.sigmoid(w @ torch.cat([h[r, j], W1[prev]])).item()
            assert drafts[r].tokens[j] == tok
            assert drafts[r].confidences[j] == pytest.approx(c, abs=1e-5)
            prev = tok
        assert drafts[r].probs is None
