"""argmax_logsumexp (the greedy sampler's fused row reduction) vs torch (interpreter on CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, gen  # noqa: E402

from deepinfer_kernels.argmax_lse import argmax_logsumexp, argmax_logsumexp_ref  # noqa: E402


@pytest.mark.parametrize("r,v,split", [(1, 1000, 64), (5, 333, 32), (3, 64, 2048)])  # partial tails, one split
def test_matches_torch(fresh_seed: int, r: int, v: int, split: int) -> None:
    g = gen(fresh_seed)
    x = (torch.randn(r, v, generator=g) * 4).to(DEVICE)
    x[0, torch.randint(v, (v // 10,), generator=g)] = float("-inf")  # grammar-masked tokens
    tok, lse, lp = argmax_logsumexp(x, split)
    tok_r, lse_r, lp_r = argmax_logsumexp_ref(x)
    assert tok.dtype == torch.int64 and torch.equal(tok, tok_r)
    torch.testing.assert_close(lse, lse_r, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(lp, lp_r, rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lowest_index(fresh_seed: int) -> None:
    """Equal maxima in different partials and in one partial: torch.argmax's first index."""
    g = gen(fresh_seed)
    x = torch.randn(2, 300, generator=g).to(DEVICE)
    x[0, [250, 70, 71]] = 9.0  # partials 2 and 7 of 32 columns (70 and 71 share one)
    x[1, [40, 39]] = 9.0
    tok, _, _ = argmax_logsumexp(x, 32)
    assert tok.tolist() == [70, 39]


def test_rows_do_not_interact(fresh_seed: int) -> None:
    g = gen(fresh_seed)
    x = torch.randn(6, 500, generator=g).to(DEVICE)
    alone = argmax_logsumexp(x[4:5], 64)
    batch = argmax_logsumexp(x, 64)
    for a, b in zip(alone, batch):
        assert torch.equal(a, b[4:5])


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="float32"):
        argmax_logsumexp(torch.randn(2, 8, device=DEVICE).half())
    with pytest.raises(ValueError, match="power of two"):
        argmax_logsumexp(torch.randn(2, 8, device=DEVICE), split=24)


def test_packed_output(fresh_seed: int) -> None:
    """The packed [R, 2] output (the greedy decode lane's one device -> host copy) holds the
    tokens and the log-probs' bits."""
    from deepinfer.engine.sampler import pack_greedy, unpack_greedy

    g = gen(fresh_seed)
    x = (torch.randn(4, 700, generator=g) * 3).to(DEVICE)
    packed = torch.empty(4, 2, dtype=torch.int64, device=DEVICE)
    tok, _, lp = argmax_logsumexp(x, 64, packed=packed)
    assert torch.equal(packed, pack_greedy(tok, lp))
    tokens, lps = unpack_greedy(packed.cpu())
    assert tokens == tok.tolist() and lps == lp.tolist()
    ref = torch.empty_like(packed)
    argmax_logsumexp_ref(x, packed=ref)
    assert torch.equal(ref[:, 0], packed[:, 0])
