"""DeepSeek-V4.1 prefill / mixed steps on the compiled executor (deepinfer/models/v41/
fast/prefill*.py) on CPU: every prompt chunk and every mixed step (chunks + decode rows)
of a generate through the executor, with the kernels' torch references
(DEEPINFER_FAST_PREFILL=ref), must give the reference path's greedy tokens and log-probs,
for each bounded-replay mode (off / mask / compact) and with the checkpoint's KV-cache
rounding; the Triton kernels the executor adds (interpreted) equal their references on a
real step's inputs; the speculative chunk's captures equal the reference's; the lead's
GPU script runs end to end on CPU stand-ins."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.tiny import tiny_v41_config, write_tiny_checkpoint  # noqa: E402

VOCAB, WINDOW, KEEP = 512, 32, 40


#: With the checkpoint's KV-cache rounding the executor's float32 op order, an ulp or so off
#: the reference's, can put a stored value one FP8 / FP4 step apart (seen: a 1.2e-6 input
#: difference moved one window-KV element by 6e-2, the log-probs by 4e-4), and an FP4 index
#: key one step apart can change a later query's top-k entries (one log-prob 0.24 apart, four
#: decode steps on). So rounded runs must give the same greedy tokens with nearly all log-probs
#: within ROUNDED_TOL; without the rounding every log-prob agrees to UNROUNDED_TOL.
ROUNDED_TOL, ROUNDED_SHARE, UNROUNDED_TOL = 3e-3, 0.9, 1e-4


def _checkpoint(tmp_path_factory, rounded: bool) -> str:
    path = tmp_path_factory.mktemp("tiny_v41_prefill")
    # index_topk 8 < the entries of most prompts and 4 candidate blocks of 8 entries < the
    # ratio-1 entries of the long prompts (the candidate filter prunes); head_dim 64 keeps
    # the FP8 (32) / FP4 (16, 32) rounding blocks
    cfg = tiny_v41_config(vocab_size=VOCAB, sliding_window=WINDOW, index_topk=8, candidate_topk_blocks=4,
                          simulate_kv_quant=rounded)
    write_tiny_checkpoint(str(path), seed=21, cfg=cfg)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The checkpoint with V4.1's KV-cache rounding (FP8 window KV, FP4 shared KV / index keys)."""
    return _checkpoint(tmp_path_factory, rounded=True)


@pytest.fixture(scope="module")
def ckpt_unrounded(tmp_path_factory):
    return _checkpoint(tmp_path_factory, rounded=False)


PROMPTS = [[(5 * i + 11 * j) % VOCAB for j in range(n)] for i, n in enumerate((1, 7, 45, 97, 150))]


def _run(ckpt, monkeypatch, prefill, replay="off", tokens=6, prompts=PROMPTS, budget=64, decode="0",
         prefix_caching=False):
    """A generate with the prefill executor ``prefill`` (0 = reference) and the decode path
    ``decode``; a small token budget chunks the prompts, so steps mix chunks and decode rows."""
    monkeypatch.setenv("DEEPINFER_FASTPATH", decode)
    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", prefill)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "0")
    llm = LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=8, block_size=16, swa_replay_mode=replay,
              swa_replay_keep=KEEP, max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching)
    kinds = []
    fp = llm.runner.fast_prefill
    if fp is not None:  # record what each step the executor ran held
        prepare = fp.prepare

        def spy(batch):
            meta = prepare(batch)
            if meta is not None:
                kinds.append((any(s.length > 1 for s in batch.seqs), any(s.length == 1 and not s.is_new
                                                                         for s in batch.seqs),
                              any(s.is_new and s.start > 0 for s in batch.seqs)))  # a prefix-cache hit
            return meta
        monkeypatch.setattr(fp, "prepare", spy)
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, top_logprobs=2)
    return llm, llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False), kinds


def _same(ref, fast, tol=UNROUNDED_TOL, share=1.0):
    """Equal greedy tokens, and at least ``share`` of the log-probs within ``tol``."""
    close, total = 0, 0
    for a, b in zip(ref, fast):
        assert a.token_ids == b.token_ids
        close += sum(math.isclose(x, y, rel_tol=tol, abs_tol=tol) for x, y in zip(a.logprobs, b.logprobs))
        total += len(a.logprobs)
    assert total and close >= share * total, f"{total - close} of {total} log-probs differ by more than {tol}"


def _same_rounded(ref, fast):
    _same(ref, fast, ROUNDED_TOL, ROUNDED_SHARE)


@pytest.mark.parametrize("replay", ["off", "mask", "compact"])
def test_v41_prefill_and_mixed_steps_match_reference(ckpt, monkeypatch, replay):
    ref_llm, ref, _ = _run(ckpt, monkeypatch, "0", replay)
    assert ref_llm.runner.fast_prefill is None
    fast_llm, fast, kinds = _run(ckpt, monkeypatch, "ref", replay)
    assert kinds  # steps the executor ran
    assert any(chunk and dec for chunk, dec, _ in kinds), "no mixed step (prompt chunk + decode rows) ran"
    stats = fast_llm.runner.fast_prefill.stats
    assert stats["prefill_rows"] >= sum(map(len, PROMPTS))
    if replay == "compact":  # the decoder layers ran on fewer rows than the prompts have
        assert 0 < stats["replayed_rows"] < stats["prefill_rows"]
    _same_rounded(ref, fast)


@pytest.mark.parametrize("replay", ["off", "compact"])
def test_v41_prefill_and_mixed_steps_match_reference_unrounded(ckpt_unrounded, monkeypatch, replay):
    """Without the KV-cache rounding no value sits near a rounding boundary: the executor's
    log-probs all equal the reference's to 1e-4 (mixed steps)."""
    _, ref, _ = _run(ckpt_unrounded, monkeypatch, "0", replay)
    _, fast, kinds = _run(ckpt_unrounded, monkeypatch, "ref", replay)
    assert any(chunk and dec for chunk, dec, _ in kinds)
    _same(ref, fast)


def test_v41_prefill_with_the_decode_path(ckpt, monkeypatch):
    """Both compiled executors together (decode steps on the fast decode path), compact replay."""
    _, ref, _ = _run(ckpt, monkeypatch, "0", "compact")
    llm, fast, _ = _run(ckpt, monkeypatch, "ref", "compact", decode="ref")
    assert llm.runner.fast.stats["fast_steps"] > 0
    _same_rounded(ref, fast)


@pytest.mark.parametrize("replay", ["off", "compact"])
def test_v41_prefill_after_prefix_cache_hits(ckpt, monkeypatch, replay):
    """Prompts sharing a 96-token prefix with an earlier one start their prefill at a cached
    block (hits capped at the cut under replay): the executor's chunks from there match."""
    shared = PROMPTS[4][:96]
    first, later = [shared + [1, 2, 3]], [shared + [(9 * j) % VOCAB for j in range(n)] for n in (5, 40)]
    outs = {}
    for prefill in ("0", "ref"):
        llm, _, kinds = _run(ckpt, monkeypatch, prefill, replay, prompts=first, prefix_caching=True)
        sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, top_logprobs=2)
        outs[prefill] = llm.generate(prompt_token_ids=later, sampling_params=sp, use_tqdm=False)
    assert any(k[2] for k in kinds), "no step started a prompt after a prefix-cache hit"
    _same_rounded(outs["0"], outs["ref"])


def test_v41_prefill_triton_attention_kernels():
    """The interpreted Triton kernels this executor adds to the decode path's (prefill
    attention with the replay floor over window + selected shared entries, indexer scores
    over per-row tables) on the inputs of a real compact-replay step of two requests: each
    call equals its torch reference (the step goes on with the reference's output, so every
    call sees the reference's inputs: a 1e-6 difference can flip an MoE expert or an FP4
    level downstream, which is numerics, not the kernel; the interpreter takes minutes for a
    whole step's mHC, so the rest runs the references)."""
    from types import SimpleNamespace

    from deepinfer.models.bounded_replay import ReplayConfig
    from deepinfer.models.v41.model import DeepseekV41Model
    from deepinfer.models.fast.prefill import prefill_ops
    from deepinfer.models.v41.fast.prefill import PrefillPathV41
    from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
    from deepinfer.models.standalone import StandaloneRunner
    from deepinfer.models.tiny import init_random
    from deepinfer_kernels import indexer_topk, prefill_attention

    cfg = tiny_v41_config(vocab_size=VOCAB, sliding_window=16, index_topk=4, candidate_topk_blocks=2)
    model = DeepseekV41Model(cfg).eval()
    init_random(model, 4)
    rc = ReplayConfig("compact", 22)  # cut 8 for the 30-token prompt: rows 0..7 skip the decoder layers
    ref_run, fast_run = (StandaloneRunner(model, max_seqs=2, max_len=64, block_size=16, replay=rc) for _ in range(2))
    calls: dict[str, list] = {"prefill_attention": [], "indexer_scores": []}

    def checked(name, kernel, ref):
        def run(*args, **kwargs):
            want, got = ref(*args, **kwargs), kernel(*args, **kwargs)
            calls[name].append(kwargs.get("floor") is not None)
            assert not got.isnan().any() and torch.allclose(got, want, rtol=1e-5, atol=1e-5), name
            return want
        return run

    ops = SimpleNamespace(**vars(prefill_ops("ref")))
    ops.prefill_attention = checked("prefill_attention", prefill_attention.prefill_attention, ops.prefill_attention)
    ops.indexer_scores = checked("indexer_scores", indexer_topk.indexer_scores, ops.indexer_scores)
    path = PrefillPathV41(model, fast_run.cache, ops)
    seqs = [SeqMeta(0, 20, 0, ref_run._table(0), 0, True, 30), SeqMeta(0, 7, 20, ref_run._table(1), 1, True, 7)]
    batch = ForwardBatch(torch.arange(27) * 7 % VOCAB, torch.cat([torch.arange(20), torch.arange(7)]), seqs, rc)
    ref = model(batch, ref_run.cache)
    hidden = path.forward(batch, path.prepare(batch))
    assert len(calls["prefill_attention"]) == cfg.num_hidden_layers and any(calls["prefill_attention"])
    assert len(calls["indexer_scores"]) == len(cfg.index_source_layer_ids)
    assert torch.equal(ref.isnan(), hidden.isnan()) and ref.isnan().any()  # the dropped rows
    assert torch.allclose(ref.nan_to_num(), hidden.nan_to_num(), rtol=1e-4, atol=5e-4)


def test_prefill_attention_floor_matches_reference():
    """The kernel's per-request floor: window keys below it are masked, as the reference's."""
    from deepinfer_kernels.prefill_attention import prefill_attention, prefill_attention_ref

    g = torch.Generator().manual_seed(3)
    bs, d, h, window = 8, 64, 4, 16
    starts, lens = [0, 20], [30, 12]
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    row_req = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])
    pool = torch.randn(16, bs, d, generator=g)
    table = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], dtype=torch.int32)
    q = torch.randn(len(pos), h, d, generator=g)
    sink = torch.randn(h, generator=g)
    floor = torch.tensor([12, 25], dtype=torch.int32)
    ref = prefill_attention_ref(q, pos, row_req, pool, table, window, sink, floor=floor)
    out = prefill_attention(q, pos, row_req, pool, table, window, sink, floor=floor)
    assert torch.allclose(out, ref, atol=1e-5)
    plain = prefill_attention_ref(q, pos, row_req, pool, table, window, sink)
    below = pos - window + 1 < torch.where(row_req == 0, 12, 25)  # rows whose window crosses the floor
    assert not torch.allclose(plain[below], ref[below], atol=1e-3)  # the floor changed exactly those
    assert torch.allclose(plain[~below], ref[~below], atol=1e-6)


def test_v41_prefill_h200_script_tiny(tmp_path):
    """The lead's GPU script (benchmarks/v41_prefill_h200.py) end to end on CPU stand-ins:
    its JSON has the commit, hardware, config and a targets list, and its checks ran the
    compiled executor (the small-budget engine on mixed steps)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "v41_prefill_h200.py"), "--tiny", "--out",
                    str(tmp_path)], check=True, env=env, timeout=600)
    (path,) = tmp_path.glob("v41_prefill_cpu_*.json")
    out = json.loads(path.read_text())
    assert out["commit"] and out["hardware"] == "cpu" and out["config"]["v41"]["model_type"] == "deepseek_v41"
    assert {t["name"] for t in out["targets"]} >= {"v41 8k prefill (compact) / v4 8k prefill"}
    for mode in ("off", "mask", "compact", "mixed_compact"):
        check = out["v41"][mode]["check"]
        assert check["compiled_prefill_steps"] > 0 and check["first_token_equal"]
    assert out["v41"]["compact"]["prefill"]["path"] == "compiled"
    assert out["v41"]["compact"]["prefill_reference"]["path"] == "reference"


@pytest.mark.parametrize("replay", ["off", "compact"])
def test_v41_prefill_spec_forward_captures_like_reference(replay):
    """``PrefillPathV41.spec_forward`` (a speculative step's chunk): the collapsed hidden of
    every row and the drafter's captured layer inputs equal ``DeepseekV41Model.forward``'s
    with ``capture`` (NaN on the rows a compact replay dropped, in the same places), over
    two steps of two requests (a prompt chunk, then its continuation beside a new prompt)."""
    from deepinfer.models.bounded_replay import ReplayConfig
    from deepinfer.models.v41.model import DeepseekV41Model
    from deepinfer.models.fast.prefill import prefill_ops
    from deepinfer.models.v41.fast.prefill import PrefillPathV41
    from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
    from deepinfer.models.standalone import StandaloneRunner
    from deepinfer.models.tiny import init_random

    # no KV-cache rounding: hidden states are compared to 5e-4, which one value landing a
    # rounding step apart would exceed (the engine tests above cover the rounding)
    cfg = tiny_v41_config(vocab_size=VOCAB, sliding_window=WINDOW, index_topk=8, candidate_topk_blocks=4,
                          simulate_kv_quant=False)
    model = DeepseekV41Model(cfg).eval()
    init_random(model, 4)
    rc = ReplayConfig(replay, KEEP)
    ref_run, fast_run = (StandaloneRunner(model, max_seqs=2, max_len=160, block_size=16, replay=rc)
                         for _ in range(2))
    path = PrefillPathV41(model, fast_run.cache, prefill_ops("ref"))
    layers = (1, 5, 7)
    prompts = {0: PROMPTS[3][:90], 1: PROMPTS[4][:120]}
    steps = [[(0, 0, 70)], [(0, 70, 90), (1, 0, 120)]]  # (sequence, first position, end)
    for feeds in steps:
        ids, pos, seqs, off = [], [], [], 0
        for sid, s, e in feeds:
            seqs.append(SeqMeta(s, e - s, off, ref_run._table(sid), sid, s == 0, len(prompts[sid])))
            ids += prompts[sid][s:e]
            pos += range(s, e)
            off += e - s
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), seqs, rc)
        capture = dict.fromkeys(layers)
        ref = model(batch, ref_run.cache, capture)
        hidden, got, logits = path.spec_forward(batch, layers, invariant=False)
        assert torch.equal(ref.isnan(), hidden.isnan())
        # float32 through 8 layers: kernel references vs the reference path's own op order
        assert torch.allclose(ref.nan_to_num(), hidden.nan_to_num(), rtol=1e-4, atol=5e-4)
        for i in layers:
            assert torch.equal(capture[i].isnan(), got[i].isnan()), i
            assert torch.allclose(capture[i].nan_to_num(), got[i].nan_to_num(), rtol=1e-4, atol=5e-4), i
        last = torch.tensor([s.offset + s.length - 1 for s in seqs])
        assert torch.allclose(logits(last), model.compute_logits(ref[last]), rtol=1e-4, atol=5e-4)
    if replay == "compact":
        assert path.stats["replayed_rows"] < path.stats["prefill_rows"]


def test_decode_attention_floor_matches_reference():
    """decode_attention's per-row floor (the invariant mode's prefill rows under replay):
    the interpreted kernel equals its reference, and a floor at or below a row's window
    start gives the bits of no floor (masked, not skipped: the splits stay)."""
    from deepinfer_kernels.decode_attention import decode_attention, decode_attention_ref

    g = torch.Generator().manual_seed(5)
    bs, d, h, window = 8, 64, 4, 16
    pos = torch.tensor([3, 17, 25, 30, 9])
    pool = torch.randn(12, bs, d, generator=g)
    table = torch.arange(12, dtype=torch.int32).view(3, 4).repeat_interleave(torch.tensor([2, 2, 1]), dim=0)
    q = torch.randn(len(pos), h, d, generator=g)
    sink = torch.randn(h, generator=g)
    floor = torch.tensor([0, 12, 20, 31, 0], dtype=torch.int32)  # row 3: every window key below it
    for splits in (16, 256):  # several splits (merge kernel), one split
        ref = decode_attention_ref(q, pos, pool, table, window, sink, kv_chunk=splits, floor=floor)
        out = decode_attention(q, pos, pool, table, window, sink, kv_chunk=splits, max_keys=window, floor=floor)
        assert torch.allclose(out, ref.float(), atol=1e-5)
        low = torch.clamp(pos - window + 1, min=0).to(torch.int32)  # exactly each row's window start
        plain = decode_attention(q, pos, pool, table, window, sink, kv_chunk=splits, max_keys=window)
        assert torch.equal(plain, decode_attention(q, pos, pool, table, window, sink, kv_chunk=splits,
                                                   max_keys=window, floor=low))
        assert not torch.allclose(plain[1:4], out[1:4], atol=1e-3)
