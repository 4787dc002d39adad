"""The expert-parallel MoE layer in one process (a single-rank group) against the
reference MoE, in-place weight moves, and a one-rank RankLLM with live rebalancing."""

from __future__ import annotations

import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused local-slot path runs interpreted on CPU

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.moe import MoE
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.parallel.comm import EPComm
from deepinfer.parallel.eplb import EPLBConfig
from deepinfer.parallel.expert_parallel import ExpertParallelMoE
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.rank_engine import RankLLM

VOCAB = 512


def make_moe(is_hash: bool, dtype: torch.dtype, seed: int) -> MoE:
    gen = torch.Generator().manual_seed(seed)
    moe = MoE(64, 32, 8, 2, 1, is_hash, VOCAB, "sqrtsoftplus", 1.5, True, 10.0, dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.2).to(p.dtype))
        if is_hash:
            moe.gate.tid2eid.copy_(torch.rand(VOCAB, 8, generator=gen).argsort(-1)[:, :2])
    return moe


@pytest.mark.parametrize("is_hash", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ep_layer_equals_reference_moe(is_hash: bool, dtype: torch.dtype, fresh_seed: int) -> None:
    moe = make_moe(is_hash, dtype, fresh_seed)
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(41, 64, generator=gen).to(dtype)
    ids = torch.randint(0, VOCAB, (41,), generator=gen)
    ref = moe(x, ids)
    plain = ExpertParallelMoE(moe, 0, ExpertPlacement.default(1, 8, 1).phy2log[0], EPComm())
    assert torch.equal(plain(x, ids), ref), "same expert batches: bitwise equal"
    shuffled = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    assert torch.equal(ExpertParallelMoE(moe, 0, shuffled, EPComm())(x, ids), ref), "slot order is irrelevant"
    redundant = ExpertParallelMoE(moe, 0, ExpertPlacement.default(1, 8, 1, 3).phy2log[0], EPComm())
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # replicas split an expert's rows into two matmuls
    torch.testing.assert_close(redundant(x, ids), ref, atol=tol, rtol=tol)
    redundant.rearrange(shuffled)  # back to one replica each, by local copies
    assert torch.equal(redundant(x, ids), ref)
    empty = redundant(x[:0], ids[:0])
    assert empty.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_local_slots_equal_the_slot_loop(dtype: torch.dtype, fresh_seed: int) -> None:
    """The CUDA path (one fused MoE launch over the local slots, here interpreted) computes
    what the per-slot loop does, for rows from two source ranks with empty slots."""
    moe = make_moe(False, dtype, fresh_seed)
    layer = ExpertParallelMoE(moe, 0, torch.tensor([3, 0, 6, 1, 5, 2, 7, 4]), EPComm())
    gen = torch.Generator().manual_seed(fresh_seed)
    counts = [[2, 0, 3, 1, 0, 4, 1, 2], [0, 5, 1, 0, 2, 0, 3, 1]]  # rows per (source rank, local slot)
    x = torch.randn(sum(map(sum, counts)), 64, generator=gen).to(dtype)
    layer.fused_local = False
    loop = layer._run_local(x, counts)
    layer.fused_local = True
    fused = layer._run_local(x, counts)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # float32 sums in another order / a bf16 rounding flip
    torch.testing.assert_close(fused, loop, atol=tol, rtol=tol)
    assert layer._run_local(x[:0], [[0] * 8, [0] * 8]).shape == (0, 64)


def test_load_is_recorded_per_physical_slot() -> None:
    from deepinfer.parallel.eplb import LoadRecorder
    moe = make_moe(False, torch.float32, 0)
    row = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1])
    layer = ExpertParallelMoE(moe, 0, row, EPComm())
    layer.recorder = rec = LoadRecorder(1, 10, window=4, device="cpu")
    x, ids = torch.randn(30, 64), torch.randint(0, VOCAB, (30,))
    rec.begin_step()
    layer(x, ids)
    rec.end_step()
    counts = rec.window()[0, 0]
    _, logical = moe.gate(x, ids)
    want = torch.bincount(logical.flatten(), minlength=8)
    assert counts.sum() == 60 and counts[[0, 8]].sum() == want[0] and counts[[1, 9]].sum() == want[1]
    assert counts[0] > 0 and counts[8] > 0, "tokens of a replicated expert spread over its replicas"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_ep")
    write_tiny_checkpoint(str(path), seed=5, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


def test_single_rank_engine_with_redundancy_and_live_rebalance(ckpt: str) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 90))] for _ in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    ref = LLM(ckpt, **kw).generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    rank = RankLLM(ckpt, comm=EPComm(), eplb=EPLBConfig(num_redundant_experts=4, rebalance_interval=3, window_size=5),
                   **kw)
    out = rank.generate_rank(prompt_token_ids=prompts, sampling_params=[sp] * len(prompts))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert len(rank.eplb.reports) >= 3 and rank.eplb.placement.num_slots == 12
