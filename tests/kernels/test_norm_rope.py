"""norm_rope kernel vs the model's norms + RoPE (interpreter on CPU, tiny shapes)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer_kernels.norm_rope import norm_rope, norm_rope_ref  # noqa: E402
from deepinfer.models.rope import default_inv_freq, yarn_inv_freq  # noqa: E402

FREQS = {"plain": default_inv_freq(16, 10000.0),
         "yarn": yarn_inv_freq(16, 160000.0, {"factor": 16, "original_max_position_embeddings": 65536})}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", ["none", "unweighted", "weighted"])
@pytest.mark.parametrize("inverse", [False, True])
def test_norm_rope(fresh_seed: int, dtype: torch.dtype, norm: str, inverse: bool) -> None:
    g = gen(fresh_seed)
    t, h, d = 5, 3, 64
    x = (torch.randn(t, h, d, generator=g) * 2 + 0.2).to(dtype).to(DEVICE)
    pos = torch.randint(0, 70000, (t,), generator=g).to(DEVICE)  # long contexts: large angles
    w = (torch.rand(d, generator=g) + 0.5).to(DEVICE) if norm == "weighted" else None
    freq = FREQS["yarn" if inverse else "plain"].to(DEVICE)
    out = norm_rope(x, pos, freq, norm, w, 1e-6, inverse)
    ref = norm_rope_ref(x, pos, freq, norm, w, 1e-6, inverse)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    assert torch.equal(out[..., :d - 16], ref[..., :d - 16]) or norm != "none", "nope channels pass through"


def test_norm_rope_float32_input_rounds_first(fresh_seed: int) -> None:
    """The attention output (float32) is rounded to bf16 before the inverse rotation."""
    g = gen(fresh_seed)
    x = torch.randn(4, 2, 32, generator=g).to(DEVICE)
    pos = torch.randint(0, 5000, (4,), generator=g).to(DEVICE)
    freq = FREQS["plain"].to(DEVICE)
    out = norm_rope(x, pos, freq, inverse=True, out_dtype=torch.bfloat16)
    ref = norm_rope_ref(x, pos, freq, inverse=True, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, torch.bfloat16)


def test_norm_rope_scatter_into_pool(fresh_seed: int) -> None:
    g = gen(fresh_seed)
    t, d, bs, n_blocks = 4, 32, 8, 14
    x = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEVICE)
    pos = torch.tensor([0, 7, 8, 21]).to(DEVICE)
    table = torch.randperm(n_blocks, generator=g)[:t * 3].view(t, 3).to(torch.int32).to(DEVICE)
    w = (torch.rand(d, generator=g) + 0.5).to(DEVICE)
    pool = torch.randn(n_blocks, bs, d, generator=g).to(torch.bfloat16).to(DEVICE)
    ref_pool = pool.clone()
    freq = FREQS["plain"].to(DEVICE)
    assert norm_rope(x, pos, freq, "weighted", w, 1e-6, pool=pool, table=table) is None
    norm_rope_ref(x, pos, freq, "weighted", w, 1e-6, pool=ref_pool, table=table)
    assert_close(pool.float(), ref_pool.float(), torch.bfloat16)
    assert (pool != ref_pool).float().mean() < 0.01  # equal but for rare last-ulp cos/sin differences


def test_norm_rope_rejects_bad_width() -> None:
    with pytest.raises(ValueError, match="head width 48"):
        norm_rope(torch.zeros(2, 48, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE),
                  FREQS["plain"].to(DEVICE))


@pytest.mark.parametrize("quant,block", [("none", 32), ("fp8", 32), ("fp4", 32), ("fp4_e4m3", 16)])
@pytest.mark.parametrize("ratio", [1, 2])
def test_norm_rope_group_entries_quantized(fresh_seed: int, quant: str, block: int, ratio: int) -> None:
    """V4.1's pooled entries: group p // ratio RoPE'd at its first position, rounded to the
    cache format, written only by the row that closes the group; other slots untouched."""
    g = gen(fresh_seed)
    t, d, bs, width = 6, 64, 4, 6
    x = (torch.randn(t, d, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    pos = torch.tensor([0, 1, 6, 9, 14, 23]).to(DEVICE)
    table = torch.randperm(t * width, generator=g).view(t, width).to(torch.int32).to(DEVICE)
    w = (torch.rand(d, generator=g) + 0.5).to(DEVICE)
    pool = torch.randn(t * width, bs, d, generator=g).to(torch.bfloat16).to(DEVICE)
    before, ref_pool = pool.clone(), pool.clone()
    freq = FREQS["yarn"].to(DEVICE)
    kw = dict(table=table, ratio=ratio, quant=quant, quant_block=block)
    assert norm_rope(x, pos, freq, "weighted", w, 1e-6, pool=pool, **kw) is None
    norm_rope_ref(x, pos, freq, "weighted", w, 1e-6, pool=ref_pool, **kw)
    assert_close(pool.float(), ref_pool.float(), torch.bfloat16)
    assert (pool != ref_pool).float().mean() < 0.01  # equal but for rare last-ulp cos/sin differences
    rows_written = int((pool != before).any(-1).sum())
    assert rows_written == int(((pos + 1) % ratio == 0).sum())  # only the closing rows write


def test_norm_rope_quantized_heads(fresh_seed: int) -> None:
    """The indexer query: every head RoPE'd and FP4-rounded per 32 channels, bitwise."""
    g = gen(fresh_seed)
    x = torch.randn(3, 4, 64, generator=g).to(torch.float32).to(DEVICE)
    pos = torch.randint(0, 300, (3,), generator=g).to(DEVICE)
    freq = FREQS["yarn"].to(DEVICE)
    out = norm_rope(x, pos, freq, quant="fp4", quant_block=32)
    ref = norm_rope_ref(x, pos, freq, quant="fp4", quant_block=32)
    assert (out != ref).float().mean() < 0.02
