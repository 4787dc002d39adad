"""Load a DeepSeek-V4 checkpoint in the official Hugging Face layout.

Reads config.json and sharded safetensors (model.safetensors.index.json, or a single
model.safetensors) memory-mapped, maps official names (optionally `model.`-prefixed)
onto the model's parameters, dequantizes FP8 block-scaled and FP4 expert weights for
the reference path while keeping the raw bytes on `Linear.quantized` for kernels, and
fails with the tensor or field named on anything missing, misshapen or unknown.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .checkpoint_layout import strip_prefix
from .config import DeepseekV4Config
from .config_v41 import read_model_config
from .deepseek_v4 import DeepseekV4Model
from .deepseek_v41 import build_model
from .linear import Linear, QuantizedWeight
from .quant import dequantize_fp4, dequantize_fp8_block, infer_block_size



class CheckpointError(ValueError):
    """The checkpoint does not match the architecture its config describes."""


def resolve_model_dir(model: str | None) -> str:
    """A checkpoint directory from an explicit path or DEEPINFER_HF_MODEL_DIR."""
    path = model or os.environ.get("DEEPINFER_HF_MODEL_DIR")
    if not path:
        raise CheckpointError("no model given: pass a checkpoint directory or set DEEPINFER_HF_MODEL_DIR")
    if not os.path.isdir(path):
        raise CheckpointError(f"model directory {path!r} does not exist")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"model directory {path!r} has no config.json")
    return path


def shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path!r}")
    missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise CheckpointError(f"checkpoint shards listed in the index are missing: {missing}")
    return [os.path.join(path, f) for f in files]


def iter_tensors(path: str, show_progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard."""
    files = shard_files(path)
    for file in tqdm(files, desc="loading shards", disable=not show_progress):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
                ) -> tuple[torch.Tensor, QuantizedWeight | None]:
    if weight.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise CheckpointError(f"FP8 tensor {name} has no companion {name[:-len('weight')]}scale")
        try:
            if name.endswith("engram.embed.weight"):  # V4.1 Engram tables: one scale per row and 32
                block = (1, 32)
            else:
                block = infer_block_size(tuple(weight.shape), tuple(scale.shape))
            dense = dequantize_fp8_block(weight, scale, block, dtype=torch.float32).to(dtype)
        except ValueError as exc:
            raise CheckpointError(f"{name}: {exc}") from exc
        return dense, QuantizedWeight("fp8", weight, scale, block)
    if weight.dtype == torch.int8 and name.endswith(".weight"):
        if scale is None:
            raise CheckpointError(f"FP4 tensor {name} has no companion {name[:-len('weight')]}scale")
        expected = (weight.shape[0], weight.shape[1] * 2 // 32)
        if tuple(scale.shape) != expected:
            raise CheckpointError(f"{name}: FP4 scale shape {tuple(scale.shape)} != expected {expected}")
        dense = dequantize_fp4(weight, scale, 32, dtype=torch.float32).to(dtype)
        return dense, QuantizedWeight("fp4", weight, scale, (1, 32))
    return weight, None


def load_weights(model: DeepseekV4Model, path: str, strict: bool = True, show_progress: bool = False) -> dict:
    """Copy every checkpoint tensor into `model`. Returns the tensors kept aside
    (MTP stages the config does not ask for). Raises CheckpointError naming any missing / unexpected / misshapen tensor."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    owners = {name: mod for name, mod in model.named_modules()}
    raw: dict[str, torch.Tensor] = {}
    for name, tensor in iter_tensors(path, show_progress):
        raw[strip_prefix(name)] = tensor
    loaded, extra = set(), {}
    for name, tensor in raw.items():
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in raw:
            continue  # consumed with its weight
        if name not in params:
            if name.startswith(getattr(model, "ignored_prefixes", ())):  # e.g. V4.1's vision tower
                extra[name] = tensor
                continue
            if name.startswith("mtp.") and int(name.split(".")[1]) >= len(model.mtp):
                extra[name] = tensor  # stages beyond num_nextn_predict_layers: kept, unused
                continue
            if strict:
                raise CheckpointError(f"unexpected tensor {name!r} in checkpoint (not part of the configured model)")
            continue
        target = params[name]
        scale = raw.get(name[: -len("weight")] + "scale") if name.endswith(".weight") else None
        dense, quantized = _dequantize(name, tensor, scale, target.dtype)
        if tuple(dense.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(dense.shape)} in the checkpoint but the config implies "
                f"{tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(dense.to(target.dtype))
        owner = owners.get(name.rsplit(".", 1)[0])
        if quantized is not None and isinstance(owner, Linear):
            if quantized.fmt == "fp8":  # the FP8 GEMM reads these bytes where the weight lives
                quantized.data, quantized.scale = quantized.data.to(target.device), quantized.scale.to(target.device)
            owner.quantized = quantized
        loaded.add(name)
    missing = [n for n in params if n not in loaded]
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint at {path!r} is missing {len(missing)} tensor(s): {shown}")
    return extra


def parse_dtype(dtype: str | torch.dtype, cfg: DeepseekV4Config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        return names.get(cfg.torch_dtype, torch.bfloat16)
    if dtype not in names:
        raise CheckpointError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return names[dtype]


def load_model(model_dir: str | None = None, dtype: str | torch.dtype = "auto", device: str = "cpu",
               show_progress: bool = False) -> DeepseekV4Model:
    """Build the model described by `model_dir`/config.json and load its weights."""
    path = resolve_model_dir(model_dir)
    cfg = read_model_config(path)
    torch_dtype = parse_dtype(dtype, cfg)
    with torch.device("meta"):
        model = build_model(cfg, torch_dtype)
    model = model.to_empty(device=device)
    model.extra_tensors = load_weights(model, path, show_progress=show_progress)
    if hasattr(model, "bind_engram_tokenizer"):
        try:
            model.bind_engram_tokenizer(path)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
    model.model_dir = path
    return model.eval()
