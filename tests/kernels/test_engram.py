"""Engram decode kernels (deepinfer_kernels/engram.py) vs the reference path's NgramHasher
and Engram gate: hashes bitwise (the trained tables are noise otherwise), the gate within
the dtype's tolerance; rows of one request in one step, look-back before position 0 and a
graph's padded rows (copies of row 0) included."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer.models.tiny import tiny_v41_config  # noqa: E402
from deepinfer.models.v41.engram import Engram, NgramHasher  # noqa: E402
from deepinfer_kernels.engram import engram_gate, engram_gate_ref, engram_hash, engram_hash_ref  # noqa: E402


def _cfg(**kw):
    return tiny_v41_config(vocab_size=5000, engram_n_heads=3, **kw)


def test_engram_hash_bitwise(fresh_seed: int) -> None:
    g = gen(fresh_seed)
    hasher = NgramHasher(_cfg())
    bs, width, n_blocks = 4, 5, 24
    # request A: one decode row at 13; B: rows 0..2 in this step (look-back before 0 padded);
    # C: rows 6, 7 (its row 5 and before come from the store); then two padded copies of row 0
    pos = torch.tensor([13, 0, 1, 2, 6, 7, 13, 13])
    slots = torch.tensor([0, 1, 1, 1, 2, 2, 0, 0])
    ids = torch.randint(0, 5000, (8,), generator=g)
    ids[6:] = ids[0]
    tables = torch.randperm(n_blocks, generator=g)[:3 * width].view(3, width).to(torch.int32)
    table = tables[slots]
    store = torch.randint(0, 5000, (n_blocks, bs), generator=g)
    ref_store = store.clone()
    args = [t.to(DEVICE) for t in (ids, pos.int(), slots.int(), table)]
    out = engram_hash(hasher, *args, store.to(DEVICE))
    ref = engram_hash_ref(hasher, *args, ref_store.to(DEVICE))
    assert out.shape == (8, 2, 3 * 3)
    assert torch.equal(out, ref)
    assert not torch.equal(out[4], out[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pending", [False, True])
def test_engram_gate(fresh_seed: int, dtype: torch.dtype, pending: bool) -> None:
    g = gen(fresh_seed)
    cfg = _cfg()
    eng = Engram(cfg, rows=64, dtype=dtype)
    with torch.no_grad():
        eng.q_weight.copy_(torch.rand(eng.q_weight.shape, generator=g) + 0.5)
        eng.k_weight.copy_(torch.randn(eng.k_weight.shape, generator=g))
    t, hc, d = 5, cfg.hc_mult, cfg.hidden_size
    streams = torch.randn(t, hc, d, generator=g).to(dtype).to(DEVICE)
    kv = torch.randn(t, (hc + 1) * d, generator=g).to(dtype).to(DEVICE)
    prev = None
    if pending:
        prev = (torch.randn(t, d, generator=g).to(dtype).to(DEVICE), torch.rand(t, hc, generator=g).to(DEVICE),
                torch.rand(t, hc, hc, generator=g).to(DEVICE))
    eng = eng.to(DEVICE)
    with torch.no_grad():
        out, ref = engram_gate(eng, streams, kv, prev), engram_gate_ref(eng, streams, kv, prev)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, scale=2.0)
