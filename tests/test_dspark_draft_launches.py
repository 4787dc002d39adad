"""A graphed DSpark draft step (the stages' block pass, the head, the Markov bias, the
confidence head and the block's greedy draws), and the graphed write of a verify step's
context K/V, launch few kernels and never sync with the host: inside a CUDA graph every kernel still costs its few microseconds, and at small
batches the draft step is made of small kernels. Counted on CPU with the interpreted
Triton kernels, V4 and V4.1 (three stages each)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import LLM  # noqa: E402
from deepinfer.models.fast.draft_dspark import INPUT_COLUMNS  # noqa: E402
from deepinfer.models.fast.launches import LaunchCounter  # noqa: E402
from deepinfer.models.tiny import tiny_dspark_config, tiny_v41_config, write_tiny_checkpoint  # noqa: E402

#: Kernels one greedy draft step of k=5 may launch (at the time of writing 98 for V4 and 99
#: for V4.1; 418 / 455 when each stage's attention ran the reference modules and every draw
#: rebuilt its sampling tensors); more means a fusion was undone.
MAX_LAUNCHES = 100


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_graphed_draft_step_launch_budget(tmp_path, monkeypatch, family):
    make = tiny_dspark_config if family == "v4" else tiny_v41_config
    write_tiny_checkpoint(str(tmp_path), seed=3, cfg=make(vocab_size=512, sliding_window=32), dtype=torch.bfloat16)
    monkeypatch.setenv("DEEPINFER_FASTPATH", "triton")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")  # the graphs' buffers, replays emulated eagerly
    llm = LLM(str(tmp_path), dtype="bfloat16", max_model_len=256, max_num_seqs=4, num_speculative_tokens=5)
    drafter = llm.runner.spec.drafter
    assert drafter.graphs is not None
    # one greedy block at position 40 (the body only reads the cache: any context slots do)
    inp = torch.zeros(1, drafter.graphs.cols, dtype=torch.int64)
    cols = dict(zip(INPUT_COLUMNS, range(len(INPUT_COLUMNS))))
    inp[0, cols["last_token"]], inp[0, cols["last_pos"]], inp[0, cols["greedy"]] = 7, 40, 1
    inp[0, cols["temperature_bits"]] = int(torch.tensor(1.0).view(torch.int32))
    with torch.no_grad():
        drafter.graphs.body(inp, True)  # first use concatenates fused weights, as a capture's warm-up does
        step = LaunchCounter()
        with step:
            packed, q = drafter.graphs.body(inp, True)
    assert packed.shape == (1, 10) and q is None  # 5 tokens, 5 confidences; greedy: no distributions
    assert step.host_syncs == 0
    stages = len(drafter.stages)
    # each stage's attention: the query's and kv's norm + RoPE fused, the block attention and
    # the output's inverse RoPE one kernel; the block's five greedy draws five kernels + a fold
    assert step.triton["_norm_rope_kernel"] == 2 * stages
    assert step.triton["_block_attention_kernel"] == stages
    assert step.triton["_draw_kernel"] == 5 and step.triton["_last_kernel"] == 1
    assert step.torch_ops["argmax"] == 0 and step.torch_ops["bmm"] == 0
    assert step.torch_ops["pow"] == 0, "an RMSNorm ran as torch ops"
    assert step.total <= MAX_LAUNCHES, step.summary()

    # the context K/V of a verify step's rows: main_proj + main_norm, every stage's wkv in one
    # GEMM, per stage one norm + RoPE and one scatter (the reference modules: ~97 launches)
    width = len(drafter.target_layers) * drafter.cfg.hidden_size
    feats = torch.randn(2, width, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ints = torch.tensor([[40, 41], [0, 1]])
    write = LaunchCounter()
    with write, torch.no_grad():
        drafter.feature_graphs.body(feats, ints)
    assert write.host_syncs == 0 and write.torch_ops["pow"] == 0
    assert write.triton["_norm_rope_kernel"] == stages
    assert write.total <= 3 * stages + 4, write.summary()
