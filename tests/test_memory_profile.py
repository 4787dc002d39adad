"""Memory profiling before KV sizing (deepinfer/engine/memory_profile.py): the worst-case
step runs on the path the engine will use, and its measured peak comes off the budget."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.kv_sizing import device_kv_budget
from deepinfer.engine.memory_profile import profile_step_peak_bytes, worst_case_step
from deepinfer.models.tiny import init_random, tiny_config

GIB = 1 << 30


@pytest.mark.parametrize("fast_prefill", ["0", "ref"])
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_worst_case_step_runs_on_the_engines_prefill_path(monkeypatch, fast_prefill: str, family: str) -> None:
    """The profiled step runs on the prefill executor the engine builds for the model's family
    (V4.1's own too: it was profiled on the reference path when this named V4's executor)."""
    from deepinfer.models.registry import build_model, family_of
    from deepinfer.models.tiny import tiny_v41_config

    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", fast_prefill)
    make = tiny_config if family == "v4" else tiny_v41_config
    model = build_model(make(vocab_size=512, sliding_window=32, index_topk=4), torch.float32)
    init_random(model, 3)
    cfg = EngineConfig(max_num_batched_tokens=300, max_model_len=256, max_num_seqs=5, block_size=128)
    calls = []
    fam = family_of(model.cfg)
    build = fam.prefill_executor

    def spying(model, cache):  # the executor the profile builds, with its forward counted
        executor = build(model, cache)
        if executor is not None:
            forward = executor.forward
            executor.forward = lambda *a: calls.append(a) or forward(*a)
        return executor
    object.__setattr__(fam, "prefill_executor", spying)  # a frozen dataclass: restored below
    try:
        lp = worst_case_step(model.eval(), cfg, torch.device("cpu"))
    finally:
        object.__setattr__(fam, "prefill_executor", build)
    assert lp.shape == (5, 512) and torch.isfinite(lp).all()
    assert torch.allclose(lp.exp().sum(-1), torch.ones(5), atol=1e-4)
    assert len(calls) == (1 if fast_prefill == "ref" else 0)  # min(300, 256) tokens, one step
    assert profile_step_peak_bytes(model, cfg, torch.device("cpu")) is None  # no allocator to ask


def test_device_budget_subtracts_the_measured_peak() -> None:
    total, free = 140 * GIB, 100 * GIB  # 40 GiB of weights / other processes
    budget = int(total * 0.9) - 40 * GIB
    assert device_kv_budget(total, free, 0.9, 6 * GIB) == budget - 6 * GIB  # profiled step + graphs
    assert device_kv_budget(total, free, 0.9, None) == budget - max(GIB, budget // 10)  # unprofiled: headroom
    assert device_kv_budget(total, free, 0.3, 6 * GIB) == 0  # nothing left: never negative


def test_speculative_graphs_keep_their_logits_free() -> None:
    """The graphs captured after KV sizing (verify greedy lane, MTP stage, DSpark draft step)
    hold float32 logits of their largest buckets: those bytes come off the KV budget up front."""
    from deepinfer.engine.memory_profile import speculative_graph_bytes
    from deepinfer.models.tiny import tiny_dspark_config

    mtp = tiny_config(vocab_size=1000, sliding_window=32)
    dspark = tiny_dspark_config(vocab_size=1000, sliding_window=32)
    assert speculative_graph_bytes(mtp, EngineConfig(max_num_seqs=8)) == 0  # no speculation
    # MTP k=1, 8 requests: the verify rows top out at 16 (lane) and the catch-up at 16
    assert speculative_graph_bytes(mtp, EngineConfig(max_num_seqs=8, num_speculative_tokens=1)) == 4 * 1000 * 32
    # DSpark k=5: lane 48 rows; 8 blocks x (gamma logits + 5 draft distributions)
    gamma = dspark.dspark_block_size
    want = 4 * 1000 * (48 + 8 * (gamma + min(5, gamma)))
    assert speculative_graph_bytes(dspark, EngineConfig(max_num_seqs=8, num_speculative_tokens=5)) == want
    # a 1000-token vocabulary's lane covers every verify bucket (512 rows); the drafter's too
    big = speculative_graph_bytes(mtp, EngineConfig(max_num_seqs=256, num_speculative_tokens=1))
    assert big == 4 * 1000 * (512 + 512)
    # at V4's vocabulary the lane stops at 128 rows: its logits' bytes are capped, the drafter's grow
    v4 = tiny_config(vocab_size=129_280, sliding_window=32)
    assert speculative_graph_bytes(v4, EngineConfig(max_num_seqs=256, num_speculative_tokens=1)) == \
        4 * 129_280 * (128 + 512)


def test_greedy_lane_rows_scale_with_the_vocabulary() -> None:
    from deepinfer.models.fast.verify_graphs import GREEDY_LOGITS_BYTES, greedy_lane_max_rows

    assert greedy_lane_max_rows(129_280) == 128  # V4 / V4.1: 66 MB of float32 logits
    assert greedy_lane_max_rows(8192) == GREEDY_LOGITS_BYTES // (4 * 8192) >= 256 * 6  # the default: DSpark k=5 x 256
    assert greedy_lane_max_rows(10**7) == 128  # never below the floor
    with pytest.raises(ValueError, match="vocab_size"):
        greedy_lane_max_rows(0)


def test_step_memory_is_kept_cached_only_on_cuda_with_a_profile() -> None:
    """The first generate's activations stay in the CUDA caching allocator; off CUDA, or with
    no profile (a lazy graph reserve), nothing is allocated."""
    from deepinfer.engine.memory_profile import MemoryProfile, keep_step_memory

    profile = MemoryProfile(step_peak_bytes=1 << 20, graph_bytes=0)
    assert keep_step_memory(profile, torch.device("cpu")) == 0
    assert keep_step_memory(None, torch.device("cuda")) == 0
    assert keep_step_memory(MemoryProfile(0, 0), torch.device("cuda")) == 0
    if torch.cuda.is_available():
        assert keep_step_memory(profile, torch.device("cuda")) == 1 << 20
        assert torch.cuda.memory_reserved() >= 1 << 20  # cached, not returned to the driver
