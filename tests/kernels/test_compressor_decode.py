"""compressor_decode kernel vs its torch reference (interpreter on CPU, tiny shapes):
ring rows, pooled entries (closing windows only) and overlap tails (block ends only)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer.models.rope import yarn_inv_freq  # noqa: E402
from deepinfer_kernels.compressor_decode import compressor_decode, compressor_decode_ref  # noqa: E402

BS = 16


def _state(g: torch.Generator, n_req: int, ratio: int, overlap: bool, d: int, dtype: torch.dtype, ring_extra: int):
    c = (2 if overlap else 1) * d
    ring_len = (2 * ratio if overlap else ratio) + ring_extra
    n_slots, n_blocks, width = n_req + 2, 4 * n_req + 3, 4
    ring = torch.randn(n_slots, ring_len, 2, c, generator=g) * 2
    entries = torch.randn(n_blocks, BS // ratio, d, generator=g).to(dtype)
    tail = torch.randn(n_blocks, ratio, 2, d, generator=g) if overlap else None
    table = torch.randperm(n_blocks, generator=g)[:n_req * width].view(n_req, width).to(torch.int32)
    slots = torch.randperm(n_slots, generator=g)[:n_req]
    kv = torch.randn(n_req, c, generator=g).to(dtype)
    score = (torch.randn(n_req, c, generator=g) * 3).to(dtype)
    ape = torch.randn(ratio, c, generator=g)
    norm_w = torch.rand(d, generator=g) + 0.5
    return [t.to(DEVICE) if t is not None else None for t in (kv, score, ape, slots, ring, entries, table, tail, norm_w)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ratio,overlap,d,ring_extra", [(4, True, 32, 0), (4, True, 32, 3), (8, False, 64, 0)])
def test_compressor_decode(fresh_seed: int, dtype: torch.dtype, ratio: int, overlap: bool, d: int,
                           ring_extra: int) -> None:
    g = gen(fresh_seed)
    # window 0 closing, later windows closing, a block end, open windows, a repeated (padded) row
    positions = torch.tensor([ratio - 1, 2 * ratio - 1, BS - 1, ratio + 1, 3 * BS - 1, 0, 2 * ratio - 1])
    n_req = positions.numel()
    kv, score, ape, slots, ring, entries, table, tail, norm_w = _state(g, n_req, ratio, overlap, d, dtype, ring_extra)
    slots[-1], table[-1] = slots[1], table[1]  # graph padding: an exact copy of another row
    inv_freq = yarn_inv_freq(16, 160000.0, {"factor": 16, "original_max_position_embeddings": 65536}).to(DEVICE)
    pos = positions.to(DEVICE)
    before, tail_before = entries.clone(), tail.clone() if tail is not None else None
    ref = {k: v.clone() if v is not None else None for k, v in (("ring", ring), ("entries", entries), ("tail", tail))}
    compressor_decode(kv, score, ape, pos, slots, ring, entries, table, tail, norm_w, 1e-6, inv_freq, ratio, overlap, BS)
    compressor_decode_ref(kv, score, ape, pos, slots, ref["ring"], ref["entries"], table, ref["tail"], norm_w, 1e-6,
                          inv_freq, ratio, overlap, BS)
    assert torch.equal(ring, ref["ring"]), "ring rows must be the exact float32 projections"
    assert (ref["entries"] != before).any(), "no window closed: the test lost its point"
    assert_close(entries.float(), ref["entries"].float(), dtype)
    if tail is not None:
        assert torch.equal(tail, ref["tail"]) and not torch.equal(tail, tail_before)


def test_compressor_decode_rejects_mismatched_width() -> None:
    z = torch.zeros(2, 48, device=DEVICE)
    ring = torch.zeros(2, 8, 2, 48, device=DEVICE)
    entries = torch.zeros(3, 4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="kv width 48"):
        compressor_decode(z, z, torch.zeros(4, 48, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE),
                          torch.zeros(2, dtype=torch.long, device=DEVICE), ring, entries,
                          torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), None, torch.ones(32, device=DEVICE),
                          1e-6, torch.ones(8, device=DEVICE), 4, True, BS)


@pytest.mark.parametrize("overlap,ratio", [(True, 4), (False, 8)])
def test_grouped_rows_match_compressor_forward(fresh_seed: int, overlap: bool, ratio: int) -> None:
    """Several consecutive tokens of one request (a token and its drafts) in one launch, the
    rows processed in order: the same ring, entries and tail as the model's Compressor.forward
    over that chunk, with windows closing and a block ending inside it (float32)."""
    from deepinfer.models.v4.compressor import Compressor, CompressorStore
    from deepinfer.models.paged_batch import SeqMeta
    from deepinfer.models.rope import Rotary

    g = gen(fresh_seed)
    torch.manual_seed(fresh_seed)
    hidden, d, extra = 16, 32, 8  # extra ring rows: the spec rings' k + 1
    comp = Compressor(hidden, d, ratio, overlap, 1e-6, torch.float32).to(DEVICE)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    rotary = Rotary(16, 160000.0, {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536})
    c, ring_len = comp.wkv.out_features, (2 * ratio if overlap else ratio) + extra
    n_blocks, table = 6, [4, 1, 5, 0]
    store = CompressorStore(torch.zeros(n_blocks, BS // ratio, d, device=DEVICE),
                            torch.zeros(2, ring_len, 2, c, device=DEVICE),
                            torch.zeros(n_blocks, ratio, 2, d, device=DEVICE) if overlap else None, "csa")
    prefix, chunk = 10, 9  # positions 10..18: windows close at 11, 15 (and 17 for ratio 4); block end at 15
    x = torch.randn(prefix + chunk, hidden, generator=g).to(DEVICE)
    with torch.no_grad():
        comp(x[:prefix], SeqMeta(0, prefix, 0, {"csa": table}, 1, is_new=True), store, rotary, BS)
        state = [t.clone() if t is not None else None for t in (store.ring, store.entries, store.tail)]
        comp(x[prefix:], SeqMeta(prefix, chunk, 0, {"csa": table}, 1), store, rotary, BS)
        kv, score = comp.wkv(x[prefix:]), comp.wgate(x[prefix:])
    pos = torch.arange(prefix, prefix + chunk, device=DEVICE)
    slots = torch.ones(chunk, dtype=torch.long, device=DEVICE)
    tab = torch.tensor([table] * chunk, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE)
    inv = rotary.inv_freq.to(DEVICE)
    for fn in (compressor_decode_ref, compressor_decode):
        ring, entries, tail = [t.clone() if t is not None else None for t in state]
        fn(kv, score, comp.ape, pos, slots, ring, entries, tab, tail, comp.norm.weight, comp.norm.eps, inv, ratio,
           overlap, BS, row_starts=starts)
        assert torch.allclose(ring, store.ring), fn.__name__
        assert_close(entries, store.entries, torch.float32)
        if overlap:
            assert torch.allclose(tail, store.tail), fn.__name__
