"""draft_block_attention (DSpark's block attention + inverse RoPE in one launch) vs the
stages' torch block attention followed by the inverse norm_rope (interpreter on CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer.models.v4.dspark import NO_POSITION  # noqa: E402
from deepinfer_kernels.draft_block_attention import draft_block_attention, draft_block_attention_ref  # noqa: E402


def _inputs(seed: int, r: int, block: int, h: int, d: int, ctx: int, window: int, dtype: torch.dtype):
    """R blocks at fresh positions; block 0 near the sequence start (padded context rows)."""
    g = gen(seed)
    last = torch.randint(window, 4 * window, (r,), generator=g)
    last[0] = 3  # only 4 real context rows: the rest are padding
    pos = (last[:, None] + 1 + torch.arange(block)).reshape(-1)
    ctx_pos = last[:, None] + (2 - window) + torch.arange(ctx)[None, :]
    ctx_pos = torch.where(ctx_pos >= 0, ctx_pos, torch.full_like(ctx_pos, NO_POSITION))
    q = torch.randn(r * block, h, d, generator=g).to(dtype)
    kv = torch.randn(r * block, d, generator=g).to(dtype)
    ctx_kv = torch.randn(r, ctx, d, generator=g).to(dtype)
    sink = torch.randn(h, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    return [t.to(DEVICE) for t in (q, kv, pos, ctx_kv, ctx_pos, sink, inv_freq)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r,block,h,d,ctx,window", [(3, 5, 8, 64, 31, 32), (2, 4, 20, 64, 47, 48),
                                                     (1, 16, 16, 64, 15, 16), (2, 5, 4, 128, 31, 32)])
def test_matches_the_reference(fresh_seed: int, dtype, r, block, h, d, ctx, window) -> None:
    """Partial context tiles, heads over two programs, a 16-row block, padded context rows,
    a wider head."""
    q, kv, pos, ctx_kv, ctx_pos, sink, inv_freq = _inputs(fresh_seed, r, block, h, d, ctx, window, dtype)
    out = draft_block_attention(q, kv, pos, block, ctx_kv, ctx_pos, window, sink, inv_freq, block_n=16)
    ref = draft_block_attention_ref(q, kv, pos, block, ctx_kv, ctx_pos, window, sink, inv_freq)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref, dtype, scale=2.0)


def test_window_hides_old_context_rows(fresh_seed: int) -> None:
    """Context rows at or before pos - window change nothing; a visible one does."""
    q, kv, pos, ctx_kv, ctx_pos, sink, inv_freq = _inputs(fresh_seed, 2, 5, 8, 64, 31, 32, torch.float32)
    base = draft_block_attention(q, kv, pos, 5, ctx_kv, ctx_pos, 32, sink, inv_freq)
    hidden = ctx_kv.clone()
    hidden[1, 0] += 5.0  # row 0 of block 1 sits at last - 29: outside the last rows' windows only
    moved = draft_block_attention(q, kv, pos, 5, hidden, ctx_pos, 32, sink, inv_freq)
    first_row_sees = int(ctx_pos[1, 0]) > int(pos[5]) - 32
    last_row_sees = int(ctx_pos[1, 0]) > int(pos[9]) - 32
    assert first_row_sees and not last_row_sees
    assert torch.equal(moved[:5], base[:5])  # block 0 never reads block 1's context
    assert not torch.equal(moved[5], base[5]) and torch.equal(moved[9], base[9])


def test_rejects_bad_shapes() -> None:
    q, kv, pos, ctx_kv, ctx_pos, sink, inv_freq = _inputs(0, 2, 5, 8, 64, 31, 32, torch.float32)
    with pytest.raises(ValueError, match="whole blocks"):
        draft_block_attention(q, kv, pos, 3, ctx_kv, ctx_pos, 32, sink, inv_freq)
    with pytest.raises(ValueError, match="ctx_kv"):
        draft_block_attention(q, kv, pos, 5, ctx_kv[:1], ctx_pos[:1], 32, sink, inv_freq)
    with pytest.raises(ValueError, match="attn_sink"):
        draft_block_attention(q, kv, pos, 5, ctx_kv, ctx_pos, 32, sink[:4], inv_freq)
