"""A fast-path decode step launches few kernels and never syncs with the host (what makes
its CUDA graph cheap and capturable). Counted on CPU with the interpreted Triton kernels
on a tiny model with `mini`'s layer kinds (HCA and CSA, hash and routed MoE)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.fast.launches import count_fast_runs  # noqa: E402
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint  # noqa: E402

RATIOS = [128, 4, 128, 4]
#: Kernels the decode step may launch (measured at the time of writing: 135 here, i.e.
#: ~33 a layer with half of them CSA; `mini`'s 8 layers: 218); more means a fusion was undone.
MAX_LAUNCHES = 136


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
def test_decode_step_launch_budget(tmp_path, monkeypatch):
    cfg = tiny_config(vocab_size=512, num_hidden_layers=len(RATIOS), compress_ratios=RATIOS, num_hash_layers=2,
                      index_topk=4)
    write_tiny_checkpoint(str(tmp_path), seed=1, cfg=cfg, dtype=torch.bfloat16)
    monkeypatch.setenv("DEEPINFER_FASTPATH", "triton")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")  # the graph path's buffers, emulated eagerly
    llm = LLM(str(tmp_path), dtype="bfloat16", max_model_len=256, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with count_fast_runs(llm.runner.fast) as steps:
        llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5, 6, 7, 8]], sampling_params=sp, use_tqdm=False)
    assert len(steps) == 1, "the decode step ran on the fast path"
    step = steps[-1]
    assert step.host_syncs == 0
    layers = len(RATIOS)
    # fused mHC: one mix launch (the row kernel at decode sizes) and one finish per call
    assert step.triton["_mix_rows_kernel"] == step.triton["_finish_kernel"] == 2 * layers + 1
    assert step.triton["_mix_kernel"] == 0
    assert step.triton["_compressor_decode_kernel"] == len(RATIOS) + RATIOS.count(4)  # + the indexers'
    assert step.total <= MAX_LAUNCHES, step.summary()
