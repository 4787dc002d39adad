"""The embedded models and their names.

* ``deepinfer-tiny`` (the default of ``LLM()``): the small V4-architecture model trained by
  ``deepinfer.train`` and committed under ``datasets/models/deepinfer-tiny`` (FP8 / FP4
  official layout, its own BPE tokenizer, one MTP stage; model card beside it).
* ``deepinfer-tiny-dspark``: the same model with its DSpark drafter. The repository stores
  only the drafter stages (``deepinfer-tiny/dspark/``); the full checkpoint is joined from
  both on first use into the cache directory (``DEEPINFER_CACHE_DIR``).
* ``deepinfer-tiny-random``: the random-weight tiny checkpoint with the real 129,280-token
  vocabulary (``deepinfer.models.tiny``), for tests that need the V4 tokenizer or
  arbitrary shapes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer import envs

from .loader import CheckpointError, shard_files

TRAINED = "deepinfer-tiny"
TRAINED_DSPARK = "deepinfer-tiny-dspark"
RANDOM = "deepinfer-tiny-random"
DSPARK_SUBDIR, DSPARK_FILE = "dspark", "dspark.safetensors"
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "README.md")


def packaged_model_dir() -> Path:
    """Where the trained default lives in a source checkout."""
    return Path(__file__).resolve().parents[2] / "datasets" / "models" / TRAINED


def _cache_root() -> Path:
    return Path(envs.DEEPINFER_CACHE_DIR)


def trained_model_dir() -> str:
    """The trained default checkpoint; a clear error if this install does not carry it."""
    path = packaged_model_dir()
    if not (path / "config.json").exists():
        raise CheckpointError(f"the embedded model {TRAINED!r} is missing ({path} has no config.json): run deepinfer "
                              f"from a source checkout, or pass a checkpoint / set DEEPINFER_HF_MODEL_DIR")
    return str(path)


def dspark_model_dir() -> str:
    """The trained default with its DSpark drafter, joined on first use (cached by content hash)."""
    base = Path(trained_model_dir())
    overlay = base / DSPARK_SUBDIR
    if not (overlay / "config.json").exists():
        raise CheckpointError(f"{overlay} has no DSpark drafter (config.json missing)")
    digest = hashlib.sha256()
    for file in [*shard_files(str(base)), str(overlay / DSPARK_FILE), str(overlay / "config.json")]:
        digest.update(Path(file).read_bytes())
    out = _cache_root() / f"{TRAINED_DSPARK}-{digest.hexdigest()[:12]}"
    if (out / "config.json").exists():
        return str(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    join_dspark(str(base), str(overlay), str(tmp))
    if not out.exists():
        os.replace(tmp, out)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def join_dspark(base: str, overlay: str, out: str) -> str:
    """Write a checkpoint with base's non-MTP tensors, overlay's `mtp.*` tensors and
    overlay's config.json (the DSpark variant), plus base's tokenizer and card."""
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for file in shard_files(base):
        with safe_open(file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if not k.startswith("mtp.")})
    with safe_open(os.path.join(overlay, DSPARK_FILE), "pt") as f:
        extra = {k: f.get_tensor(k) for k in f.keys()}
    if any(not k.startswith("mtp.") for k in extra):
        raise CheckpointError(f"{overlay}/{DSPARK_FILE} may only hold mtp.* tensors")
    tensors.update(extra)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(overlay, "config.json"), os.path.join(out, "config.json"))
    for name in _SIDE_FILES:
        if os.path.exists(os.path.join(base, name)):
            shutil.copy(os.path.join(base, name), os.path.join(out, name))
    with open(os.path.join(out, "joined_from.json"), "w") as f:
        json.dump({"base": base, "overlay": overlay}, f)
    return out


def resolve_model(model: str | None) -> str:
    """A checkpoint directory for `model`: an embedded model's name, a path, or None
    (DEEPINFER_HF_MODEL_DIR, else the trained default)."""
    model = model or os.environ.get("DEEPINFER_HF_MODEL_DIR") or TRAINED
    if model == TRAINED:
        return trained_model_dir()
    if model == TRAINED_DSPARK:
        return dspark_model_dir()
    if model == RANDOM:
        from .tiny import default_checkpoint_dir

        return default_checkpoint_dir()
    return model
