"""In-memory quantization (deepinfer/models/quant_online.py) gives the bytes a quantized
official checkpoint holds, and the model still runs."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models.registry import build_model
from deepinfer.models.linear import Linear
from deepinfer.models.quant_online import quantize_linears
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.models.tiny import init_random, official_state_dict, tiny_config


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_same_bytes_as_a_quantized_checkpoint(expert_dtype: str) -> None:
    cfg = tiny_config(vocab_size=256, sliding_window=32, index_topk=4, fp8_block=(32, 32), expert_dtype=expert_dtype)
    model = build_model(cfg, torch.float32)
    init_random(model, 7)
    want = official_state_dict(model, quantize=True, cfg=cfg)
    count = quantize_linears(model, expert_dtype, block=(32, 32))
    quantized = {n: m.quantized for n, m in model.named_modules() if isinstance(m, Linear) and m.quantized is not None}
    assert count == len(quantized) > 0
    assert sum(1 for n in want if n.endswith(".scale")) == count  # every quantized tensor of the layout
    for name, q in quantized.items():
        assert q.fmt == ("fp4" if ".experts." in name and expert_dtype == "fp4" else "fp8")
        assert torch.equal(q.data.view(torch.uint8), want[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(q.scale.view(torch.uint8), want[f"{name}.scale"].view(torch.uint8))
        assert model.get_submodule(name)._parameters.get("weight") is None  # dense copy dropped
    logits = StandaloneRunner(model.eval(), 1, 64).step([(0, list(range(1, 20)))])[0]
    assert torch.isfinite(logits).all()


def test_rejects_unknown_expert_format() -> None:
    model = build_model(tiny_config(vocab_size=256), torch.float32)
    with pytest.raises(ValueError, match="expert_dtype"):
        quantize_linears(model, "int4")
