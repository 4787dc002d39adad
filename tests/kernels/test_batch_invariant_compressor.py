"""pool_windows (deepinfer_kernels/batch_invariant_compressor.py), interpreted, on fresh
random inputs: equals its torch reference within the dtype's tolerance, writes only the
windows with a destination, a window's entry is bitwise the same whatever other windows
share the launch, and it re-pools exactly what compressor_decode writes for a closing row."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer_kernels.batch_invariant_compressor import pool_windows, pool_windows_ref  # noqa: E402

D, HALF = 16, 4


def _inputs(gen: torch.Generator, n_win: int, ratio: int, overlap: bool, n_src: int = 40):
    c = (2 if overlap else 1) * D
    nwin = (2 if overlap else 1) * ratio
    src = torch.randn(n_src, 2, c, generator=gen)
    src[:, 0] = src[:, 0].bfloat16().float()  # kv as the ring holds it: float32 of activations
    idx = torch.randint(0, n_src, (n_win, nwin), generator=gen)
    if overlap:
        idx[0, :ratio] = -1  # window 0 has no previous window
    win_pos = torch.randint(0, 500, (n_win,), generator=gen) * ratio
    dest = torch.randperm(3 * n_win, generator=gen)[:n_win]
    dest[n_win // 2] = -1
    norm_w = 1 + 0.1 * torch.randn(D, generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(HALF).float() / HALF))
    return src, idx, win_pos, dest, norm_w, inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_matches_reference_and_skips(dtype, ratio, overlap):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    src, idx, win_pos, dest, norm_w, inv_freq = _inputs(gen, 9, ratio, overlap)
    out = torch.full((3 * 9, D), 7.0, dtype=dtype)
    ref = out.clone()
    pool_windows(src, idx, win_pos, dest, out, norm_w, 1e-6, inv_freq, ratio, overlap, dtype)
    pool_windows_ref(src, idx, win_pos, dest, ref, norm_w, 1e-6, inv_freq, ratio, overlap, dtype)
    untouched = torch.ones(3 * 9, dtype=torch.bool)
    untouched[dest[dest >= 0]] = False
    assert (out[untouched] == 7.0).all() and (ref[untouched] == 7.0).all()
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def test_window_independent_of_launch():
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    src, idx, win_pos, dest, norm_w, inv_freq = _inputs(gen, 12, 4, True)
    dest = torch.arange(12)
    full = torch.zeros(12, D, dtype=torch.bfloat16)
    pool_windows(src, idx, win_pos, dest, full, norm_w, 1e-6, inv_freq, 4, True, torch.bfloat16)
    for i in (0, 5, 11):
        alone = torch.zeros(12, D, dtype=torch.bfloat16)
        pool_windows(src, idx[i:i + 1], win_pos[i:i + 1], dest[i:i + 1], alone, norm_w, 1e-6, inv_freq, 4, True,
                     torch.bfloat16)
        assert torch.equal(alone[i], full[i])


@pytest.mark.parametrize("overlap", [True, False])
def test_repools_compressor_decode(overlap):
    """compressor_decode on closing rows, then pool_windows from its ring with the decode
    plan (fast/invariant.py): the same entries, bitwise (the same arithmetic)."""
    from deepinfer.models.fast.invariant import decode_pool_plan
    from deepinfer_kernels.compressor_decode import compressor_decode

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    ratio, ring_len, slots, per_block, bs = 4, 8, 4, 8, 32
    c = (2 if overlap else 1) * D
    ring = torch.randn(slots, ring_len, 2, c, generator=gen)
    ring[:, :, 0] = ring[:, :, 0].bfloat16().float()
    positions = torch.tensor([3, 7, 10, 11], dtype=torch.int32)  # three close a window
    row_slots = torch.arange(4, dtype=torch.int32)
    kv = torch.randn(4, c, generator=gen).bfloat16()
    score = torch.randn(4, c, generator=gen).bfloat16()
    ape = torch.randn(ratio, c, generator=gen)
    table = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 0]], dtype=torch.int32)
    entries = torch.zeros(8, per_block, D, dtype=torch.bfloat16)
    tail = torch.zeros(8, ratio, 2, D) if overlap else None
    norm_w = 1 + 0.1 * torch.randn(D, generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(HALF).float() / HALF))
    compressor_decode(kv, score, ape, positions, row_slots, ring, entries, table, tail, norm_w, 1e-6, inv_freq,
                      ratio, overlap, bs)
    written = entries.clone()
    entries.zero_()
    idx, win_pos, dest = decode_pool_plan(positions, row_slots, table, ratio, overlap, ring_len, per_block)
    assert (dest >= 0).tolist() == [True, True, False, True]
    pool_windows(ring.view(-1, 2, c), idx, win_pos, dest, entries, norm_w, 1e-6, inv_freq, ratio, overlap,
                 torch.bfloat16)
    assert torch.equal(entries, written)
