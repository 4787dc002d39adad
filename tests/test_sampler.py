"""Tests for deepinfer.engine.rng (counter RNG) and deepinfer.engine.sampler."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine import rng
from deepinfer.engine.sampler import Sampler, SamplingTensors
from deepinfer.sampling_params import SamplingParams


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ----------------------------------------------------------------------------- rng

def test_rng_deterministic_and_batch_shape_independent() -> None:
    seeds = [rng.seed_to_int64(s) for s in (0, 7, 2**64 - 1, 2**63)]
    pos = [0, 5, 123456, 9]
    full = rng.uniform(_t(seeds), _t(pos), rng.SAMPLE, 64)
    assert torch.equal(full, rng.uniform(_t(seeds), _t(pos), rng.SAMPLE, 64))
    for i in range(4):  # alone, reversed, and a narrower width: same numbers
        alone = rng.uniform(_t([seeds[i]]), _t([pos[i]]), rng.SAMPLE, 64)
        assert torch.equal(alone[0], full[i])
        assert torch.equal(rng.uniform(_t([seeds[i]]), _t([pos[i]]), rng.SAMPLE, 10)[0],
                           full[i, :10])
    rev = rng.uniform(_t(seeds[::-1]), _t(pos[::-1]), rng.SAMPLE, 64)
    assert torch.equal(rev, full.flip(0))


def test_rng_keys_differ() -> None:
    base = rng.uniform(_t([1]), _t([10]), rng.SAMPLE, 256)
    others = [
        rng.uniform(_t([2]), _t([10]), rng.SAMPLE, 256),
        rng.uniform(_t([1]), _t([11]), rng.SAMPLE, 256),
        rng.uniform(_t([1]), _t([10]), rng.RESIDUAL, 256),
        rng.uniform(_t([1]), _t([10]), rng.ACCEPT, 256),
        rng.uniform(rng.draft_seed(_t([1])), _t([10]), rng.SAMPLE, 256),
    ]
    for other in others:
        assert (other != base).float().mean() > 0.99
    assert rng.counter(_t([4]), rng.ACCEPT).item() == 14
    assert (rng.SAMPLE, rng.RESIDUAL, rng.ACCEPT, rng.NUM_CASES) == (0, 1, 2, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rng_range_and_uniformity(dtype: torch.dtype) -> None:
    u = rng.uniform(_t(list(range(10))), _t([3] * 10), rng.SAMPLE, 10_000, dtype=dtype)
    assert u.dtype == dtype and u.shape == (10, 10_000)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(u.var()) - 1 / 12) < 0.005
    hist = torch.histc(u.double(), bins=10, min=0.0, max=1.0) / u.numel()
    assert float((hist - 0.1).abs().max()) < 0.01
    # Across seeds at a fixed column the values must be uniform too.
    col = rng.uniform(_t(list(range(100_000))), _t([0] * 100_000), rng.ACCEPT, 1)
    assert abs(float(col.mean()) - 0.5) < 0.01


def test_rng_input_checks() -> None:
    with pytest.raises(ValueError, match="case"):
        rng.uniform(_t([1]), _t([1]), 3, 4)
    with pytest.raises(TypeError):
        rng.uniform(torch.tensor([1.0]), _t([1]), rng.SAMPLE, 4)
    with pytest.raises(ValueError, match="uint64"):
        rng.seed_to_int64(2**64)
    assert rng.seed_to_int64(2**64 - 1) == -1


# ------------------------------------------------------------------------- sampler

def _sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]):
    return Sampler().sample(logits, SamplingTensors.from_params(params, positions, "cpu"))


def test_greedy_is_argmax_with_lowest_index_ties() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[0, 3] = logits[0, 17] = 100.0
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 6, list(range(6)))
    expected = logits.argmax(-1)
    assert out.token_ids.tolist() == expected.tolist() and out.token_ids[0] == 3
    ref = torch.log_softmax(logits, -1).gather(1, expected[:, None])[:, 0]
    assert torch.equal(out.logprobs, ref)
    assert out.top_logprobs is None


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5},
                                {"min_p": 1.0}])
def test_filters_that_reduce_to_greedy(kw: dict) -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.5, seq_seed=i, **kw) for i in range(64)]
    out = _sample(logits, params, [i * 7 for i in range(64)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


def _counts(logits_row: list[float], n: int, **kw) -> torch.Tensor:
    """Sample one logits row n times with different seeds/positions; token counts."""
    logits = torch.tensor([logits_row]).repeat(n, 1)
    params = [SamplingParams(seq_seed=1000 + i, **kw) for i in range(n)]
    out = _sample(logits, params, [(i * 31) % 977 for i in range(n)])
    return torch.bincount(out.token_ids, minlength=len(logits_row)).double()


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    mask = probs > 0
    assert counts[~mask].sum() == 0, f"filtered tokens sampled: {counts}"
    expected = probs[mask] * counts.sum()
    return float(((counts[mask] - expected) ** 2 / expected).sum())


# chi-square critical value at p = 0.001 for 4 degrees of freedom is 18.47
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_match_softmax(temperature: float) -> None:
    row = [2.0, 1.0, 0.5, 0.0, -1.0]
    counts = _counts(row, 20_000, temperature=temperature)
    probs = torch.softmax(torch.tensor(row, dtype=torch.float64) / temperature, -1)
    assert _chi2(counts, probs) < 18.47


def test_top_k_top_p_min_p_keep_sets() -> None:
    row = [float(x) for x in torch.tensor([0.5, 0.3, 0.15, 0.05]).log()]
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)

    def renorm(keep: list[int]) -> torch.Tensor:
        q = torch.zeros(4, dtype=torch.float64)
        q[keep] = p[keep]
        return q / q.sum()

    assert _chi2(_counts(row, 8000, top_k=2), renorm([0, 1])) < 16.27  # df 1, p=1e-4
    assert _chi2(_counts(row, 8000, top_p=0.7), renorm([0, 1])) < 16.27
    assert _chi2(_counts(row, 8000, top_p=0.85), renorm([0, 1, 2])) < 18.42
    assert _chi2(_counts(row, 8000, min_p=0.5), renorm([0, 1])) < 16.27
    assert _chi2(_counts(row, 8000, min_p=0.2), renorm([0, 1, 2])) < 18.42
    assert _chi2(_counts(row, 8000, top_k=3, top_p=0.9), renorm([0, 1, 2])) < 18.42


def test_logprobs_are_raw_model_logprobs_and_top_logprobs() -> None:
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.3, top_k=5, top_logprobs=k, seq_seed=k)
              for k in (0, 3, 7, 1)]
    out = _sample(logits, params, [1, 2, 3, 4])
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    ids, values = out.top_logprobs
    assert ids.shape == values.shape == (4, 7)
    ref_values, ref_ids = raw.topk(7, -1)
    assert torch.equal(ids, ref_ids) and torch.equal(values, ref_values)


def test_same_seed_and_position_reproduce() -> None:
    logits = torch.zeros(1, 1000)
    draws = [_sample(logits, [SamplingParams(seq_seed=5)], [pos]).token_ids.item()
             for pos in (3, 3, 4, 5, 6)]
    assert draws[0] == draws[1] and len(set(draws[1:])) > 1


def _random_params(rnd: random.Random) -> SamplingParams:
    kind = rnd.choice(["greedy", "plain", "topk", "topp", "minp", "all"])
    kw: dict = {"seq_seed": rnd.getrandbits(64), "top_logprobs": rnd.randint(0, 5),
                "temperature": 0.0 if kind == "greedy" else rnd.uniform(0.2, 2.0)}
    if kind in ("topk", "all"):
        kw["top_k"] = rnd.randint(1, 60)
    if kind in ("topp", "all"):
        kw["top_p"] = rnd.uniform(0.05, 1.0)
    if kind in ("minp", "all"):
        kw["min_p"] = rnd.uniform(0.0, 0.3)
    return SamplingParams(**kw)


def test_batch_invariance() -> None:
    rnd = random.Random(0)
    vocab, n = 1024, 32
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [_random_params(rnd) for _ in range(n)]
    positions = [rnd.randint(0, 100_000) for _ in range(n)]
    alone = [_sample(logits[i:i + 1], [params[i]], [positions[i]]) for i in range(n)]
    for size in range(1, n + 1):
        rows = rnd.sample(range(n), size)
        out = _sample(logits[rows], [params[i] for i in rows], [positions[i] for i in rows])
        for j, i in enumerate(rows):
            assert out.token_ids[j].item() == alone[i].token_ids[0].item()
            assert torch.equal(out.logprobs[j], alone[i].logprobs[0])  # bitwise
            if alone[i].top_logprobs is not None:
                k = alone[i].top_logprobs[0].shape[1]
                assert torch.equal(out.top_logprobs[0][j, :k], alone[i].top_logprobs[0][0])
                assert torch.equal(out.top_logprobs[1][j, :k], alone[i].top_logprobs[1][0])


def test_sampling_tensors_from_params() -> None:
    params = [SamplingParams(temperature=0.0, seq_seed=2**64 - 1),
              SamplingParams(temperature=0.7, top_k=3, top_logprobs=4, seq_seed=9)]
    st = SamplingTensors.from_params(params, [5, 6], "cpu")
    assert st.temperature.tolist() == [1.0, pytest.approx(0.7)]
    assert st.greedy.tolist() == [True, False] and st.seed.tolist() == [-1, 9]
    assert st.position.tolist() == [5, 6] and st.max_top_logprobs == 4
    assert (st.all_greedy, st.any_top_k, st.any_top_p, st.any_min_p) == (False, True, False, False)
    with pytest.raises(ValueError, match="equal length"):
        SamplingTensors.from_params(params, [1], "cpu")
    with pytest.raises(ValueError, match="positions"):
        SamplingTensors.from_params(params, [1, -1], "cpu")
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(3, 4), st)


def test_fused_row_reduce_matches_log_softmax(monkeypatch) -> None:
    """The fused argmax / log-sum-exp kernel (interpreted) gives the torch path's tokens and
    log-probs on a mixed greedy / random batch, and a row's result alone equals its result
    in the batch; with top log-probs asked for, the torch path runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(random.randrange(2**31))
    logits = torch.randn(5, 3000, generator=g) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seq_seed=3, top_p=0.9),
              SamplingParams(temperature=0), SamplingParams(temperature=1.2, seq_seed=5, top_k=40),
              SamplingParams(temperature=0)]
    t = SamplingTensors.from_params(params, [7, 8, 9, 10, 11], "cpu")
    fused, plain = Sampler(fused_reduce=True), Sampler(fused_reduce=False)
    a, b = fused.sample(logits, t), plain.sample(logits, t)
    assert torch.equal(a.token_ids, b.token_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    greedy = SamplingTensors.from_params([params[0]] * 2, [7, 9], "cpu")
    c, d = fused.sample(logits[[0, 2]], greedy), plain.sample(logits[[0, 2]], greedy)
    assert torch.equal(c.token_ids, d.token_ids) and torch.equal(c.token_ids, a.token_ids[[0, 2]])
    torch.testing.assert_close(c.logprobs, d.logprobs, rtol=1e-5, atol=1e-5)
    alone = fused.sample(logits[2:3], SamplingTensors.from_params([params[2]], [9], "cpu"))
    assert torch.equal(alone.token_ids, c.token_ids[1:]) and torch.equal(alone.logprobs, c.logprobs[1:])
    top = SamplingTensors.from_params([SamplingParams(temperature=0, top_logprobs=3)], [7], "cpu")
    e = fused.sample(logits[:1], top)
    assert e.top_logprobs is not None and torch.equal(e.token_ids, a.token_ids[:1])
