"""Batch invariance at the model level: attention (window + compressed entries, the
indexer's top-k) gives a token the same bits whatever its chunk, and the whole model's
logits for a request are the same alone, chunked any way, or beside other requests.
Also: the mode's configuration rules and its scoping to the runner."""

from __future__ import annotations

import pytest
import torch

from deepinfer import batch_invariant as bi
from deepinfer.batch_invariant import batch_invariant_mode
from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError
from deepinfer.models.invariant_attention import attend
from deepinfer.models.loader import load_model
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

W, RATIO = 32, 4


def _attend_in_chunk(q: torch.Tensor, keys: torch.Tensor, entries: torch.Tensor, sink: torch.Tensor,
                     select: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """What the model does for a chunk [s, e) of one request: window keys from
    max(0, s - W + 1), entries closed by e, each query's visible entries `select`ed."""
    pos = torch.arange(s, e)
    k_lo = max(0, s - W + 1)
    n = e // RATIO
    mask = select[s:e, :n] & (torch.arange(n)[None, :] < ((pos + 1) // RATIO)[:, None])
    return attend(q[s:e], pos, keys[k_lo:e], k_lo, W, entries[:n] if n else None, mask if n else None,
                  sink, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("csa", [False, True])
def test_attend_is_chunk_invariant(fresh_seed: int, dtype: torch.dtype, csa: bool) -> None:
    gen = torch.Generator().manual_seed(fresh_seed)
    length, heads, dim = 150, 4, 32
    q = torch.randn(length, heads, dim, generator=gen).to(dtype)
    keys = torch.randn(length, dim, generator=gen).to(dtype)
    entries = torch.randn(length // RATIO, dim, generator=gen).to(dtype)
    sink = torch.randn(heads, generator=gen)
    # CSA: the indexer picks a subset per query (a fixed function of the query here)
    select = (torch.rand(length, length // RATIO, generator=gen) < 0.3) if csa else \
        torch.ones(length, length // RATIO, dtype=torch.bool)
    full = _attend_in_chunk(q, keys, entries, sink, select, 0, length)
    for p in (0, 5, W - 1, W, 77, length - 1):  # each query alone (a decode step)
        assert torch.equal(_attend_in_chunk(q, keys, entries, sink, select, p, p + 1), full[p:p + 1]), p
    for bounds in ([0, 3, 40, 41, 90, length], [0, 64, 128, length], [0, 1, length]):
        parts = [_attend_in_chunk(q, keys, entries, sink, select, a, b) for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(parts), full), bounds


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("bi_model")
    write_tiny_checkpoint(str(path), seed=4, cfg=tiny_config(vocab_size=512, sliding_window=W))
    return str(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_logits_independent_of_chunks_and_companions(tiny_dir: str, fresh_seed: int, dtype: str) -> None:
    """HCA, CSA (indexer top-k) and sliding layers, hash and routed MoE, mHC, LM head."""
    model = load_model(tiny_dir, dtype=dtype)
    gen = torch.Generator().manual_seed(fresh_seed)
    toks = torch.randint(0, 512, (200,), generator=gen).tolist()

    def run(chunks: list[int], companions: int = 0) -> torch.Tensor:
        runner = StandaloneRunner(model, max_seqs=4, max_len=512)  # companions grow up to 39 tokens per chunk: 8 chunks reach 312
        outs, start = [], 0
        for c in chunks:
            feeds = [(k, torch.randint(0, 512, (int(torch.randint(1, 40, (1,), generator=gen)),),
                                       generator=gen).tolist()) for k in range(1, 1 + companions)]
            feeds.insert(int(torch.randint(0, companions + 1, (1,), generator=gen)), (0, toks[start:start + c]))
            outs.append(runner.step(feeds)[[f[0] for f in feeds].index(0)])
            start += c
        return torch.cat(outs)

    with batch_invariant_mode(True):
        full = run([200])
        for chunks, companions in (([200], 3), ([37, 63, 100], 2), ([1] * 6 + [130, 64], 1), ([128, 72], 0)):
            assert torch.equal(run(chunks, companions), full), (chunks, companions)


def test_varlen_verification_rejected_in_batch_invariant_mode() -> None:
    env = {"DEEPINFER_BATCH_INVARIANT": "1", "DEEPINFER_ENABLE_MTP_VARLEN": "1"}
    for kwargs in ({"environ": env}, {"environ": {}, "batch_invariant": True, "enable_mtp_varlen": True},
                   {"environ": {"DEEPINFER_BATCH_INVARIANT": "1"}, "enable_mtp_varlen": True}):
        with pytest.raises(ConfigError) as info:
            EngineConfig.from_kwargs(accelerator="cpu", **kwargs)
        msg = str(info.value)
        assert "DEEPINFER_BATCH_INVARIANT" in msg and "DEEPINFER_ENABLE_MTP_VARLEN=0" in msg
        assert info.value.field == "enable_mtp_varlen"
    ok = EngineConfig.from_kwargs(environ={"DEEPINFER_BATCH_INVARIANT": "1", "DEEPINFER_ENABLE_MTP_VARLEN": "0"},
                                  accelerator="cpu", num_speculative_tokens=3)
    assert ok.batch_invariant and ok.deterministic
    assert EngineConfig.from_kwargs(environ={}, accelerator="cpu", enable_mtp_varlen=True).enable_mtp_varlen


def test_runner_scope() -> None:
    class Runner:
        batch_invariant = True

        @bi.scoped
        def execute(self) -> bool:
            return bi.enabled()

    runner = Runner()
    assert runner.execute() and not bi.enabled()
    runner.batch_invariant = False
    with batch_invariant_mode(True):
        assert not runner.execute() and bi.enabled()  # the runner's own setting wins inside


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_parallel_layer_in_the_mode(fresh_seed: int, dtype: torch.dtype) -> None:
    """The EP layer's expert GEMMs and combine order in the mode: a token's output does not
    depend on the other tokens, and equals the single-process MoE bitwise even when
    redundant replicas split an expert's rows into two GEMMs (off the mode only close)."""
    from batch_invariance_common import assert_row_invariant

    from deepinfer.models.moe import MoE
    from deepinfer.parallel.comm import EPComm
    from deepinfer.parallel.expert_parallel import ExpertParallelMoE
    from deepinfer.parallel.placement import ExpertPlacement

    gen = torch.Generator().manual_seed(fresh_seed)
    moe = MoE(64, 32, 8, 2, 1, False, 100, "sqrtsoftplus", 1.5, True, 10.0, dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.2).to(p.dtype))
    redundant = ExpertParallelMoE(moe, 0, ExpertPlacement.default(1, 8, 1, 3).phy2log[0], EPComm())
    x, ids = torch.randn(41, 64, generator=gen).to(dtype), torch.randint(0, 100, (41,), generator=gen)
    with batch_invariant_mode(True), torch.no_grad():
        assert torch.equal(redundant(x, ids), moe(x, ids))
        assert_row_invariant(redundant, lambda m: (torch.randn(m, 64, generator=gen).to(dtype),
                                                   torch.randint(0, 100, (m,), generator=gen)),
                             sizes=[1, 7, 64], targets=2)
