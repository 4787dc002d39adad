"""The fast path's choice of w8a8 routed experts (FP8 experts x FP8 activations) and the
engine run through it: DEEPINFER_MOE_W8A8 picks, the engine's prefill and decode steps
take it, and the choice is real (the outputs move off the weight-only ones). The kernel
against its torch reference: tests/kernels/test_fused_moe_w8a8.py (the engine passes both
the same arguments through ``ops.fused_moe_w8a8``)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.errors import ConfigError  # noqa: E402
from deepinfer.models.fast import moe as fast_moe  # noqa: E402
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint  # noqa: E402

VOCAB = 512


def _experts(fmt: str = "fp8", n_experts: int = 8, inter: int = 64, block=(32, 32)) -> SimpleNamespace:
    return SimpleNamespace(fmt=fmt, block=block, w1=torch.empty(n_experts, inter, 1))


@pytest.mark.parametrize("mode,fmt,rows,hidden,want", [
    ("auto", "fp8", 10_000, 64, False),  # auto needs a CUDA step
    ("1", "fp8", 1, 64, True),
    ("0", "fp8", 10_000, 64, False),
    ("1", "fp4", 10_000, 64, False),  # FP4 experts have no w8a8 kernel
    ("1", "fp8", 10_000, 48, False),  # hidden not a multiple of the 32-column scale group
    ("1", "fp8-g16", 10_000, 64, False),  # 16-column groups: e4m3 dots need K >= 32
])
def test_w8a8_choice(monkeypatch, mode, fmt, rows, hidden, want):
    monkeypatch.setenv("DEEPINFER_MOE_W8A8", mode)
    x, ids = torch.empty(rows, hidden), torch.empty(rows, 2, dtype=torch.int32)
    experts = _experts("fp8", block=(32, 16)) if fmt == "fp8-g16" else _experts(fmt)
    assert fast_moe.w8a8_routed(experts, x, ids) is want


def test_w8a8_auto_choice():
    """auto: CUDA, prefill-sized per expert, V4-Flash-wide experts (measured faster there)."""
    rows, e, wide = fast_moe.W8A8_MIN_ROWS_PER_EXPERT, 256, fast_moe.W8A8_MIN_INTER
    assert fast_moe.w8a8_auto(True, rows * e, e, wide)
    assert not fast_moe.w8a8_auto(True, rows * e - 1, e, wide)  # decode-sized
    assert not fast_moe.w8a8_auto(True, rows * e, e, 512)  # mini's experts: slower there
    assert not fast_moe.w8a8_auto(False, rows * e, e, wide)


def test_w8a8_bad_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_MOE_W8A8", "yes")
    with pytest.raises(ConfigError, match="DEEPINFER_MOE_W8A8='yes'.*auto, 0, 1"):
        fast_moe.w8a8_routed(_experts(), torch.empty(4, 64), torch.empty(4, 2))


def test_engine_on_w8a8_experts(tmp_path, monkeypatch):
    cfg = tiny_config(vocab_size=VOCAB, sliding_window=32, index_topk=4, fp8_block=(32, 32), expert_dtype="fp8")
    write_tiny_checkpoint(str(tmp_path), seed=11, quantize=True, cfg=cfg)
    prompts = [[(5 * j + 2 * i + 1) % VOCAB for j in range(n)] for i, n in enumerate((3, 40))]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    calls = {"n": 0}
    kernel = fast_moe.w8a8_routed

    def counted(*args):
        chosen = kernel(*args)
        calls["n"] += chosen
        return chosen

    monkeypatch.setattr(fast_moe, "w8a8_routed", counted)
    outs = {}
    for ops, w8a8 in (("ref", "1"), ("ref", "0")):
        monkeypatch.setenv("DEEPINFER_FASTPATH", ops)
        monkeypatch.setenv("DEEPINFER_FAST_PREFILL", ops)
        monkeypatch.setenv("DEEPINFER_MOE_W8A8", w8a8)
        calls["n"] = 0
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, max_num_seqs=4, cpu_dense_weights=False)
        outs[ops, w8a8] = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        assert (calls["n"] > 0) == (w8a8 == "1"), (ops, w8a8, calls)
    for a, b in zip(outs["ref", "1"], outs["ref", "0"]):  # e4m3 activations: close, not equal
        assert len(a.token_ids) == len(b.token_ids) == 3
        assert math.isclose(a.logprobs[0], b.logprobs[0], rel_tol=0.2, abs_tol=0.2)
    moved = [abs(x - y) for a, b in zip(outs["ref", "1"], outs["ref", "0"]) for x, y in zip(a.logprobs, b.logprobs)]
    assert max(moved) > 1e-6, "w8a8 and weight-only experts gave identical log-probs: w8a8 did not run"
