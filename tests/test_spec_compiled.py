"""Speculative verify on the compiled executor (CPU: fast path forced on the host, graphs
emulated on the same padded buffers, Triton kernels interpreted or their torch references):

* the device rejection sampler == the host reference sampler: the same tokens, accepted
  counts, rows and log-probs (greedy and stochastic, deterministic and sampled drafts), and
  its first emitted token follows the target distribution (chi-square);
* the verify graphs are captured at start-up and sealed: speculative greedy steps replay
  them (nothing captured while serving, no step outside the set) and equal decoding
  without speculation;
* rollback: after verify steps that rejected drafts, every valid KV row / compressed entry
  equals the one a never-speculated run wrote.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import SamplingParams  # noqa: E402
from deepinfer.engine.sampler import SamplingTensors  # noqa: E402
from deepinfer.models.paged_batch import gather_rows  # noqa: E402
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint  # noqa: E402
from deepinfer.models.v4.kv_cache import GROUP_CSA, GROUP_HCA, GROUP_SWA
from deepinfer.spec import RandomDrafter  # noqa: E402
from deepinfer.spec.verify import rejection_sample, rejection_sample_device, sample_draft  # noqa: E402

from spec_common import PARAMS, VOCAB, make_llm, mixed_prompts  # noqa: E402

V = 16


def _case(seed: int, greedy_every: int):
    g = torch.Generator().manual_seed(seed)
    ks = [int(x) for x in torch.randint(0, 6, (9,), generator=g)]
    params, positions = [], []
    for b, k in enumerate(ks):
        sp = SamplingParams(temperature=0 if b % greedy_every == 0 else 0.8, top_k=-1 if b % 2 else 5,
                            seq_seed=1000 * seed + b)
        params += [sp] * (k + 1)
        positions += [20 + j for j in range(k + 1)]
    m = sum(k + 1 for k in ks)
    logits = torch.randn(m, V, generator=g) * 2
    # mostly the target's argmax (greedy rows accept it; sampled rows often do), else random
    drafts = torch.where(torch.rand(m, generator=g) < 0.7, logits.argmax(-1), torch.randint(0, V, (m,), generator=g))
    q = torch.softmax(torch.randn(m, V, generator=g), -1)
    return logits, SamplingTensors.from_params(params, positions), ks, drafts, q


@pytest.mark.parametrize("seed,greedy_every", [(1, 1), (2, 3), (3, 2), (4, 100)])
@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_device_sampler_equals_host_reference(seed, greedy_every, sampled_drafts):
    logits, st, ks, drafts, q = _case(seed, greedy_every)
    probs = q if sampled_drafts else None
    host = rejection_sample(logits, st, ks, drafts, probs)
    dev = rejection_sample_device(logits, st, ks, drafts, probs)
    got = dev.to_result()
    assert got.tokens == host.tokens
    assert got.num_accepted == host.num_accepted
    assert got.rows == host.rows
    assert got.logprobs == host.logprobs
    assert sum(host.num_accepted) > 0 and sum(a < k for a, k in zip(host.num_accepted, ks)) > 0  # both kinds
    # the packed layout: -1 past each request's emitted tokens
    toks = dev.tokens.tolist()
    for b, t in enumerate(host.tokens):
        assert toks[b][len(t):] == [-1] * (dev.width - len(t))


def test_device_sampler_with_the_fused_row_reduction():
    """The CUDA configuration (the sampler's fused argmax / log-sum-exp kernel, interpreted
    here): the host reference's tokens and counts, log-probs within float32 rounding."""
    from deepinfer.engine.sampler import Sampler

    logits, st, ks, drafts, q = _case(5, 2)
    host = rejection_sample(logits, st, ks, drafts, q)
    got = rejection_sample_device(logits, st, ks, drafts, q, sampler=Sampler(fused_reduce=True)).to_result()
    assert (got.tokens, got.num_accepted, got.rows) == (host.tokens, host.num_accepted, host.rows)
    torch.testing.assert_close(torch.tensor(sum(got.logprobs, [])), torch.tensor(sum(host.logprobs, [])))


def _chi2_p(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    exp = probs.double() * len(tokens)
    keep = exp >= 5  # pool rare cells
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    e = torch.cat([exp[keep], exp[~keep].sum().view(1)])
    chi2 = float(((obs - e) ** 2 / e.clamp(min=1e-9)).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


@pytest.mark.parametrize("rule,lossless", [("standard", True), ("ignore_q", False)])
def test_device_sampler_preserves_the_target_distribution(rule, lossless):
    """First emitted token of 20k requests with k=2 sampled drafts ~ softmax(target / T);
    the deliberately broken rule (accept with p(d)) fails the same test."""
    n, k, temp = 20000, 2, 1.0
    g = torch.Generator().manual_seed(0)
    target, draft = torch.randn(V, generator=g) * 1.5, torch.randn(V, generator=g) * 1.5
    sp = [SamplingParams(temperature=temp, seq_seed=s) for s in range(n)]
    ids, qs = [], []
    for j in range(k):
        tok, q = sample_draft(draft.expand(n, V), SamplingTensors.from_params(sp, [10 + j] * n))
        ids.append(tok)
        qs.append(q)
    d = torch.cat([torch.stack(ids, 1), torch.full((n, 1), -1)], 1).reshape(-1)
    qq = torch.cat([torch.stack(qs, 1), torch.zeros(n, 1, V)], 1).reshape(-1, V)
    params = SamplingTensors.from_params([p for p in sp for _ in range(k + 1)],
                                         [10 + j for _ in range(n) for j in range(k + 1)])
    dev = rejection_sample_device(target.expand(n * (k + 1), V).clone(), params, [k] * n, d, qq, rule=rule)
    first = dev.tokens[:, 0].tolist()
    p = _chi2_p(first, torch.softmax(target / temp, -1))
    assert (p > 0.01) == lossless, p
    assert 0.05 < float(dev.num_accepted.float().mean()) < k  # drafts both accepted and rejected


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_spec_compiled")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


@pytest.fixture(scope="module")
def reference(ckpt):
    outs = make_llm(ckpt).generate(prompt_token_ids=mixed_prompts(), sampling_params=PARAMS, use_tqdm=False)
    return [o.token_ids for o in outs]


# the kernels' torch references ("ref"): interpreted Triton over these engine runs takes ~12 min on
# the CI box (measured), the kernels themselves are checked against the references elsewhere
@pytest.mark.parametrize("ops,k,varlen,prefill", [("ref", 3, False, "0"), ("ref", 5, True, "ref")])
def test_verify_graphs_warmed_sealed_and_equal_to_no_speculation(ckpt, reference, monkeypatch, ops, k, varlen,
                                                                 prefill):
    """``prefill="ref"``: the prompt / mixed steps run the compiled prefill path too
    (v4/fast/verify_prefill.py's SpecPrefill via PrefillPath.spec_forward, the drafter's layers captured there)."""
    monkeypatch.setenv("DEEPINFER_FASTPATH", ops)
    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", prefill)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")  # the start-up capture, emulated on the host
    prompts, params = mixed_prompts(), PARAMS
    llm = make_llm(ckpt, num_speculative_tokens=k, enable_mtp_varlen=varlen, max_num_batched_tokens=64)
    fast, spec = llm.runner.fast, llm.runner.spec
    verify = spec.verify_executor(llm.runner)
    assert llm.graphs_warmed == len(verify.warmed) > 0 and fast.graphs.sealed
    captured = list(fast.graphs.captured)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert fast.graphs.captured == captured, "a graph was captured while serving"
    assert verify.counts["graph_steps"] > 0 and fast.graphs.stats["uncaptured_steps"] == 0
    # all-greedy requests: decode-like verify steps verify inside the graph (the greedy lane)
    assert verify.counts["greedy_steps"] > 0
    assert any(key[-1] == "greedy" for key in fast.graphs.replays if key[0] == "verify")
    replayed = {key[1] for key in fast.graphs.replays if key[0] == "verify"}
    assert any(rows > 1 for rows in replayed)
    assert spec.metrics.verify_tokens_per_step > 1.0
    path = llm.runner.fast_prefill
    assert (path is not None and path.spec.counts["steps"] > 0) == (prefill == "ref")


def _kv_rows(llm, req, n: int) -> dict[str, torch.Tensor]:
    """Request ``req``'s valid KV of its first ``n`` positions, per layer and kind."""
    cache, cfg, table = llm.kv_cache, llm.model_config, req.block_table
    out = {}
    lo = max(0, n - cfg.sliding_window)  # older window rows may be freed
    for i in range(cfg.num_hidden_layers):
        out[f"swa{i}"] = gather_rows(cache.swa[i], table[GROUP_SWA], lo, n)
    for i, t in cache.csa_kv.items():
        out[f"csa{i}"] = gather_rows(t, table[GROUP_CSA], 0, n // cfg.csa_ratio)
        out[f"csa_index{i}"] = gather_rows(cache.csa_index[i], table[GROUP_CSA], 0, n // cfg.csa_ratio)
    for i, t in cache.hca_kv.items():
        out[f"hca{i}"] = gather_rows(t, table[GROUP_HCA], 0, n // cfg.hca_ratio)
    return out


def _run_until(llm, prompt: list[int], steps: int | None, computed: int | None):
    llm.engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    req = llm.scheduler.requests["r"]
    n = 0
    while (steps is not None and n < steps) or (computed is not None and req.num_computed_tokens < computed):
        llm.step()
        n += 1
    return req


@pytest.mark.parametrize("widened", [True, False])
def test_rollback_leaves_kv_equal_to_a_never_speculated_run(ckpt, monkeypatch, widened):
    """Random drafts (nearly all rejected) through the compiled verify graphs: the window
    rows, CSA keys / indexer keys and HCA entries of every valid position equal those of a
    run without speculation on the same path. Without the compressor rings' extra rows
    (spec/kv.py) rejected drafts overwrite history the next step pools: the KV differs."""
    if not widened:
        import deepinfer.spec.kv as kv

        monkeypatch.setattr(kv, "widen_compressor_rings", lambda cache, k: None)
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    prompt = mixed_prompts()[4]  # 133 tokens: HCA (ratio 128) has an entry
    spec_llm = make_llm(ckpt, num_speculative_tokens=5, max_num_seqs=2)
    spec_llm.runner.spec.drafter = RandomDrafter(VOCAB)
    req = _run_until(spec_llm, prompt, steps=14, computed=None)
    m = spec_llm.runner.spec.metrics
    assert m.steps >= 10 and max(m.acceptance_per_position()) < 0.2  # rejections every step
    n = len(prompt) + req.num_output_tokens - 1  # valid KV: the prompt and every output token but the last
    assert n > len(prompt) + 8 and req.num_computed_tokens >= n
    got = _kv_rows(spec_llm, req, n)
    off = make_llm(ckpt, max_num_seqs=2)
    ref = _kv_rows(off, _run_until(off, prompt, steps=None, computed=n), n)
    assert set(got) == set(ref)
    same = {name: torch.allclose(got[name].float(), ref[name].float(), rtol=1e-4, atol=1e-5) for name in ref}
    assert all(same.values()) == widened, same


class _PartlyRight(RandomDrafter):
    """Random drafts after a known-right prefix of random length (random weights accept
    nothing on their own): verify steps with accepted runs of every length."""

    def __init__(self, known: dict[str, list[int]], vocab: int) -> None:
        super().__init__(vocab)
        self.known, self.rng = known, __import__("random").Random(5)

    def propose(self, ctx, k):
        out = super().propose(ctx, k)
        for r, emitted in zip(ctx.scheduled, ctx.emitted):
            d = out.get(r.req_id)
            if d is not None and emitted is not None:
                done, j = r.output_len + len(emitted), self.rng.randrange(k + 1)
                d.tokens = (self.known[r.req_id][done: done + j] + d.tokens[j:])[:k]
        return out


def test_invariant_mode_speculative_greedy_equals_off_bitwise(ckpt, monkeypatch):
    """Batch-invariant mode on the compiled executor: with speculation every step (prompt
    chunks and verify rows) runs the mode's per-row kernels and the decode head, so the
    greedy tokens and their log-probs are the bits the non-speculative engine's invariant
    decode graphs give (the reference path rounds differently)."""
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    prompts, params = mixed_prompts()[:4], PARAMS[:4]
    off = make_llm(ckpt, batch_invariant=True, max_num_batched_tokens=64)
    base = off.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert off.runner.fast.stats["graph_steps"] > 0  # the off engine decoded in its graphs
    llm = make_llm(ckpt, batch_invariant=True, num_speculative_tokens=3, max_num_batched_tokens=64)
    spec = llm.runner.spec
    spec.drafter = _PartlyRight({f"req-{i}": o.token_ids for i, o in enumerate(base)}, VOCAB)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    lp = [[float(x) for x in o.logprobs] if o.logprobs is not None else None for o in outs]
    assert spec.metrics.mean_accepted_length > 0.5  # verify rows really emitted tokens
    assert lp == [[float(x) for x in o.logprobs] if o.logprobs is not None else None for o in base]
    assert llm.runner.fast_prefill.spec.counts["invariant_steps"] > 0
    assert spec._verify is None or spec._verify.counts["steps"] == 0  # no default-mode verify graph in the mode


def test_compiled_verify_accepts_what_the_reference_verify_accepts(ckpt, reference, monkeypatch):
    """The same drafts (a known-right prefix of random length, same seed) verified by the
    compiled verify graphs and by the reference path: equal tokens and equal accepted
    counts per draft position, with accepted runs of several lengths."""
    results = {}
    for mode in ("ref", "0"):
        monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
        monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
        monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
        llm = make_llm(ckpt, num_speculative_tokens=4, max_num_batched_tokens=64)
        spec = llm.runner.spec
        spec.drafter = _PartlyRight({f"req-{i}": t for i, t in enumerate(reference)}, VOCAB)
        outs = llm.generate(prompt_token_ids=mixed_prompts(), sampling_params=PARAMS, use_tqdm=False)
        verify = spec._verify
        results[mode] = ([o.token_ids for o in outs], list(spec.metrics.accepted), list(spec.metrics.proposed),
                         verify.counts["greedy_steps"] if verify is not None else 0, [o.logprobs for o in outs])
    assert results["ref"][0] == results["0"][0] == reference
    assert results["ref"][1:3] == results["0"][1:3]
    assert results["ref"][3] > 0 and results["0"][3] == 0  # the graphs' greedy lane vs the reference path
    for a, b in zip(results["ref"][4], results["0"][4]):  # the lane's log-probs: the emitted tokens' own
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
    assert sum(a > 0 for a in results["ref"][1]) >= 3  # accepted drafts at several positions


def test_v41_verify_graphs_warmed_and_sealed(tmp_path, monkeypatch):
    """DeepSeek-V4.1 (its DSpark stages draft): the verify set is captured at start-up for
    its decode program too, steps replay it with nothing captured while serving, and greedy
    output equals the reference path without speculation."""
    from deepinfer import LLM
    from deepinfer.models.tiny import tiny_v41_config

    write_tiny_checkpoint(str(tmp_path), seed=13, cfg=tiny_v41_config(vocab_size=VOCAB, sliding_window=32))
    prompts = [[(3 * i + 7 * j) % VOCAB for j in range(n)] for i, n in enumerate((6, 37, 90))]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=256, max_num_seqs=4, block_size=16)
    monkeypatch.setenv("DEEPINFER_FASTPATH", "0")
    ref = [o.token_ids for o in LLM(str(tmp_path), **kw).generate(prompt_token_ids=prompts, sampling_params=sp,
                                                                  use_tqdm=False)]
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    llm = LLM(str(tmp_path), num_speculative_tokens=3, max_num_batched_tokens=64, **kw)
    fast, spec = llm.runner.fast, llm.runner.spec
    verify = spec._verify
    assert verify is not None and llm.graphs_warmed == len(verify.warmed) > 0 and fast.graphs.sealed
    captured = list(fast.graphs.captured)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert fast.graphs.captured == captured and fast.graphs.stats["uncaptured_steps"] == 0
    assert verify.counts["graph_steps"] > 0


def test_v41_invariant_mode_speculative_greedy_equals_off_bitwise(tmp_path, monkeypatch):
    """V4.1 in batch-invariant mode on the compiled executor: its speculative steps run its
    prefill path's mode rows (``PrefillPathV41.spec_forward``) and the decode head, so greedy
    tokens and log-probs are the bits of the non-speculative engine's invariant decode."""
    from deepinfer import LLM
    from deepinfer.models.tiny import tiny_v41_config

    write_tiny_checkpoint(str(tmp_path), seed=13, cfg=tiny_v41_config(vocab_size=VOCAB, sliding_window=32))
    prompts = [[(3 * i + 7 * j) % VOCAB for j in range(n)] for i, n in enumerate((6, 37, 90))]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for name, value in (("DEEPINFER_FASTPATH", "ref"), ("DEEPINFER_FAST_PREFILL", "ref"),
                        ("DEEPINFER_CUDA_GRAPHS", "1")):
        monkeypatch.setenv(name, value)
    kw = dict(dtype="float32", max_model_len=256, max_num_seqs=4, block_size=16, batch_invariant=True,
              max_num_batched_tokens=64)
    base = LLM(str(tmp_path), **kw).generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    llm = LLM(str(tmp_path), num_speculative_tokens=3, **kw)
    llm.runner.spec.drafter = _PartlyRight({f"req-{i}": o.token_ids for i, o in enumerate(base)}, VOCAB)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert llm.runner.spec.metrics.mean_accepted_length > 0.5
    assert [list(o.logprobs) for o in outs] == [list(o.logprobs) for o in base]


def test_greedy_lane_is_left_for_steps_it_cannot_verify(ckpt, reference, monkeypatch):
    """A request that asks for top log-probs (or samples) keeps its steps off the greedy lane:
    they verify outside the graph, with the same greedy tokens, and the lane still serves
    steps without it."""
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    llm = make_llm(ckpt, num_speculative_tokens=3, max_num_batched_tokens=64)
    spec = llm.runner.spec
    params = list(PARAMS)
    params[0] = SamplingParams(temperature=0, max_tokens=params[0].max_tokens, ignore_eos=True, top_logprobs=2)
    outs = llm.generate(prompt_token_ids=mixed_prompts(), sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert all(len(o.top_logprobs) == len(o.token_ids) for o in outs[:1])
    verify = spec._verify
    assert verify.counts["graph_steps"] > verify.counts["greedy_steps"] > 0  # both kinds of step ran


@pytest.mark.parametrize("case", range(6))
def test_greedy_lane_verification_equals_rejection_sampling(case, fresh_seed):
    """The verify graphs' greedy lane (``greedy_verify`` on the graph's argmax / log-prob
    rows and the step's groups, padded rows included) accepts and emits what
    ``rejection_sample`` does for greedy rows, on random logits and mostly-right drafts."""
    import random

    from deepinfer.engine.sampler import pack_greedy
    from deepinfer_kernels.spec_lane import greedy_verify_ref
    from deepinfer.spec.verify import greedy_verify_result

    g, rng = torch.Generator().manual_seed(fresh_seed + case), random.Random(fresh_seed + case)
    ks = [rng.randrange(0, 6) for _ in range(rng.randrange(1, 7))]
    m = sum(k + 1 for k in ks)
    rows = m + rng.randrange(0, 4)  # padded rows: one group each, as StepInputs lays them out
    logits = torch.randn(rows, V, generator=g)
    tok = logits.argmax(-1)
    ids = torch.randint(0, V, (rows,), generator=g, dtype=torch.int32)
    offsets, o = [], 0
    for k in ks:
        offsets.append(o)
        for j in range(1, k + 1):  # draft j is mostly the argmax of the row before it
            if rng.random() < 0.75:
                ids[o + j] = int(tok[o + j - 1])
        o += k + 1
    starts = torch.tensor(offsets + list(range(m, rows)) + [rows] * (rows + 1 - len(ks) - (rows - m)),
                          dtype=torch.int32)
    lp = torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0]
    got = greedy_verify_result(greedy_verify_ref(ids, pack_greedy(tok, lp), starts), offsets, ks, rows)
    drafts = torch.cat([torch.cat([ids[s + 1:s + k + 1].long(), torch.tensor([-1])]) for s, k in zip(offsets, ks)])
    params = SamplingTensors.from_params([SamplingParams(temperature=0)] * m, list(range(m)))
    want = rejection_sample(logits[:m], params, ks, drafts)
    assert got.tokens == want.tokens and got.num_accepted == want.num_accepted and got.rows == want.rows
    for a, b in zip(got.logprobs, want.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)


def test_greedy_lane_reaches_past_128_rows_at_a_small_vocabulary(ckpt, monkeypatch):
    """The lane's row cap is a logits byte budget: at this 512-token vocabulary 32 greedy
    requests x (4 drafts + 1) = 160 verify rows still verify inside the graph, and the
    output equals no speculation."""
    from deepinfer.models.fast.verify_graphs import greedy_lane_max_rows

    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    prompts = [[(7 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(6)] for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # drafts stop at max_tokens
    want = [o.token_ids for o in make_llm(ckpt, max_num_seqs=32, max_model_len=64).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    llm = make_llm(ckpt, max_num_seqs=32, max_model_len=64, num_speculative_tokens=4, max_num_batched_tokens=256)
    fast, verify = llm.runner.fast, llm.runner.spec.verify_executor(llm.runner)
    assert verify.greedy_max_rows == greedy_lane_max_rows(VOCAB) > 160
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    assert got == want
    lanes = {key[1] for key in fast.graphs.replays if key[0] == "verify" and key[-1] == "greedy"}
    assert max(lanes) >= 160, lanes
