"""fused_moe_fp8 / fused_moe_fp4 (weights decoded in the kernel, w8a16 / w4a16) against their
torch references and against the bf16 fused_moe on the dequantized weights (same tiles)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, INTERPRET, assert_close, gen  # noqa: E402

from deepinfer.models.linear import QuantizedWeight  # noqa: E402
from deepinfer.models.quant import (dequantize_fp4, dequantize_fp8_block, e8m0_to_float, quantize_fp4,  # noqa: E402
                                    quantize_fp8_block)
from deepinfer_kernels.fused_moe import _config, fused_moe  # noqa: E402
from deepinfer_kernels.fused_moe_quant import (fused_moe_fp4, fused_moe_fp4_ref, fused_moe_fp8,  # noqa: E402
                                               fused_moe_fp8_ref, stack_quantized_experts)

CFG64 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1)


def _dense(g: torch.Generator, t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype):
    x = torch.randn(t, h, generator=g).to(dtype)
    # per-expert magnitudes spread over a few octaves, so the scales differ between blocks
    mag = 2.0 ** torch.randint(-3, 3, (e, 1, 1), generator=g).float()
    w1 = torch.randn(e, inter, h, generator=g) * h ** -0.5 * mag
    w3 = torch.randn(e, inter, h, generator=g) * h ** -0.5
    w2 = torch.randn(e, h, inter, generator=g) * inter ** -0.5 * mag
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    tw = (torch.rand(t, k, generator=g) + 0.1).to(dtype)
    return x, (w1, w3, w2), tw, ids


def _fp8(seed: int, t: int, h: int, inter: int, e: int, k: int, block, dtype=torch.bfloat16):
    """(x, [w1, w3, w2, s1, s3, s2], topk weights, ids, dequantized [w1, w3, w2]) on DEVICE."""
    x, dense, tw, ids = _dense(gen(seed), t, h, inter, e, k, dtype)
    qs = [[quantize_fp8_block(w[i], block) for i in range(e)] for w in dense]
    quant = [torch.stack([q for q, _ in per]) for per in qs] + [torch.stack([s for _, s in per]) for per in qs]
    deq = [torch.stack([dequantize_fp8_block(q, s, block, dtype=dtype) for q, s in per]) for per in qs]
    mv = lambda ts: [a.to(DEVICE) for a in ts]  # noqa: E731
    return x.to(DEVICE), mv(quant), tw.to(DEVICE), ids.to(DEVICE), mv(deq)


def _fp4(seed: int, t: int, h: int, inter: int, e: int, k: int, group: int, dtype=torch.bfloat16):
    x, dense, tw, ids = _dense(gen(seed), t, h, inter, e, k, dtype)
    qs = [quantize_fp4(w, group) for w in dense]
    quant = [q for q, _ in qs] + [s for _, s in qs]
    deq = [dequantize_fp4(q, s, group, dtype=dtype) for q, s in qs]
    mv = lambda ts: [a.to(DEVICE) for a in ts]  # noqa: E731
    return x.to(DEVICE), mv(quant), tw.to(DEVICE), ids.to(DEVICE), mv(deq)


def _same_as_bf16_kernel(out: torch.Tensor, base: torch.Tensor) -> None:
    """Decoded tiles equal the dequantized weight, so only the float32 accumulation order can
    differ (FP4's two half dots; the GPU's MMA path): a bf16 rounding flips rarely (the
    interpreter: bit for bit; an H200: <= 0.6% of the outputs at the mini / flash widths)."""
    rel = ((out.double() - base.double()).norm() / base.double().norm()).item()
    if out.dtype == torch.float32:  # every order change shows in float32's last bits
        assert rel <= 1e-5, f"relative error {rel:.2e} against fused_moe on the dequantized weights"
        return
    differ = (out != base).double().mean().item()
    assert differ <= 0.01, f"{differ:.2%} of the outputs differ from fused_moe on the dequantized weights"
    assert rel <= 1e-3, f"relative error {rel:.2e} against fused_moe on the dequantized weights"


# interpreter tiles are 16 x 32 x 32 (fused_moe._config): (16, 16) blocks put two scale
# blocks in a K tile and two in an N tile; (64, 64) spans two K tiles; (24, 40) aligns with
# nothing (one scale per element); H / I not multiples of 32 leave K and N tails.
@pytest.mark.parametrize("t,h,inter,e,k,block,dtype", [
    (9, 80, 48, 5, 3, (16, 16), torch.bfloat16),
    (7, 128, 64, 4, 2, (64, 64), torch.bfloat16),
    (6, 72, 40, 4, 2, (24, 40), torch.bfloat16),
    (5, 160, 96, 3, 2, (128, 128), torch.bfloat16),
    (6, 80, 48, 4, 2, (32, 16), torch.float32),
])
def test_fused_moe_fp8(fresh_seed: int, t, h, inter, e, k, block, dtype) -> None:
    x, q, tw, ids, deq = _fp8(fresh_seed, t, h, inter, e, k, block, dtype)
    out = fused_moe_fp8(x, *q, block, tw, ids, 1.0)
    assert out.dtype == dtype and out.shape == x.shape
    # float32 on a GPU: tl.dot runs TF32 (as fused_moe's does), the reference full float32
    scale = 1.5 if dtype == torch.bfloat16 else 1.0 if INTERPRET else 200.0
    assert_close(out, fused_moe_fp8_ref(x, *q, block, tw, ids, 1.0), dtype, scale=scale)
    _same_as_bf16_kernel(out, fused_moe(x, *deq, tw, ids, 1.0, config=_config(t * k, e)))


# group 32 = the tile's K (one scale per row and tile), 16 (two groups a tile, with a K tail),
# 48 (unaligned), 64 and 128 (a group spans two / four tiles); CFG64: BLOCK_K 64 (two groups a
# tile, K and N tails).
@pytest.mark.parametrize("t,h,inter,e,k,group,config", [
    (9, 96, 64, 5, 3, 32, None),
    (8, 80, 48, 4, 2, 16, None),
    (6, 96, 48, 4, 2, 48, None),
    (7, 128, 64, 3, 2, 64, None),
    (6, 96, 160, 4, 2, 32, CFG64),
    (5, 128, 128, 3, 2, 128, None),
])
def test_fused_moe_fp4(fresh_seed: int, t, h, inter, e, k, group, config) -> None:
    x, q, tw, ids, deq = _fp4(fresh_seed, t, h, inter, e, k, group)
    out = fused_moe_fp4(x, *q, tw, ids, 1.0, group=group, config=config)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, fused_moe_fp4_ref(x, *q, tw, ids, 1.0, group=group), torch.bfloat16, scale=1.5)
    _same_as_bf16_kernel(out, fused_moe(x, *deq, tw, ids, 1.0, config=config or _config(t * k, e)))


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_remote_experts_add_nothing(fresh_seed: int, fmt: str) -> None:
    """Slots with expert id -1 (another rank's expert) add nothing; all remote: zeros."""
    if fmt == "fp8":
        x, q, tw, ids, deq = _fp8(fresh_seed, 10, 64, 32, 6, 3, (32, 32))
        run, ref = (lambda i: fused_moe_fp8(x, *q, (32, 32), tw, i, 10.0)), \
            (lambda i: fused_moe_fp8_ref(x, *q, (32, 32), tw, i, 10.0))
    else:
        x, q, tw, ids, deq = _fp4(fresh_seed, 10, 64, 32, 6, 3, 32)
        run, ref = (lambda i: fused_moe_fp4(x, *q, tw, i, 10.0)), (lambda i: fused_moe_fp4_ref(x, *q, tw, i, 10.0))
    ids[::2, 1] = -1
    out = run(ids)
    assert_close(out, ref(ids), torch.bfloat16, scale=1.5)
    assert torch.equal(out, fused_moe(x, *deq, tw, ids, 10.0))
    # the same rows with the remote slots given weight 0 on a local expert: identical sums
    local_ids, local_w = ids.clone(), tw.clone()
    for r in range(0, ids.shape[0], 2):
        local_ids[r, 1] = next(i for i in range(6) if i not in ids[r].tolist())
        local_w[r, 1] = 0
    assert torch.equal(out, (fused_moe_fp8(x, *q, (32, 32), local_w, local_ids, 10.0) if fmt == "fp8"
                             else fused_moe_fp4(x, *q, local_w, local_ids, 10.0)))
    none = torch.full_like(ids, -1)
    assert torch.equal(run(none), torch.zeros_like(x))


def test_bad_inputs_name_the_argument(fresh_seed: int) -> None:
    x, q, tw, ids, deq = _fp8(fresh_seed, 4, 64, 32, 3, 2, (32, 32))
    w1, w3, w2, s1, s3, s2 = q
    cases = {
        "w1": lambda: fused_moe_fp8(x, deq[0], w3, w2, s1, s3, s2, (32, 32), tw, ids, 1.0),  # bf16 weight
        "s2": lambda: fused_moe_fp8(x, w1, w3, w2, s1, s3, s2[:, :1], (32, 32), tw, ids, 1.0),  # scale shape
        "s1": lambda: fused_moe_fp8(x, w1, w3, w2, s1, s3, s2, (16, 32), tw, ids, 1.0),  # block vs scales
        "s3": lambda: fused_moe_fp8(x, w1, w3, w2, s1, e8m0_to_float(s3) * 1.5, s2, (32, 32), tw, ids, 1.0),
        "x": lambda: fused_moe_fp8(x.half(), w1, w3, w2, s1, s3, s2, (32, 32), tw, ids, 1.0),
        "topk_weights": lambda: fused_moe_fp8(x, w1, w3, w2, s1, s3, s2, (32, 32), tw[:, :1], ids, 1.0),
        "topk_ids": lambda: fused_moe_fp8_ref(x, w1, w3, w2, s1, s3, s2, (32, 32), tw, ids.float(), 1.0),
    }
    for name, call in cases.items():
        with pytest.raises(ValueError, match=rf"^{name}:"):
            call()
    xf, qf, twf, idsf, _ = _fp4(fresh_seed, 4, 64, 32, 3, 2, 32)
    with pytest.raises(ValueError, match=r"^s1:"):  # scales of another group
        fused_moe_fp4(xf, *qf, twf, idsf, 1.0, group=16)
    with pytest.raises(ValueError, match=r"^w2:"):  # w2 as if unpacked
        fused_moe_fp4(xf, qf[0], qf[1], qf[0][:, :, :16].repeat(1, 2, 2), *qf[3:], twf, idsf, 1.0)
    with pytest.raises(ValueError, match=r"^x:"):  # H not a multiple of the group
        fused_moe_fp4(xf[:, :48], *qf, twf, idsf, 1.0)
    with pytest.raises(ValueError, match=r"^config:"):  # FP4 dots need BLOCK_K >= 32
        fused_moe_fp4(xf, *qf, twf, idsf, 1.0, config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16))
    # float32 power-of-two scales are accepted (encoded to E8M0): same result
    as_float = [e8m0_to_float(s) for s in (s1, s3, s2)]
    assert torch.equal(fused_moe_fp8(x, w1, w3, w2, *as_float, (32, 32), tw, ids, 1.0),
                       fused_moe_fp8(x, w1, w3, w2, s1, s3, s2, (32, 32), tw, ids, 1.0))


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_stack_quantized_experts(fresh_seed: int, fmt: str) -> None:
    """Per-expert QuantizedWeight lists (as Linear.quantized holds them) -> the kernels' stacks."""
    e = 4
    if fmt == "fp8":
        x, q, tw, ids, _ = _fp8(fresh_seed, 6, 64, 48, e, 2, (32, 32))
        per = [[QuantizedWeight("fp8", q[j][i], q[3 + j][i], (32, 32)) for i in range(e)] for j in range(3)]
        direct = fused_moe_fp8(x, *q, (32, 32), tw, ids, 1.0)
    else:
        x, q, tw, ids, _ = _fp4(fresh_seed, 6, 64, 64, e, 2, 32)
        per = [[QuantizedWeight("fp4", q[j][i], q[3 + j][i], (1, 32)) for i in range(e)] for j in range(3)]
        direct = fused_moe_fp4(x, *q, tw, ids, 1.0)
    experts = stack_quantized_experts(*per)
    assert experts.fmt == fmt and experts.s1.dtype == torch.uint8 and experts.w1.shape == q[0].shape
    assert torch.equal(experts(x, tw, ids, 1.0), direct)
    assert_close(experts(x, tw, ids, 1.0, ref=True), direct, torch.bfloat16, scale=1.5)
    with pytest.raises(ValueError, match=r"^w2:"):
        stack_quantized_experts(per[0], per[1], per[2][:-1] + [QuantizedWeight("fp8" if fmt == "fp4" else "fp4",
                                                                               q[2][0], q[5][0], (1, 32))])
