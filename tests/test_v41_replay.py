"""SWA bounded replay at the model level (StandaloneRunner): compact == mask == the dense
mask reference for long prompts (full prefill, chunks splitting the suffix boundary,
decode afterwards, batches mixing cuts); all three == off, bitwise, when the prompt is
no longer than keep."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.models.bounded_replay import ReplayConfig
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.models.tiny import init_random, tiny_v41_config
from deepinfer.models.v41.model import DeepseekV41Model

from v41_reference import dense_logits, unambiguous_tokens

TOL = 2e-5
WINDOW, KEEP = 16, 22  # keep >= window + 6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def model():
    cfg = tiny_v41_config(vocab_size=300, sliding_window=WINDOW, simulate_kv_quant=False, index_topk=8,
                          candidate_topk_blocks=3, candidate_block_size=4)
    m = DeepseekV41Model(cfg)
    init_random(m, 7)
    return m.eval()


def runner(model, mode: str, keep: int = KEEP, seqs: int = 4) -> StandaloneRunner:
    return StandaloneRunner(model, max_seqs=seqs, max_len=512, block_size=16, replay=ReplayConfig(mode, keep))


def prefill(r: StandaloneRunner, seq: int, tokens: list[int], chunk: int | None = None) -> torch.Tensor:
    chunk = chunk or len(tokens)
    out = [r.step([(seq, tokens[i:i + chunk])], {seq: len(tokens)})[0] for i in range(0, len(tokens), chunk)]
    return torch.cat(out)


def decode(r: StandaloneRunner, seq: int, prompt_len: int, tokens: list[int]) -> torch.Tensor:
    return torch.cat([r.step([(seq, [t])], {seq: prompt_len})[0] for t in tokens])


@pytest.mark.parametrize("n", [5, KEEP - 1, KEEP])
def test_prompt_no_longer_than_keep_equals_off_bitwise(model, n):
    rng = random.Random(n)
    prompt, tail = [rng.randrange(300) for _ in range(n)], [rng.randrange(300) for _ in range(9)]
    outs = {}
    for mode in ("off", "mask", "compact"):
        r = runner(model, mode)
        outs[mode] = torch.cat([prefill(r, 0, prompt, chunk=7), decode(r, 0, n, tail)])
    assert torch.equal(outs["off"], outs["mask"]) and torch.equal(outs["off"], outs["compact"])


@pytest.mark.parametrize("n", [KEEP + 1, 157, 301])
def test_compact_equals_mask_equals_reference_on_long_prompts(model, n, fresh_seed):
    rng = random.Random(fresh_seed)
    cut = n - KEEP
    prompt = unambiguous_tokens(model, lambda: [rng.randrange(300) for _ in range(n)], cuts=(0, cut))
    mask = prefill(runner(model, "mask"), 0, prompt)
    compact = prefill(runner(model, "compact"), 0, prompt)
    off = prefill(runner(model, "off"), 0, prompt)
    assert torch.isnan(compact[:cut]).all() and not torch.isnan(compact[cut:]).any()
    assert rel_err(compact[cut:], mask[cut:]) < TOL
    assert rel_err(mask[cut:], dense_logits(model, prompt, cut=cut)[cut:]) < TOL
    assert rel_err(off, dense_logits(model, prompt)) < TOL
    # the approximation is real: the first kept rows see a truncated decoder window
    assert rel_err(mask[cut:cut + WINDOW], off[cut:cut + WINDOW]) > 1e-4


@pytest.mark.parametrize("chunk", [9, 16, 50])
def test_chunked_prefill_across_the_boundary_then_decode(model, chunk, fresh_seed):
    rng = random.Random(fresh_seed)
    n = 201
    cut = n - KEEP
    # chunked and whole prefills score the indexer in different orders: a near-tie top-k pick may flip
    tokens = unambiguous_tokens(model, lambda: [rng.randrange(300) for _ in range(n + 2 * WINDOW)], cuts=(cut,))
    prompt, tail = tokens[:n], tokens[n:]
    assert any(i < cut < i + chunk for i in range(0, n, chunk)), "a chunk must straddle the cut"
    ref = runner(model, "mask")
    want = torch.cat([prefill(ref, 0, prompt), decode(ref, 0, n, tail)])
    for mode in ("mask", "compact"):
        r = runner(model, mode)
        got = torch.cat([prefill(r, 0, prompt, chunk), decode(r, 0, n, tail)])
        assert rel_err(got[cut:], want[cut:]) < TOL, f"{mode} in chunks of {chunk}"
    # decode reads only rows the decoder layers computed: greedy continuations agree
    assert torch.equal(got[n:].argmax(-1), want[n:].argmax(-1))


def test_batch_mixing_cuts_prefills_and_decodes(model, fresh_seed):
    rng = random.Random(fresh_seed)
    lens = [10, 150, KEEP, 90]
    prompts = [unambiguous_tokens(model, lambda n=n: [rng.randrange(300) for _ in range(n)], cuts=(max(0, n - KEEP),))
               if i in (1, 3) else [rng.randrange(300) for _ in range(n)] for i, n in enumerate(lens)]
    results = {}
    for mode in ("mask", "compact"):
        r = runner(model, mode)
        # prompt 0 fully prefilled first, then decodes while the others prefill in one batch
        first = r.step([(0, prompts[0])], {0: lens[0]})[0]
        out = r.step([(0, [3])] + [(i, p) for i, p in enumerate(prompts) if i], dict(enumerate(lens)))
        out2 = r.step([(i, [5]) for i in range(4)], dict(enumerate(lens)))
        results[mode] = (first, out, out2)
    (f_m, o_m, d_m), (f_c, o_c, d_c) = results["mask"], results["compact"]
    assert torch.equal(f_m, f_c)  # 10 <= keep: nothing truncated
    for i, n in enumerate([1] + lens[1:]):
        start = 0 if i == 0 else max(0, lens[i] - KEEP)
        assert rel_err(o_c[i][start:], o_m[i][start:]) < TOL, f"sequence {i}"
        assert rel_err(d_c[i], d_m[i]) < TOL
    # each sequence of the batch equals its own dense mask reference
    for i in (1, 3):
        cut = max(0, lens[i] - KEEP)
        assert rel_err(o_m[i][cut:], dense_logits(model, prompts[i], cut=cut)[cut:]) < TOL


def test_default_keep_and_window(fresh_seed):
    """The released numbers: window 128, keep 140."""
    cfg = tiny_v41_config(vocab_size=300, simulate_kv_quant=False)
    m = DeepseekV41Model(cfg)
    init_random(m, fresh_seed)
    rng = random.Random(fresh_seed)
    prompt = [rng.randrange(300) for _ in range(420)]
    cut = 420 - 140
    got = {mode: prefill(StandaloneRunner(m, 1, 512, replay=ReplayConfig(mode)), 0, prompt, 100)
           for mode in ("mask", "compact")}
    assert rel_err(got["compact"][cut:], got["mask"][cut:]) < TOL


def test_kv_rounding_on_compact_equals_off_for_short_prompts():
    """With the checkpoint's KV rounding simulated, a prompt <= keep still runs exactly
    the off path (bitwise)."""
    cfg = tiny_v41_config(vocab_size=300, sliding_window=WINDOW, simulate_kv_quant=True)
    m = DeepseekV41Model(cfg)
    init_random(m, 1)
    prompt = list(range(3, 3 + KEEP))
    a = prefill(runner(m, "off"), 0, prompt, 5)
    b = prefill(runner(m, "compact"), 0, prompt, 5)
    assert torch.equal(a, b)


def test_batch_invariant_mode_makes_compact_equal_mask_bitwise():
    """In batch-invariant mode every GEMM / softmax a row sees has one shape, so compact
    and mask give the same bits on kept rows, whatever the chunking, with KV rounding on,
    and so do the decodes that follow (batched with another request)."""
    from deepinfer.batch_invariant import batch_invariant_mode

    cfg = tiny_v41_config(vocab_size=300, sliding_window=WINDOW, simulate_kv_quant=True, index_topk=8,
                          candidate_topk_blocks=3, candidate_block_size=4)
    m = DeepseekV41Model(cfg)
    init_random(m, 4)
    rng = random.Random(4)
    n = 230
    prompt, other = [rng.randrange(300) for _ in range(n)], [rng.randrange(300) for _ in range(40)]
    outs = {}
    with batch_invariant_mode(True):
        for mode, chunk in (("mask", n), ("compact", n), ("compact", 37), ("mask", 16)):
            r = runner(m, mode, seqs=2)
            got = prefill(r, 0, prompt, chunk)[n - KEEP:]
            r.step([(1, other)], {1: len(other)})
            dec = torch.cat([r.step([(0, [t]), (1, [t + 1])], {0: n, 1: len(other)})[0] for t in range(20)])
            outs[(mode, chunk)] = torch.cat([got, dec])
    ref = outs[("mask", n)]
    for key, val in outs.items():
        assert torch.equal(val, ref), key
