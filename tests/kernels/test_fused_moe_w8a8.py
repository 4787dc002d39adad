"""fused_moe_w8a8 (FP8 experts x FP8 activations) against its torch reference, and against the
weight-only FP8 kernel (the same function up to the activations' e4m3 rounding)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import assert_close, rel_err  # noqa: E402
from test_fused_moe_quant import _fp8  # noqa: E402

from deepinfer_kernels.fused_moe_quant import fused_moe_fp8  # noqa: E402
from deepinfer_kernels.fused_moe_w8a8 import fused_moe_w8a8, fused_moe_w8a8_ref  # noqa: E402

# interpreter tiles (w8a8_config): BLOCK_M 16, BLOCK_K 32, down tile 32; block (16, 32)
# puts two N scale blocks in a down tile, (32, 64) a 64-wide gate/up tile and two K steps
# per scale group, (64, 64) also two down tiles per N scale block.
CASES = [
    (9, 64, 64, 5, 3, (32, 32)),
    (11, 96, 64, 6, 2, (16, 32)),
    (7, 128, 64, 4, 2, (32, 64)),
    (6, 128, 128, 3, 2, (64, 64)),
]


@pytest.mark.parametrize("t,h,inter,e,k,block", CASES)
def test_w8a8_matches_reference(fresh_seed: int, t, h, inter, e, k, block) -> None:
    x, q, tw, ids, _ = _fp8(fresh_seed, t, h, inter, e, k, block)
    out = fused_moe_w8a8(x, *q, block, tw, ids, 1.0)
    assert out.dtype == x.dtype and out.shape == x.shape
    ref = fused_moe_w8a8_ref(x, *q, block, tw, ids, 1.0)
    # float32 sums in another order flip a bf16 rounding now and then, and a flipped
    # activation can move one e4m3 step: twice the bf16 tolerance
    assert_close(out, ref, torch.bfloat16, scale=2.0)


def test_w8a8_is_the_fp8_moe_up_to_activation_rounding(fresh_seed: int) -> None:
    """The same experts as the weight-only kernel: e4m3 activations (3 mantissa bits) cost
    a few percent of the output norm, not more (a wrong scale or expert would be ~100%).
    Over 300 seeds the error is 4.7% +- 0.5% (max 6.6%): 9% sits ~8 sigma out."""
    x, q, tw, ids, _ = _fp8(fresh_seed, 12, 128, 64, 6, 3, (32, 32))
    w8a8 = fused_moe_w8a8(x, *q, (32, 32), tw, ids, 10.0)
    w8a16 = fused_moe_fp8(x, *q, (32, 32), tw, ids, 10.0)
    err = rel_err(w8a8, w8a16)
    assert 1e-4 < err < 0.09, f"w8a8 vs w8a16 relative error {err:.3e}"


def test_remote_experts_add_nothing(fresh_seed: int) -> None:
    x, q, tw, ids, _ = _fp8(fresh_seed, 10, 64, 32, 6, 3, (32, 32))
    ids[::2, 1] = -1
    out = fused_moe_w8a8(x, *q, (32, 32), tw, ids, 10.0)
    assert_close(out, fused_moe_w8a8_ref(x, *q, (32, 32), tw, ids, 10.0), torch.bfloat16, scale=2.0)
    assert torch.equal(fused_moe_w8a8(x, *q, (32, 32), tw, torch.full_like(ids, -1), 10.0), torch.zeros_like(x))


def test_rows_do_not_depend_on_the_batch(fresh_seed: int) -> None:
    """A token's output is the same alone or among others (per-token activation scales,
    fixed K order, fixed-order combine)."""
    x, q, tw, ids, _ = _fp8(fresh_seed, 8, 64, 64, 4, 2, (32, 32))
    full = fused_moe_w8a8(x, *q, (32, 32), tw, ids, 10.0)
    one = fused_moe_w8a8(x[3:4].contiguous(), *q, (32, 32), tw[3:4], ids[3:4], 10.0)
    assert torch.equal(full[3:4], one)


def test_bad_inputs_name_the_argument(fresh_seed: int) -> None:
    x, q, tw, ids, _ = _fp8(fresh_seed, 4, 48, 32, 3, 2, (32, 32))
    with pytest.raises(ValueError, match="block"):  # H = 48 is not a multiple of 32
        fused_moe_w8a8(x, *q, (32, 32), tw, ids, 1.0)
    x, q, tw, ids, _ = _fp8(fresh_seed, 4, 64, 32, 3, 2, (32, 32))
    with pytest.raises(ValueError, match="BLOCK_K"):
        fused_moe_w8a8(x, *q, (32, 32), tw, ids, 1.0, config=dict(BLOCK_M=16, BLOCK_K=64, DOWN_N=32))
    with pytest.raises(ValueError, match="s2"):
        fused_moe_w8a8(x, *q[:5], q[5][:, :1], (32, 32), tw, ids, 1.0)
    x, q, tw, ids, _ = _fp8(fresh_seed, 4, 64, 32, 3, 2, (32, 16))
    with pytest.raises(ValueError, match="K >= 32"):  # 16-column groups: no e4m3 dot that narrow
        fused_moe_w8a8(x, *q, (32, 16), tw, ids, 1.0)
