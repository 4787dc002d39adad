"""Write the trained model as official-layout checkpoints.

* `<out>/` : the model and its MTP stage, FP8 e4m3 block-scaled linears (128 x 128, E8M0
  scales), FP4 routed experts, bf16 embedding / head, plus the corpus tokenizer.
* `<out>/dspark/` : the DSpark drafter stages only (`mtp.{0,1,2}.*`, same storage) and the
  config of the DSpark variant, with its fitted confidence temperatures; the engine joins
  them with the model's weights on first use (`deepinfer.models.default_model`), so the
  repository stores the shared weights once.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import torch
from safetensors.torch import save_file

from deepinfer.models.default_model import DSPARK_FILE, DSPARK_SUBDIR
from deepinfer.models.tiny import official_state_dict, save_checkpoint
from deepinfer.models.v4.config import DeepseekV4Config
from deepinfer.models.v4.model import DeepseekV4Model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _quantized(cfg: DeepseekV4Config) -> DeepseekV4Config:
    return replace(cfg, fp8_block=cfg.fp8_block or (128, 128), expert_dtype=cfg.expert_dtype or "fp4")


def export_model(model: DeepseekV4Model, cfg: DeepseekV4Config, tokenizer_dir: str, out_dir: str) -> str:
    """The model + MTP stage, quantized, with the tokenizer files; returns out_dir."""
    bf16 = DeepseekV4Model(cfg, torch.bfloat16)
    bf16.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    # shards of <= 12 MiB: small enough for any file-size limit on the way (and to diff)
    save_checkpoint(bf16, out_dir, quantize=True, max_shard_bytes=12 << 20, copy_tokenizer=False)
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out_dir, name))
    return out_dir


def export_dspark(model: DeepseekV4Model, stages: torch.nn.ModuleList, dcfg: DeepseekV4Config, out_dir: str) -> str:
    """The DSpark stages (quantized) and the DSpark variant's config.json under out_dir/dspark."""
    full = DeepseekV4Model(dcfg, torch.bfloat16)
    main = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    missing, unexpected = full.load_state_dict(main, strict=False)
    if unexpected or any(not k.startswith("mtp.") for k in missing):
        raise RuntimeError(f"DSpark variant does not match the model: missing {missing}, unexpected {unexpected}")
    full.mtp.load_state_dict({k: v.detach().cpu() for k, v in stages.state_dict().items()})
    qcfg = _quantized(dcfg)
    tensors = {k: v for k, v in official_state_dict(full, True, qcfg).items() if k.startswith("mtp.")}
    path = os.path.join(out_dir, DSPARK_SUBDIR)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, DSPARK_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(qcfg.to_official_json(), f, indent=2)
    return path


def checkpoint_bytes(path: str) -> int:
    """Bytes of every file under path (what the repository stores)."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
