"""fused_moe (align + grouped GEMMs + combine) vs the model's routed MoE loop."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer_kernels.fused_moe import fused_moe, fused_moe_ref, stack_expert_weights  # noqa: E402
from deepinfer_kernels.moe_align import moe_align, moe_align_ref  # noqa: E402
from deepinfer_kernels.router import router  # noqa: E402


def _inputs(seed: int, t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype):
    g = gen(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w1 = (torch.randn(e, inter, h, generator=g) * h ** -0.5).to(dtype)
    w3 = (torch.randn(e, inter, h, generator=g) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) * inter ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, k, generator=g).to(dtype)
    return [a.to(DEVICE) for a in (x, w1, w3, w2, w, ids)]


@pytest.mark.parametrize("n_experts,block_m", [(8, 16), (5, 4), (40, 16)])
def test_moe_align(fresh_seed: int, n_experts: int, block_m: int) -> None:
    g = gen(fresh_seed)
    ids = torch.randint(-1, n_experts, (37, 3), generator=g).to(torch.int32).to(DEVICE)  # -1: not local
    got, ref = moe_align(ids, n_experts, block_m), moe_align_ref(ids, n_experts, block_m)
    assert torch.equal(got.expert_start, ref.expert_start)
    assert torch.equal(got.block_expert, ref.block_expert)
    assert torch.equal(got.sorted_ids, ref.sorted_ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,h,inter,e,k", [(20, 64, 32, 8, 2), (9, 48, 40, 5, 3)])
def test_fused_moe(fresh_seed: int, dtype: torch.dtype, t: int, h: int, inter: int, e: int, k: int) -> None:
    x, w1, w3, w2, w, ids = _inputs(fresh_seed, t, h, inter, e, k, dtype)
    limit = 1.0  # small, so the clip is exercised on random data
    out = fused_moe(x, w1, w3, w2, w, ids, limit)
    ref = fused_moe_ref(x, w1, w3, w2, w, ids, limit)
    assert out.dtype == dtype
    # both add the k slots in ascending expert id, rounding after each add
    assert_close(out, ref, dtype, scale=1.0 if dtype == torch.float32 else 1.5)


@pytest.mark.parametrize("t,h,inter,e,k", [(16, 128, 64, 8, 6), (7, 96, 48, 12, 4)])
def test_fused_moe_rounds_like_reference(fresh_seed: int, t: int, h: int, inter: int, e: int, k: int) -> None:
    """bf16: the kernel keeps every rounding point of the reference (g, u, silu, act, y,
    y * w, and out = round(out + y) per expert in ascending id, as index_add_ into a bf16
    output does), so only the float32 accumulation order of the GEMMs differs, which
    flips a bf16 rounding rarely. Summing the slots in float32 and rounding once (the
    kernel's old combine) changed ~45% of the outputs by an ulp or more (rel ~3.5e-3), in
    every row. One flipped intermediate (an element of g, u or act) moves up to its whole
    token's row of outputs (a fresh seed flipped 21 of one row's 96), so the rows with a
    difference are counted, not the outputs."""
    x, w1, w3, w2, w, ids = _inputs(fresh_seed, t, h, inter, e, k, torch.bfloat16)
    out = fused_moe(x, w1, w3, w2, w, ids, 1.0)
    ref = fused_moe_ref(x, w1, w3, w2, w, ids, 1.0)
    rows = int((out != ref).any(dim=1).sum())
    differ = (out != ref).double().mean().item()
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rows <= max(2, t // 4), f"{rows} of {t} token rows differ from the reference ({differ:.2%} of the outputs)"
    assert differ <= 0.10, f"{differ:.2%} of the outputs differ from the reference"
    assert rel <= 2.5e-3, f"relative error {rel:.2e}"  # two rows of 7 off by an ulp: ~1.7e-3


def test_fused_moe_skips_remote_experts(fresh_seed: int) -> None:
    """Slots whose expert id is -1 (another rank's expert) add nothing."""
    x, w1, w3, w2, w, ids = _inputs(fresh_seed, 12, 32, 32, 6, 3, torch.bfloat16)
    ids[::2, 1] = -1
    assert_close(fused_moe(x, w1, w3, w2, w, ids, 10.0), fused_moe_ref(x, w1, w3, w2, w, ids, 10.0),
                 torch.bfloat16, scale=1.5)


def test_fused_moe_with_model_module(fresh_seed: int) -> None:
    """End to end against deepinfer.models.moe.MoE (routed part): router kernel + fused MoE."""
    from deepinfer.models.moe import MoE

    torch.manual_seed(fresh_seed)
    moe = MoE(64, 32, 8, 2, 0, False, 100, "sqrtsoftplus", 1.5, True, 10.0, torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(20, 64).to(torch.bfloat16)
    input_ids = torch.randint(0, 100, (20,))
    with torch.no_grad():
        ref = moe(x, input_ids)
        logits = torch.nn.functional.linear(x, moe.gate.weight)
        w, ids = router(logits.to(DEVICE), moe.gate.bias.to(DEVICE), 2, 1.5)
        w1, w3, w2 = (a.to(DEVICE) for a in stack_expert_weights(moe))
        out = fused_moe(x.to(DEVICE), w1, w3, w2, w, ids, 10.0)
    assert_close(out.cpu(), ref, torch.bfloat16, scale=1.5)
