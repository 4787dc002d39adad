"""DSpark's fused greedy block sampling (deepinfer_kernels/dspark_block.py) vs its torch
definition on fresh random blocks (interpreter on CPU): the same drafts, confidences within
the dtype's tolerance."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, gen  # noqa: E402

from deepinfer_kernels.dspark_block import dspark_greedy_block, dspark_greedy_block_ref  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r,g,n,v,d,rank", [(1, 6, 5, 300, 48, 16), (5, 4, 4, 97, 64, 8)])
def test_dspark_greedy_block_matches_torch(fresh_seed: int, dtype: torch.dtype, r: int, g: int, n: int, v: int,
                                           d: int, rank: int) -> None:
    gen_ = gen(fresh_seed)
    logits = (torch.randn(r, g, v, generator=gen_) * 3).to(DEVICE)
    logits[0, 0, 7] = float("nan")  # nan_to_num's rules hold in the kernel too
    h = torch.randn(r, g, d, generator=gen_).to(dtype).to(DEVICE)
    w1 = torch.randn(v, rank, generator=gen_).to(dtype).to(DEVICE)
    w2 = torch.randn(v, rank, generator=gen_).to(dtype).to(DEVICE)
    wc = (torch.randn(1, d + rank, generator=gen_) * 0.2).to(dtype).to(DEVICE)
    temps = (torch.rand(g, generator=gen_) + 0.5).to(DEVICE)
    prev = torch.randint(0, v, (r, 3), generator=gen_).to(DEVICE)[:, 1]  # a column, as the draft inputs give it
    got = dspark_greedy_block(prev, logits, h, w1, w2, wc, temps, n)
    want = dspark_greedy_block_ref(prev, logits, h, w1, w2, wc, temps, n)
    assert got.shape == want.shape == (r, 2 * n)
    assert torch.equal(got[:, :n], want[:, :n]), (got[:, :n], want[:, :n])
    conf = lambda x: x[:, n:].to(torch.int32).view(torch.float32)  # noqa: E731
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(conf(got), conf(want), atol=tol, rtol=0)
    assert ((conf(got) > 0) & (conf(got) < 1)).all()
