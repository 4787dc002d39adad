"""compressor_prefill (interpreter on CPU, tiny shapes) and its torch reference against the
model's own ``Compressor.forward`` run request by request, and against the batched torch
``compress_prefill``: one mixed step with a continuing request (history in its ring, windows
closing and a block ending inside the chunk), a one-row decode-like request, a new request
resuming after a prefix-cache hit (history restored from the cached block's tail) and a new
request from position 0. Entries, rings and tails must all agree."""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer.models.fast.prefill_compressor import build_plan, compress_prefill  # noqa: E402
from deepinfer.models.fast.prefill_compressor_fused import build_fused_plan, compress_prefill_fused  # noqa: E402
from deepinfer.models.paged_batch import SeqMeta  # noqa: E402
from deepinfer.models.rope import Rotary  # noqa: E402
from deepinfer.models.v4.compressor import Compressor, CompressorStore  # noqa: E402
from deepinfer_kernels import compressor_prefill as cp  # noqa: E402

BS, HIDDEN = 16, 16
TABLES = {"A": [4, 1, 5, 0], "B": [2, 6], "C": [4, 3, 7], "D": [8]}  # C shares A's first (cached) block
SLOTS = {"A": 0, "B": 2, "C": 1, "D": 3}
FIRST = [("A", 0, 22), ("B", 0, 7)]  # (request, start, length): the step that writes the history
STEP = [("A", 22, 13), ("B", 7, 1), ("C", 16, 9), ("D", 0, 5)]  # the step under test


def _seqs(rows: list[tuple[str, int, int]]) -> list[SeqMeta]:
    seqs, off = [], 0
    for name, start, length in rows:
        new = start == 0 or name == "C"
        seqs.append(SeqMeta(start, length, off, {"csa": TABLES[name]}, SLOTS[name], is_new=new))
        off += length
    return seqs


def _setup(seed: int, ratio: int, overlap: bool, d: int, dtype: torch.dtype):
    g = gen(seed)
    comp = Compressor(HIDDEN, d, ratio, overlap, 1e-6, dtype).to(DEVICE)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    rotary = Rotary(16, 160000.0, {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536})
    c, ring_len = comp.wkv.out_features, comp.ring_len + 3
    store = CompressorStore(torch.randn(10, BS // ratio, d, generator=g).to(dtype).to(DEVICE),
                            torch.randn(4, ring_len, 2, c, generator=g).to(DEVICE),
                            torch.randn(10, ratio, 2, d, generator=g).to(DEVICE) if overlap else None, "csa")
    with torch.no_grad():
        for seq in _seqs(FIRST):  # the history, as the reference writes it
            x = torch.randn(seq.length, HIDDEN, generator=g).to(dtype).to(DEVICE)
            comp(x, seq, store, rotary, BS)
    x = torch.randn(sum(n for _, _, n in STEP), HIDDEN, generator=g).to(dtype).to(DEVICE)
    return comp, rotary, store, x


def _clone(store: CompressorStore) -> CompressorStore:
    return CompressorStore(store.entries.clone(), store.ring.clone(),
                           store.tail.clone() if store.tail is not None else None, store.group)


#: elementwise tolerance of float32 rings / tails whose projections ran in the input dtype
RING_TOL = {torch.float32: {"rtol": 1.3e-6, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,overlap,d", [(4, True, 32), (8, False, 32), (16, False, 64)])
def test_compressor_prefill_matches_the_model(fresh_seed: int, dtype: torch.dtype, ratio: int, overlap: bool,
                                              d: int) -> None:
    comp, rotary, store, x = _setup(fresh_seed, ratio, overlap, d, dtype)
    seqs = _seqs(STEP)
    pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in seqs]).to(DEVICE)
    before = _clone(store)
    oracle = _clone(store)
    with torch.no_grad():
        for seq in seqs:
            comp(x[seq.offset:seq.offset + seq.length], seq, oracle, rotary, BS)
        kv, gate = comp.wkv(x), comp.wgate(x)
    assert not torch.equal(oracle.entries, before.entries), "no window closed: the test lost its point"
    if overlap:
        assert not torch.equal(oracle.tail, before.tail), "no block ended in the step"
    ring_slots, ring_len = store.ring.shape[:2]
    plan = build_fused_plan(seqs, ratio, overlap, ring_slots, ring_len, "csa", BS // ratio, BS, overlap, pos.device)
    inv = rotary.inv_freq.to(DEVICE)
    outs = {}
    with torch.no_grad():
        for name, fn in (("ref", cp.compressor_prefill_ref), ("triton", cp.compressor_prefill)):
            st = _clone(before)
            compress_prefill_fused(comp, kv, gate, pos, plan, st, inv, SimpleNamespace(compressor_prefill=fn))
            outs[name] = st
        st = _clone(before)
        compress_prefill(comp, kv, gate, pos, build_plan(seqs, ratio, overlap, ring_len, "csa", BS // ratio, BS,
                                                         pos.device), st, rotary, BS)
        outs["torch batched"] = st
    batched = outs["torch batched"]  # the same projections as the fused paths: bitwise rings and tails
    for name, st in outs.items():
        # the oracle projects per request, the fused paths the whole step: the dtype's GEMM rounding
        # (elementwise: empty ring slots hold -inf gate scores)
        torch.testing.assert_close(st.ring, oracle.ring, **RING_TOL[dtype])
        assert_close(st.entries.float(), oracle.entries.float(), dtype)
        assert torch.equal(st.ring, batched.ring), f"{name}: ring rows differ from compress_prefill's"
        assert_close(st.entries.float(), batched.entries.float(), dtype)
        if overlap:
            torch.testing.assert_close(st.tail, oracle.tail, **RING_TOL[dtype])
            assert torch.equal(st.tail, batched.tail), f"{name}: overlap tails differ from compress_prefill's"


def test_new_request_off_the_ratio_grid_is_refused() -> None:
    seq = SeqMeta(6, 3, 0, {"csa": [0, 1]}, 0, is_new=True)
    with pytest.raises(ValueError, match="position 6, not at a multiple of the compressor ratio 4"):
        build_fused_plan([seq], 4, True, 2, 11, "csa", 4, BS, True, torch.device("cpu"))


def test_plan_views_are_16_byte_aligned() -> None:
    """Triton compiles a variant per pointer alignment: every plan view must start aligned,
    whatever the lengths of the arrays packed before it."""
    seqs = _seqs(STEP)
    for ratio, overlap in ((4, True), (8, False), (16, False)):
        plan = build_fused_plan(seqs, ratio, overlap, 4, 2 * ratio + 3, "csa", BS // ratio, BS, overlap,
                                torch.device("cpu"))
        for name, view in vars(plan).items():
            assert view.data_ptr() % 16 == 0, (ratio, name, view.numel())
