"""FP8 w8a8 block-scaled GEMM (kernels/fp8_act_quant.py, kernels/fp8_gemm.py) against
their torch references and the dequantized weight, in Triton's CPU interpreter on tiny
shapes; and the Linear dispatch that routes a checkpoint's FP8 linears to them."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from deepinfer.errors import ConfigError  # noqa: E402
from deepinfer.models.linear import GroupedLinear, Linear, QuantizedWeight  # noqa: E402
from deepinfer.models.quant import dequantize_fp8_block, e8m0_to_float, quantize_fp8_block  # noqa: E402
from deepinfer_kernels.fp8_act_quant import act_quant, act_quant_ref  # noqa: E402
from deepinfer_kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref, fp8_linear, fp8_linear_ref  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("shape,group", [((5, 200), 128), ((3, 96), 32), ((4, 256), 128)])
def test_act_quant_matches_reference_exactly(fresh_seed, shape, group):
    g = torch.Generator().manual_seed(fresh_seed)
    # rows of very different magnitudes, a zero group and a partial trailing group
    x = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 40).to(torch.bfloat16)
    x[0, :group] = 0
    q, s = act_quant(x.to(DEVICE), group)
    q_ref, s_ref = act_quant_ref(x, group)
    assert torch.equal(s.cpu(), s_ref), "scales are powers of two computed from the bits: exact"
    assert torch.equal(q.cpu().float(), q_ref.float()), "e4m3 rounding is nearest-even, as torch's cast"
    # every scale is a power of two and q * scale reconstructs x within e4m3's 2^-4 relative
    # step, or half its smallest subnormal step (2^-10 x scale) for values far below the
    # group's maximum
    assert torch.equal(torch.frexp(s_ref).mantissa, torch.full_like(s_ref, 0.5))
    scale = s_ref.repeat_interleave(group, 1)[:, :shape[1]]
    back = q_ref.float() * scale
    assert ((back - x.float()).abs() <= x.float().abs() / 16 + scale * 2.0 ** -10).all()


@pytest.mark.parametrize("m,n,k,block,groups", [
    (5, 96, 200, (128, 128), 1),   # partial K and N blocks
    (9, 64, 96, (32, 32), 1),      # V4.1's 32x32 blocks
    (4, 128, 160, (32, 32), 2),    # grouped (wo_a)
    (3, 512, 128, (128, 128), 2),
])
@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float32])
def test_fp8_gemm_matches_reference(fresh_seed, m, n, k, block, groups, scale_dtype):
    g = torch.Generator().manual_seed(fresh_seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w_q, w_s = quantize_fp8_block(w, block)
    if scale_dtype == torch.float32:  # some base checkpoints store float32 powers of two
        w_s = e8m0_to_float(w_s)
    x = torch.randn(m, groups, k, generator=g) if groups > 1 else torch.randn(m, k, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        a_q, a_s = act_quant_ref(xd.reshape(-1, k), block[1])
        a_q, a_s = a_q.view(m, -1), a_s.view(m, -1)
        out = fp8_gemm(a_q.to(DEVICE), a_s.to(DEVICE), w_q.to(DEVICE), w_s.to(DEVICE), block, dtype, groups).cpu()
        ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, block, dtype, groups)
        assert out.dtype == dtype and out.shape == (m, n)
        # e4m3 x e4m3 products are exact in float32; only the summation order differs (and on
        # an H200 the tensor cores' FP8 accumulation keeps fewer bits: 4e-5-8e-5 measured)
        assert _rel(out, ref) <= (4e-3 if dtype != torch.float32 else 1e-6 if DEVICE == "cpu" else 2e-4)
        lin = fp8_linear(xd.to(DEVICE), w_q.to(DEVICE), w_s.to(DEVICE), block, groups).cpu()
        assert _rel(lin, fp8_linear_ref(xd, w_q, w_s, block, groups)) <= \
            (4e-3 if dtype != torch.float32 else 1e-6 if DEVICE == "cpu" else 2e-4)
    # against the dense weight with unquantised activations: only the activations'
    # e4m3 rounding (<= 2^-4 per element, ~2.5% relative on random data) remains
    dense = dequantize_fp8_block(w_q, w_s, block).view(groups, -1, k)
    want = torch.einsum("mgk,gnk->mgn", x.view(m, groups, k), dense).reshape(m, -1)
    err = _rel(fp8_linear_ref(x, w_q, w_s, block, groups), want)
    assert 1e-3 < err < 4e-2, err


def _quantized_linear(lin: Linear, seed: int, block: tuple[int, int]) -> Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(lin.out_features, lin.in_features, generator=g) * 0.1
    data, scale = quantize_fp8_block(w, block)
    lin.weight.data.copy_(dequantize_fp8_block(data, scale, block))
    lin.quantized = QuantizedWeight("fp8", data, scale, block)
    return lin


CPU_INPUTS = pytest.mark.skipif(DEVICE == "cuda", reason="CPU inputs through the interpreted kernel")


@CPU_INPUTS
@pytest.mark.parametrize("grouped", [False, True])
def test_linear_dispatch_by_mode(fresh_seed, monkeypatch, grouped):
    lin = GroupedLinear(64, 2 * 32, 2) if grouped else Linear(96, 48)
    _quantized_linear(lin, fresh_seed, (32, 32))
    g = torch.Generator().manual_seed(fresh_seed + 1)
    x = torch.randn(7, 2, 64, generator=g) if grouped else torch.randn(7, 96, generator=g)
    outs = {}
    with torch.no_grad():
        for mode in ("auto", "dequant", "ref", "triton"):
            monkeypatch.setenv("DEEPINFER_FP8_GEMM", mode)
            outs[mode] = lin(x)
        monkeypatch.setenv("DEEPINFER_FP8_GEMM", "dense")
        with pytest.raises(ConfigError, match="DEEPINFER_FP8_GEMM='dense'.*auto, triton, ref, dequant"):
            lin(x)
    assert torch.equal(outs["auto"], outs["dequant"]), "CPU input + auto: the dequantized (reference) weight"
    assert _rel(outs["triton"], outs["ref"]) < 1e-6, "the kernel computes what its reference does"
    assert 1e-3 < _rel(outs["ref"], outs["dequant"]) < 4e-2, "w8a8: activations quantised"


def test_quantized_model_w8a8_close_to_dequantized(tmp_path, fresh_seed, monkeypatch):
    """A quantized tiny checkpoint: every FP8 linear through the w8a8 path (its torch
    reference; the interpreted kernel is checked above) against the dequantized weights."""
    from deepinfer.models.loader import load_model
    from deepinfer.models.standalone import StandaloneRunner
    from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

    write_tiny_checkpoint(str(tmp_path), seed=fresh_seed % 1000, quantize=True, cfg=tiny_config(vocab_size=256))
    model = load_model(str(tmp_path), dtype="float32")
    assert model.layers[0].attn.wq_b.quantized.fmt == "fp8"
    toks = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(fresh_seed)).tolist()
    logits = {}
    for mode in ("dequant", "ref"):
        monkeypatch.setenv("DEEPINFER_FP8_GEMM", mode)
        logits[mode] = StandaloneRunner(model, 1, 256).step([(0, toks)])[0]
    err = _rel(logits["ref"], logits["dequant"])
    # The activations' e4m3 rounding (16x coarser than bf16) carried through 4 random
    # layers: measured 0.19-0.26 (bf16 instead of float32 moves the same logits by ~0.035).
    assert 1e-3 < err < 0.4, err
    agree = (logits["ref"].argmax(-1) == logits["dequant"].argmax(-1)).float().mean()
    assert agree > 0.5, float(agree)  # measured 0.76


@CPU_INPUTS
def test_grouped_scale_blocks_straddling_groups(fresh_seed):
    """Groups of 16 rows inside 128-row scale blocks (tiny configs): the kernel refuses,
    fp8_linear still computes the same product."""
    g = torch.Generator().manual_seed(fresh_seed)
    w_q, w_s = quantize_fp8_block(torch.randn(32, 64, generator=g) * 0.1, (128, 128))
    x = torch.randn(3, 2, 64, generator=g)
    a_q, a_s = act_quant_ref(x.reshape(-1, 64), 128)
    with pytest.raises(ValueError, match="whole 128-row scale blocks"):
        fp8_gemm(a_q.view(3, -1), a_s.view(3, -1), w_q, w_s, (128, 128), torch.float32, 2)
    assert _rel(fp8_linear(x, w_q, w_s, (128, 128), 2), fp8_linear_ref(x, w_q, w_s, (128, 128), 2)) < 1e-6


def test_act_quant_column_major_scales(fresh_seed):
    """The layout cuBLAS reads: the same scales, stored [G, M] and viewed transposed."""
    g = torch.Generator().manual_seed(fresh_seed)
    x = (torch.randn(6, 96, generator=g) * 7).to(torch.bfloat16).to(DEVICE)
    q_row, s_row = act_quant(x, 32)
    q_col, s_col = act_quant(x, 32, col_major_scales=True)
    assert s_col.shape == (6, 3) and s_col.stride() == (1, 6)
    assert torch.equal(s_col, s_row) and torch.equal(q_col.float(), q_row.float())
    q_pad, s_pad = act_quant(x, 32, col_major_scales=True, pad_rows=16)  # cuBLAS's row multiple
    assert q_pad.shape == (16, 96) and s_pad.shape == (16, 3) and s_pad.stride() == (1, 16)
    assert torch.equal(q_pad[:6].float(), q_row.float()) and torch.equal(s_pad[:6], s_row)
    assert not q_pad[6:].float().any() and torch.equal(s_pad[6:].cpu(), torch.ones(10, 3))


def test_cublas_choice_and_weight_scales(monkeypatch):
    """cuBLAS's block-scaled GEMM only for ungrouped (128, 128)-block prefill-sized CUDA
    problems; the E8M0 bytes it gets are decoded to the same float32 powers of two."""
    import deepinfer_kernels.fp8_gemm as fg

    cuda = torch.device("cuda")
    assert fg.use_cublas(4096, 4096, 4096, (128, 128), 1, cuda) == (DEVICE == "cuda")  # the interpreter: never
    monkeypatch.setattr(fg, "interpreting", lambda: False)
    assert fg.use_cublas(4096, 4096, 4096, (128, 128), 1, cuda)
    assert fg.use_cublas(fg.CUBLAS_MIN_ROWS, fg.CUBLAS_MIN_N, 1024, (128, 128), 1, cuda)
    for args in ((64, 4096, 4096, (128, 128), 1, cuda),  # decode-sized
                 (4096, 512, 4096, (128, 128), 1, cuda),  # narrow output (slower there)
                 (4096, 4096, 4096, (32, 32), 1, cuda),  # V4.1 blocks
                 (4096, 8192, 4096, (128, 128), 8, cuda),  # grouped wo_a
                 (4096, 4096, 4096, (128, 128), 1, torch.device("cpu"))):
        assert not fg.use_cublas(*args), args
    _, w_s = quantize_fp8_block(torch.randn(300, 260) * torch.logspace(-6, 3, 260), (128, 128))
    assert torch.equal(fg._cached_scales_f32(w_s), e8m0_to_float(w_s).float())
    assert torch.equal(fg._cached_scales_f32(torch.tensor([[0, 127]], dtype=torch.uint8)),
                       torch.tensor([[2.0 ** -127, 1.0]]))


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="cuBLAS block-scaled FP8 needs an sm_90 GPU")
@pytest.mark.parametrize("rows", [2048, 2061])  # 2061: padded to cuBLAS's multiple of 16
def test_cublas_fp8_linear_matches_reference(fresh_seed, rows):
    import deepinfer_kernels.fp8_gemm as fg

    g = torch.Generator().manual_seed(fresh_seed)
    w_q, w_s = quantize_fp8_block(torch.randn(2048, 1024, generator=g) * 0.05, (128, 128))
    x = torch.randn(rows, 1024, generator=g).to(torch.bfloat16)
    assert fg.use_cublas(rows, 2048, 1024, (128, 128), 1, torch.device("cuda"))
    out = fp8_linear(x.cuda(), w_q.cuda(), w_s.cuda(), (128, 128)).cpu()
    assert out.shape == (rows, 2048)
    assert _rel(out, fp8_linear_ref(x, w_q, w_s, (128, 128))) <= 4e-3
