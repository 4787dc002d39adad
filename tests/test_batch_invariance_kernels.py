"""The batch-invariant Triton kernels (kernels/batch_invariant_*.py), run in Triton's CPU
interpreter (or on a GPU with TRITON_INTERPRET=0): each agrees with its torch reference
within its dtype's tolerance on fresh random inputs, and a row's result is bitwise the
same alone, inside batches of several sizes and at another batch position.

The interpreter costs ~1 ms per Triton op, so shapes are tiny and the batch sizes fewer
than the torch-level tests use; the property does not depend on the sizes (every
launch configuration is fixed per dtype and width, never from the row count).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from batch_invariance_common import assert_close, assert_row_invariant, randn  # noqa: E402

from deepinfer import batch_invariant as bi  # noqa: E402
from deepinfer.batch_invariant import batch_invariant_mode  # noqa: E402
from deepinfer.models import invariant_ops  # noqa: E402
from deepinfer.models.invariant_attention import attend, attend_reference  # noqa: E402
from deepinfer.models.moe import MoE  # noqa: E402
from deepinfer.models.norm import RMSNorm, unweighted_rms_norm  # noqa: E402

pytest.importorskip("triton")
INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def gen(fresh_seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed)


@pytest.fixture
def kernels():
    """The built-in kernels registered for DEVICE for one test, then the previous state back."""
    before = {op: bi.get_kernel(op, DEVICE) for op in bi.OPS}
    bi.load_builtin_kernels(DEVICE)
    try:
        yield {op: bi.get_kernel(op, DEVICE) for op in bi.OPS}
    finally:
        for op, fn in before.items():
            bi.register_kernel(op, DEVICE, fn)


def dev(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def test_every_op_has_a_kernel(kernels: dict) -> None:
    assert set(bi.BUILTIN_KERNELS) == set(bi.OPS)
    assert all(fn is not None for fn in kernels.values())
    assert {op for (op, d) in bi.registered_kernels() if d == DEVICE} == set(bi.OPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_matches_reference(gen: torch.Generator, kernels: dict, dtype: torch.dtype) -> None:
    from deepinfer_kernels.batch_invariant_matmul import matmul_nt_ref

    for m, n, k in ((1, 24, 64), (70, 45, 96), (130, 200, 160), (5, 129, 33)):  # K tails, N tails, M tails
        a, b = dev(randn(gen, m, k, dtype=dtype)), dev(randn(gen, n, k, dtype=dtype, scale=k ** -0.5))
        assert_close(kernels["matmul_nt"](a, b), matmul_nt_ref(a, b), dtype)
    x = dev(randn(gen, 3, 4, 96, dtype=dtype))  # leading dims, a strided view
    w = dev(randn(gen, 40, 96, dtype=dtype))
    assert_close(kernels["linear"](x[:, 1:], w), matmul_nt_ref(x[:, 1:].reshape(-1, 96), w).view(3, 3, 40), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_rows_invariant(gen: torch.Generator, kernels: dict, dtype: torch.dtype) -> None:
    w = dev(randn(gen, 96, 80, dtype=dtype, scale=0.1))  # K = 80: a K tail inside every dot
    with batch_invariant_mode(True):
        assert_row_invariant(lambda x: invariant_ops.linear(x, w), lambda m: (dev(randn(gen, m, 80, dtype=dtype)),),
                             sizes=[1, 2, 7, 33, 64, 256], targets=1)


def test_matmul_nt_independent_of_keys(gen: torch.Generator, kernels: dict) -> None:
    """The indexer's scores: element (i, j) is the same for any number of queries and keys."""
    keys = dev(randn(gen, 130, 16))
    with batch_invariant_mode(True):
        for n_keys in (1, 33, 130):
            assert_row_invariant(lambda a, n=n_keys: invariant_ops.matmul_nt(a, keys[:n])[:, :1],
                                 lambda m: (dev(randn(gen, m, 16)),), sizes=[1, 7, 100], targets=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_sum_and_norms(gen: torch.Generator, kernels: dict, dtype: torch.dtype) -> None:
    from deepinfer_kernels.batch_invariant_row_sum import row_sum_ref

    for d in (16, 100, 2100):  # 2100 > one 1024-wide block: several steps along the row
        x = dev(randn(gen, 9, 3, d, dtype=dtype))
        for square in (False, True):
            assert_close(kernels["row_sum"](x, square), row_sum_ref(x, square), torch.float32)
    norm = RMSNorm(512).to(DEVICE)
    norm.weight.data = dev(1 + 0.1 * randn(gen, 512))
    x = dev(randn(gen, 20, 512, dtype=dtype))
    ref = norm(x)  # mode off: the plain torch statistic
    with batch_invariant_mode(True):
        assert_close(norm(x), ref, dtype)
        assert_row_invariant(norm, lambda m: (dev(randn(gen, m, 512, dtype=dtype)),), sizes=[1, 3, 64], targets=1)
        assert_row_invariant(lambda t: unweighted_rms_norm(t, 1e-6),
                             lambda m: (dev(randn(gen, m, 4, 64, dtype=dtype)),), sizes=[1, 5, 40], targets=1)


def test_row_cumsum_and_top_p_sampler(gen: torch.Generator, kernels: dict) -> None:
    from deepinfer_kernels.batch_invariant_cumsum import row_cumsum_ref

    from deepinfer.engine.sampler import Sampler, SamplingTensors
    from deepinfer.sampling_params import SamplingParams

    for v in (5, 512, 3000):  # 3000 > one 2048-wide piece
        x = dev(torch.rand(6, v, generator=gen))
        assert_close(kernels["row_cumsum"](x), row_cumsum_ref(x), torch.float32)
    vocab, sampler = 700, Sampler()
    kinds = [SamplingParams(temperature=0.9, top_p=0.8, seq_seed=3), SamplingParams(temperature=0.0),
             SamplingParams(temperature=1.0, top_p=0.95, top_k=40, seq_seed=9)]

    def run(logits: torch.Tensor, kind: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = SamplingTensors.from_params([kinds[int(k)] for k in kind], [7] * len(kind), DEVICE)
        out = sampler.sample(logits, params)
        return out.token_ids, out.logprobs, sampler.process_logits(logits.float(), params)

    def rows(m: int) -> tuple[torch.Tensor, torch.Tensor]:  # the target row is a top-p row
        kind = torch.where(torch.arange(m) == 0, 0, torch.randint(0, 3, (m,), generator=gen))
        return dev(randn(gen, m, vocab, scale=3.0)), kind

    with batch_invariant_mode(True):
        assert_row_invariant(run, rows, sizes=[1, 2, 9, 64], targets=2)


W, RATIO = 16, 4


def _attend_in_chunk(q: torch.Tensor, keys: torch.Tensor, entries: torch.Tensor, sink: torch.Tensor,
                     select: torch.Tensor, s: int, e: int, fn=attend) -> torch.Tensor:
    """What the model does for a chunk [s, e) of one request (see test_batch_invariance_model)."""
    pos = dev(torch.arange(s, e))
    k_lo = max(0, s - W + 1)
    n = e // RATIO
    mask = select[s:e, :n] & (dev(torch.arange(n))[None, :] < ((pos + 1) // RATIO)[:, None])
    return fn(q[s:e], pos, keys[k_lo:e], k_lo, W, entries[:n] if n else None, mask if n else None,
              sink, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype,csa", [(torch.float32, True), (torch.bfloat16, False)])
def test_attention_matches_reference_and_is_chunk_invariant(gen: torch.Generator, kernels: dict,
                                                            dtype: torch.dtype, csa: bool) -> None:
    length, heads, dim = 28, 4, 32
    q = dev(randn(gen, length, heads, dim, dtype=dtype))
    keys = dev(randn(gen, length, dim, dtype=dtype))
    entries = dev(randn(gen, length // RATIO, dim, dtype=dtype))
    sink = dev(randn(gen, heads))
    # CSA: the indexer picks a subset per query (a fixed function of the query here)
    select = dev(torch.rand(length, length // RATIO, generator=gen) < 0.4) if csa else \
        dev(torch.ones(length, length // RATIO, dtype=torch.bool))
    with batch_invariant_mode(True):
        full = _attend_in_chunk(q, keys, entries, sink, select, 0, length)
        assert_close(full, _attend_in_chunk(q, keys, entries, sink, select, 0, length, attend_reference), dtype)
        for p in (0, W - 1, W, length - 1):  # each query alone (a decode step)
            assert torch.equal(_attend_in_chunk(q, keys, entries, sink, select, p, p + 1), full[p:p + 1]), p
        bounds = [0, 3, 17, 18, length]  # 17 = W + 1: a chunk starting inside the window
        parts = [_attend_in_chunk(q, keys, entries, sink, select, a, b) for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(parts), full), bounds


@pytest.mark.parametrize("dtype,is_hash", [(torch.bfloat16, False), (torch.float32, True)])
def test_moe_matches_reference_and_is_row_invariant(gen: torch.Generator, kernels: dict, dtype: torch.dtype,
                                                    is_hash: bool) -> None:
    hidden, inter, experts, vocab = 64, 96, 8, 100  # inter 96: a K tail in the down GEMM
    moe = MoE(hidden, inter, experts, 2, 1, is_hash, vocab, "sqrtsoftplus", 1.5, True, 10.0, dtype).to(DEVICE)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(dev(randn(gen, *p.shape, scale=p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5)).to(p.dtype))
        if is_hash:
            moe.gate.tid2eid.copy_(dev(torch.rand(vocab, experts, generator=gen).argsort(-1)[:, :2]))
        x, ids = dev(randn(gen, 50, hidden, dtype=dtype)), dev(torch.randint(0, vocab, (50,), generator=gen))
        with batch_invariant_mode(True):
            got = moe(x, ids)
            for op in ("moe", "linear"):  # the module's own loop over the torch references
                bi.register_kernel(op, DEVICE, None)
            ref = moe(x, ids)
            for op in ("moe", "linear"):
                bi.register_kernel(op, DEVICE, kernels[op])
            assert_close(got, ref, dtype)
            assert_row_invariant(moe, lambda m: (dev(randn(gen, m, hidden, dtype=dtype)),
                                                 dev(torch.randint(0, vocab, (m,), generator=gen))),
                                 sizes=[1, 64], targets=1)


def test_no_kernels_off_mode(gen: torch.Generator, kernels: dict) -> None:
    """Registered kernels change nothing outside the mode: the plain torch ops run."""
    x, w = dev(randn(gen, 5, 32)), dev(randn(gen, 7, 32))
    assert torch.equal(invariant_ops.linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(invariant_ops.mean_square(x), x.float().pow(2).mean(-1, keepdim=True))
    assert torch.equal(invariant_ops.row_sum(x), x.sum(-1))
    assert torch.equal(invariant_ops.row_cumsum(x), x.cumsum(-1))


def test_model_through_kernels(tmp_path, fresh_seed: int, kernels: dict) -> None:
    """A tiny model (CSA with indexer top-k, sliding, hash + routed MoE, mHC, LM head) in
    the mode with every op on the kernels: a request's logits are the same bits alone or
    chunked beside a companion, and match the torch references of the mode."""
    from deepinfer.models.loader import load_model
    from deepinfer.models.standalone import StandaloneRunner
    from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

    cfg = tiny_config(vocab_size=512, sliding_window=16, num_hidden_layers=2, compress_ratios=[4, 0],
                      num_hash_layers=1)
    write_tiny_checkpoint(str(tmp_path), seed=fresh_seed % 1000, cfg=cfg)
    model = load_model(str(tmp_path), dtype="float32").to(DEVICE)
    gen = torch.Generator().manual_seed(fresh_seed)
    toks = torch.randint(0, 512, (24,), generator=gen).tolist()

    def run(chunks: list[int], companion: bool) -> torch.Tensor:
        runner = StandaloneRunner(model, max_seqs=2, max_len=64)
        outs, start = [], 0
        for c in chunks:
            feeds = [(1, torch.randint(0, 512, (5,), generator=gen).tolist())] if companion else []
            feeds.append((0, toks[start:start + c]))
            outs.append(runner.step(feeds)[len(feeds) - 1])
            start += c
        return torch.cat(outs)

    with batch_invariant_mode(True):
        full = run([24], False)
        assert torch.equal(run([7, 17], True), full)
        for op in bi.OPS:
            bi.register_kernel(op, DEVICE, None)
        assert_close(full, run([24], False), torch.float32)


def test_v41_moe_and_engram_through_kernels(gen: torch.Generator, kernels: dict) -> None:
    """V4.1's MoE (float32 router over logits / gate_temp) and Engram gate (row statistics)
    in the mode on the kernels: row invariant and equal to the mode's torch references."""
    from deepinfer.models.v41.engram import Engram
    from deepinfer.models.tiny import tiny_v41_config
    from deepinfer.models.v41.layers import MoE41

    cfg = tiny_v41_config(vocab_size=300)
    moe = MoE41(cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, torch.bfloat16).to(DEVICE)
    engram = Engram(cfg, cfg.engram_num_embeddings[0], torch.float32).to(DEVICE)
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    with torch.no_grad():
        for p in list(moe.parameters()) + list(engram.parameters()):
            p.copy_(dev(randn(gen, *p.shape, scale=p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5)).to(p.dtype))

    def moe_rows(m: int) -> tuple[torch.Tensor, ...]:
        return dev(randn(gen, m, cfg.hidden_size, dtype=torch.bfloat16)), dev(torch.zeros(m, dtype=torch.long))

    def engram_rows(m: int) -> tuple[torch.Tensor, ...]:
        return (dev(randn(gen, m, cfg.hc_mult, cfg.hidden_size)),
                dev(torch.randint(0, cfg.engram_num_embeddings[0], (m, cols), generator=gen)))

    with torch.no_grad(), batch_invariant_mode(True):
        assert_row_invariant(moe, moe_rows, sizes=[1, 40], targets=1)
        assert_row_invariant(engram, engram_rows, sizes=[1, 3, 40], targets=1)
        args_moe, args_engram = moe_rows(30), engram_rows(30)
        got = moe(*args_moe), engram(*args_engram)
        for op in bi.OPS:
            bi.register_kernel(op, DEVICE, None)
        assert_close(got[0], moe(*args_moe), torch.bfloat16)
        assert_close(got[1], engram(*args_engram), torch.float32)
