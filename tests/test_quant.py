"""Tests for deepinfer.models.quant (fast, CPU)."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepinfer.models.quant import (  # noqa: E402
    E2M1_VALUES, dequantize_fp4, dequantize_fp8_block, e8m0_to_float, float_to_e8m0,
    infer_block_size, pack_e2m1, quantize_fp4, quantize_fp8_block, unpack_e2m1,
)


# ---------------------------------------------------------------- E8M0
def test_e8m0_hand_values():
    b = torch.tensor([127, 130, 120, 0, 1, 254, 255], dtype=torch.uint8)
    f = e8m0_to_float(b)
    assert f.dtype == torch.float32
    assert f[:6].tolist() == [1.0, 8.0, 2.0 ** -7, 2.0 ** -127, 2.0 ** -126, 2.0 ** 127]
    assert math.isnan(f[6].item())


def test_e8m0_all_bytes_and_roundtrip():
    b = torch.arange(255, dtype=torch.uint8)
    f = e8m0_to_float(b)
    assert torch.equal(f, torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float32))
    assert torch.equal(float_to_e8m0(f), b)
    assert torch.equal(float_to_e8m0(f, rounding="floor"), b)


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="no float8_e8m0fnu")
def test_e8m0_fnu_dtype_accepted():
    b = torch.tensor([127, 130, 0], dtype=torch.uint8)
    assert torch.equal(e8m0_to_float(b.view(torch.float8_e8m0fnu)), e8m0_to_float(b))


def test_float_to_e8m0_rounding_and_clamp():
    x = torch.tensor([1.0, 1.5, 3.0, 0.3, 2.0 ** -7, 1e-45, 2.0 ** -127, 3e38])
    assert float_to_e8m0(x).tolist() == [127, 128, 129, 126, 120, 0, 0, 254]
    assert float_to_e8m0(x, rounding="floor").tolist() == [127, 127, 128, 125, 120, 0, 0, 254]
    # ceil never undershoots (except the top clamp)
    r = torch.rand(1000) * 100 + 1e-3
    s = e8m0_to_float(float_to_e8m0(r))
    assert bool((s >= r).all()) and bool((s < 2 * r).all())


def test_float_scales_used_as_is():
    f = torch.tensor([0.25, 8.0])
    assert torch.equal(e8m0_to_float(f), f)


# ---------------------------------------------------------------- e2m1 packing
def test_e2m1_values_table():
    assert E2M1_VALUES.tolist()[:8] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert E2M1_VALUES.tolist()[8:] == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def test_unpack_hand_values():
    packed = torch.tensor([[0x21, 0xA7 - 256, 0x9F - 256]], dtype=torch.int8)
    codes = unpack_e2m1(packed)
    # 0x21: even=1 (0.5), odd=2 (1.0); 0xA7: even=7 (6), odd=0xA (-1.0); 0x9F: even=-6, odd=-0.5
    assert codes.tolist() == [[1, 2, 7, 10, 15, 9]]
    assert E2M1_VALUES[codes.long()].tolist() == [[0.5, 1.0, 6.0, -1.0, -6.0, -0.5]]
    assert torch.equal(pack_e2m1(codes), packed)
    scale = torch.tensor([[127]], dtype=torch.uint8)  # group 6 for this tiny row
    assert dequantize_fp4(packed, scale, group=6).tolist() == [[0.5, 1.0, 6.0, -1.0, -6.0, -0.5]]


def test_pack_unpack_roundtrip():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    p = pack_e2m1(codes)
    assert p.dtype == torch.int8 and p.shape == (3, 5, 32)
    assert torch.equal(unpack_e2m1(p), codes)


# ---------------------------------------------------------------- FP4
def test_fp4_rounding_ties_to_even():
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.1, 0.26, 5.1] + [0.0] * 20])
    packed, scale = quantize_fp4(x)
    assert scale.tolist() == [[127]]
    assert dequantize_fp4(packed, scale)[0, :12].tolist() == [
        6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 0.0, 0.5, 6.0]
    assert unpack_e2m1(packed)[0, 9].item() == 0  # small negatives round to +0


def test_fp4_exact_roundtrip_on_grid():
    g = torch.Generator().manual_seed(0)
    out, inn = 16, 128
    codes = torch.randint(0, 16, (out, inn), generator=g, dtype=torch.uint8)
    codes[codes == 8] = 0  # -0 would re-encode as +0
    codes[:, ::32] = 7 + 8 * (torch.arange(out) % 2).to(torch.uint8)[:, None]  # |6| in every group
    scale = torch.randint(100, 160, (out, inn // 32), generator=g, dtype=torch.uint8)
    packed = pack_e2m1(codes)
    w = dequantize_fp4(packed, scale)
    ref = E2M1_VALUES[codes.long()] * (2.0 ** (scale.double() - 127)).float().repeat_interleave(32, 1)
    assert torch.equal(w, ref)
    p2, s2 = quantize_fp4(w)
    assert torch.equal(p2, packed) and torch.equal(s2, scale)
    # without a 6 in each group the scale may shrink but the values still round-trip exactly
    w3 = w * (torch.rand(out, inn, generator=g) < 0.5)
    assert torch.equal(dequantize_fp4(*quantize_fp4(w3)), w3)


def test_fp4_float_scale_and_batched():
    w = torch.randn(2, 8, 64)
    packed, scale = quantize_fp4(w)
    assert packed.shape == (2, 8, 32) and scale.shape == (2, 8, 2)
    d = dequantize_fp4(packed, scale, dtype=torch.bfloat16)
    assert d.dtype == torch.bfloat16
    assert torch.equal(dequantize_fp4(packed, e8m0_to_float(scale)), dequantize_fp4(packed, scale))
    # error <= half the widest grid gap (1.0 between 4 and 6) times the scale
    err = (dequantize_fp4(packed, scale) - w).abs()
    assert bool((err <= e8m0_to_float(scale).repeat_interleave(32, -1)).all())


# ---------------------------------------------------------------- FP8
@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_fp8_block_roundtrip(block):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 2, 200)  # varied block ranges
    q, s = quantize_fp8_block(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300, 200)
    assert s.dtype == torch.uint8 and s.shape == (math.ceil(300 / block[0]), math.ceil(200 / block[1]))
    d = dequantize_fp8_block(q, s, block)
    sf = e8m0_to_float(s).repeat_interleave(block[0], 0)[:300].repeat_interleave(block[1], 1)[:, :200]
    # Sound bound: w/scale is exact (pow2 scale) and |w/scale| <= 448 (no saturation). e4m3
    # round-to-nearest has relative error <= 2^-4 (3 mantissa bits) in the normal range
    # (|q| >= 2^-6), and absolute error <= half the subnormal step 2^-9 / 2 = 2^-10 below it.
    assert bool(((d - w).abs() <= torch.maximum(w.abs() * 2 ** -4, sf * 2 ** -10)).all())
    # the scale is the pow2 ceil of amax/448: amax/448 <= scale < 2 * amax/448
    amax = torch.nn.functional.pad(w.abs(), (0, -200 % block[1], 0, -300 % block[0]))
    amax = amax.view(s.shape[0], block[0], s.shape[1], block[1]).amax(dim=(1, 3))
    sc = e8m0_to_float(s)
    assert bool((sc >= amax / 448).all()) and bool((sc < 2 * amax / 448).all())
    # re-quantizing the dequantized weight reproduces it exactly (the scale may halve when the
    # block max rounded down to 224, but doubled e4m3 values stay representable)
    assert torch.equal(dequantize_fp8_block(*quantize_fp8_block(d, block), block), d)
    # float32 pow2 scales and an inferred block give the same result
    assert torch.equal(dequantize_fp8_block(q, e8m0_to_float(s), block), d)
    assert torch.equal(dequantize_fp8_block(q, s, None), d)


def test_fp8_hand_values_and_zero_block():
    w = torch.zeros(40, 40)
    w[0, 0], w[0, 39], w[39, 0] = 448.0 * 4, -3.0, 1.0
    q, s = quantize_fp8_block(w, (32, 32))
    # 1792/448 = 4 -> 2^2; 3/448 -> 2^-7; 1/448 -> 2^-8; all-zero block -> 1.0
    assert s.tolist() == [[129, 120], [119, 127]]
    d = dequantize_fp8_block(q, s, (32, 32), dtype=torch.float64)
    assert d.dtype == torch.float64 and torch.equal(d, w.double())


def test_infer_block_size():
    assert infer_block_size((300, 200), (3, 2)) == (128, 128)
    assert infer_block_size((300, 200), (10, 7)) == (32, 32)
    assert infer_block_size((7168, 1536), (56, 12)) == (128, 128)
    with pytest.raises(ValueError, match=r"\(300, 200\).*\(4, 2\)"):
        infer_block_size((300, 200), (4, 2))


# ---------------------------------------------------------------- errors
def test_errors_name_argument():
    q, s = quantize_fp8_block(torch.randn(300, 200))
    with pytest.raises(ValueError, match=r"scale: expected shape \(3, 2\)"):
        dequantize_fp8_block(q, s[:2])
    with pytest.raises(ValueError, match="weight:.*float8_e4m3fn"):
        dequantize_fp8_block(q.float(), s)
    with pytest.raises(ValueError, match="scale: expected dtype"):
        dequantize_fp8_block(q, s.to(torch.int32))
    with pytest.raises(ValueError, match=r"w: last dimension \(in=33\)"):
        quantize_fp4(torch.randn(4, 33))
    p, sc = quantize_fp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"scale: expected shape \(4, 2\)"):
        dequantize_fp4(p, sc[:, :1])
    with pytest.raises(ValueError, match="packed:"):
        dequantize_fp4(p.float(), sc)
    with pytest.raises(ValueError, match="codes:.*even"):
        pack_e2m1(torch.zeros(3, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"codes:.*\[0, 15\]"):
        pack_e2m1(torch.full((2,), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="x:.*> 0"):
        float_to_e8m0(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="x:"):
        float_to_e8m0(torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="rounding"):
        float_to_e8m0(torch.tensor([1.0]), rounding="nearest")
    with pytest.raises(ValueError, match="w:"):
        quantize_fp8_block(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="block"):
        quantize_fp8_block(torch.randn(4, 4), (0, 32))
