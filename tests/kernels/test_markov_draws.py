"""markov_greedy_draws (DSpark's sequential greedy draws with the Markov bias) vs the draw
by draw torch reference (interpreter on CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, gen  # noqa: E402

from deepinfer_kernels.markov_draws import markov_greedy_draws, markov_greedy_draws_ref  # noqa: E402


def _inputs(seed: int, r: int, g: int, v: int, rank: int, dtype: torch.dtype):
    gn = gen(seed)
    logits = torch.randn(r, g, v, generator=gn) * 3
    logits[0, 0, torch.randint(v, (v // 8,), generator=gn)] = float("-inf")  # grammar-masked columns
    logits[-1, -1, 5] = float("nan")
    first = torch.randint(v, (r,), generator=gn)
    w1 = (torch.randn(v, rank, generator=gn) * 0.3).to(dtype)
    w2 = (torch.randn(v, rank, generator=gn) * 0.3).to(dtype)
    return [t.to(DEVICE) for t in (logits, first, w1, w2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r,g,n,v,split", [(3, 5, 5, 1000, 128), (2, 6, 4, 333, 64), (1, 5, 1, 512, 2048),
                                           (40, 3, 3, 200, 64)])
def test_matches_the_reference(fresh_seed: int, dtype, r, g, n, v, split) -> None:
    """Several vocabulary slices with a partial tail, fewer draws than block rows, one slice,
    rows over two row blocks with a partial one."""
    logits, first, w1, w2 = _inputs(fresh_seed, r, g, v, 16, dtype)
    got = markov_greedy_draws(logits, first, w1, w2, n, split)
    want = markov_greedy_draws_ref(logits, first, w1, w2, n)
    assert got.dtype == torch.int64 and got.shape == (r, n)
    assert torch.equal(got, want)


def test_each_draw_reads_the_token_before_it(fresh_seed: int) -> None:
    """With flat logits the bias decides: draw j's token is the argmax of W2 . W1[draw j - 1]."""
    _, first, w1, w2 = _inputs(fresh_seed, 2, 4, 300, 16, torch.float32)
    flat = torch.zeros(2, 4, 300, device=DEVICE)
    got = markov_greedy_draws(flat, first, w1, w2, 4, 64)
    prev = first
    for j in range(4):
        prev = (w1[prev] @ w2.T).argmax(dim=-1)
        assert torch.equal(got[:, j], prev)


def test_ties_go_to_the_lowest_index() -> None:
    """Equal maxima in two slices and inside one slice: torch.argmax's first index."""
    w = torch.zeros(300, 16, device=DEVICE)
    logits = torch.zeros(2, 1, 300, device=DEVICE)
    logits[0, 0, [250, 70, 71]] = 9.0
    logits[1, 0, [40, 39]] = 9.0
    got = markov_greedy_draws(logits, torch.zeros(2, dtype=torch.long, device=DEVICE), w, w, 1, 32)
    assert got[:, 0].tolist() == [70, 39]


def test_rows_do_not_interact(fresh_seed: int) -> None:
    logits, first, w1, w2 = _inputs(fresh_seed, 5, 3, 400, 16, torch.bfloat16)
    batch = markov_greedy_draws(logits, first, w1, w2, 3, 64)
    alone = markov_greedy_draws(logits[2:3], first[2:3], w1, w2, 3, 64)
    assert torch.equal(alone, batch[2:3])


def test_rejects_bad_input() -> None:
    logits, first, w1, w2 = _inputs(0, 2, 3, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="n=4"):
        markov_greedy_draws(logits, first, w1, w2, 4)
    with pytest.raises(ValueError, match="float32"):
        markov_greedy_draws(logits.half(), first, w1, w2, 2)
    with pytest.raises(ValueError, match="W1"):
        markov_greedy_draws(logits, first, w1[:, :8], w2, 2)
