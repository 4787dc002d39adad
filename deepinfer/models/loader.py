"""Load a DeepSeek-V4 checkpoint in the official Hugging Face layout.

Reads config.json and sharded safetensors (model.safetensors.index.json, or a single
model.safetensors) memory-mapped, maps official names (optionally `model.`-prefixed, or
as transformers' `save_pretrained` writes them: checkpoint_layout.official_name) onto the
model's parameters and fails with the tensor or field named on anything missing,
misshapen or unknown. A checkpoint without any `mtp.*` tensor loads without its MTP stage. Quantized Linears (FP8 block-scaled, FP4 experts) keep
ONE representation: the checkpoint bytes on `Linear.quantized` (the FP8 GEMM and the
weight-only FP8 / FP4 fused MoE kernels read them on CUDA; elsewhere they are
dequantized per call).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from deepinfer.errors import DeepInferError

from .checkpoint_files import CheckpointError, open_shard, regular_file, shard_files, shard_headers
from .checkpoint_layout import official_name
from .linear import Linear, QuantizedWeight
from .quant import infer_block_size
from .registry import build_model, read_model_config
from .v4.config import DeepseekV4Config
from .v4.model import DeepseekV4Model

__all__ = ["CheckpointError", "resolve_model_dir", "shard_files", "iter_tensors", "read_checkpoint", "load_weights",
           "load_model", "check_config_against_files", "check_finite", "weight_bytes", "materialize_dense_weights"]


def resolve_model_dir(model: str | None) -> str:
    """A checkpoint directory from an explicit path or DEEPINFER_HF_MODEL_DIR."""
    path = model or os.environ.get("DEEPINFER_HF_MODEL_DIR")
    if not path:
        raise CheckpointError("no model given: pass a checkpoint directory or set DEEPINFER_HF_MODEL_DIR")
    if not os.path.isdir(path):
        raise CheckpointError(f"model directory {path!r} does not exist")
    if not os.path.lexists(os.path.join(path, "config.json")):
        raise CheckpointError(f"model directory {path!r} has no config.json")
    regular_file(os.path.join(path, "config.json"), "config")
    return path


def iter_shard_tensors(path: str, show_progress: bool = False) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, shard file) for every tensor of every shard."""
    files = shard_files(path)
    for file in tqdm(files, desc="loading shards", disable=not show_progress):
        with open_shard(file) as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:  # noqa: BLE001 - a truncated data section
                    raise CheckpointError(f"checkpoint shard {file}: tensor {name!r} cannot be read (truncated "
                                          f"file?): {exc}") from None
                yield name, tensor, file


def iter_tensors(path: str, show_progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard."""
    for name, tensor, _ in iter_shard_tensors(path, show_progress):
        yield name, tensor


def read_checkpoint(path: str, show_progress: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by official name (`model.` prefix stripped, transformers'
    `save_pretrained` names mapped: checkpoint_layout.official_name). Two stored tensors
    with one official name are an error naming both."""
    out = CheckpointTensors()
    for name, tensor, file in iter_shard_tensors(path, show_progress):
        official = official_name(name)
        if official in out:
            raise CheckpointError(f"checkpoint at {path!r} stores {official!r} twice: as "
                                  f"{out.stored_names[official]!r} and as {name!r}")
        out[official], out.stored_names[official], out.files[official] = tensor, name, file
    return out


class CheckpointTensors(dict):
    """Tensors by official name; ``stored_names``: official name -> the name in the file;
    ``files``: official name -> the shard holding it."""

    def __init__(self) -> None:
        super().__init__()
        self.stored_names: dict[str, str] = {}
        self.files: dict[str, str] = {}


_LAYER = re.compile(r"^layers\.(\d+)\.")
_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")


def check_config_against_files(cfg: DeepseekV4Config, path: str) -> None:
    """Before anything is built: the sizes config.json claims must match the tensors the
    shard headers declare (vocab / hidden size from the embedding, the layer count, the
    routed-expert count), so a config with ``hidden_size: 2**20`` or ``n_routed_experts:
    100000`` fails at once, naming the field and the file, instead of allocating for it."""
    headers = {official_name(n): v for n, v in shard_headers(shard_files(path)).items()}
    config = os.path.join(path, "config.json")
    embed = headers.get("embed.weight")
    if embed is not None and embed[1] != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"{config}: vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size} imply "
                              f"embed.weight {(cfg.vocab_size, cfg.hidden_size)}, but {embed[2]} stores "
                              f"{embed[1]}")
    layers = {int(m.group(1)) for n in headers if (m := _LAYER.match(n))}
    if layers and max(layers) + 1 != cfg.num_hidden_layers:
        raise CheckpointError(f"{config}: num_hidden_layers={cfg.num_hidden_layers}, but the shards hold layers "
                              f"0..{max(layers)}")
    experts = {int(m.group(1)) for n in headers if (m := _EXPERT.match(n))}
    if experts and max(experts) + 1 != cfg.n_routed_experts:
        raise CheckpointError(f"{config}: n_routed_experts={cfg.n_routed_experts}, but the shards hold experts "
                              f"0..{max(experts)}")


def _nonfinite(t: torch.Tensor) -> int:
    """How many NaN / Inf values ``t`` holds (FP8 / E8M0 checked on their bit patterns)."""
    if t.dtype == torch.float8_e4m3fn:  # no inf; NaN is S.1111.111
        return int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if getattr(torch, "float8_e8m0fnu", None) is not None and t.dtype == torch.float8_e8m0fnu:
        return int((t.view(torch.uint8) == 0xFF).sum())
    if t.is_floating_point():
        return int((~torch.isfinite(t.float() if t.element_size() < 2 else t)).sum())
    return 0


def check_finite(raw: dict[str, torch.Tensor]) -> None:
    """Every floating-point checkpoint tensor must be finite (NaN weights would make the
    model emit one token forever); the error names the tensor and its shard."""
    for name, t in raw.items():
        bad = _nonfinite(t)
        if bad:
            file = getattr(raw, "files", {}).get(name, "?")
            raise CheckpointError(f"checkpoint tensor {_named(raw, name)} in {file} holds {bad} NaN/Inf value(s) "
                                  f"of {t.numel()}; the weights are corrupt")


def _named(raw: dict[str, torch.Tensor], name: str) -> str:
    """``'name'`` or ``'name' (stored as 'model.…')`` for error messages."""
    stored = getattr(raw, "stored_names", {}).get(name, name)
    return repr(name) if stored == name else f"{name!r} (stored as {stored!r})"


def without_absent_mtp(cfg: DeepseekV4Config, raw: dict[str, torch.Tensor]) -> DeepseekV4Config:
    """The config to build when the checkpoint has no `mtp.*` tensor at all although its
    config counts next-n stages (what transformers' `save_pretrained` writes: it keeps
    num_nextn_predict_layers but drops the stage): no MTP stage. Speculation then fails
    with a ConfigError (deepinfer.spec.require_draft_stages). A partial stage, or a DSpark
    config, stays an error naming the missing tensors."""
    if not cfg.num_nextn_predict_layers or cfg.has_dspark or any(n.startswith("mtp.") for n in raw):
        return cfg
    return replace(cfg, num_nextn_predict_layers=0, mtp_compress_ratios=[])


def _parse_quantized(name: str, weight: torch.Tensor, scale: torch.Tensor | None) -> QuantizedWeight | None:
    """The checkpoint bytes of an FP8 / FP4 weight (validated), or None for a dense tensor."""
    if weight.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise CheckpointError(f"FP8 tensor {name} has no companion {name[:-len('weight')]}scale")
        try:
            if name.endswith("engram.embed.weight"):  # V4.1 Engram tables: one scale per row and 32
                block = (1, 32)
            else:
                block = infer_block_size(tuple(weight.shape), tuple(scale.shape))
        except ValueError as exc:
            raise CheckpointError(f"{name}: {exc}") from exc
        return QuantizedWeight("fp8", weight, scale, block)
    if weight.dtype == torch.int8 and name.endswith(".weight"):
        if scale is None:
            raise CheckpointError(f"FP4 tensor {name} has no companion {name[:-len('weight')]}scale")
        expected = (weight.shape[0], weight.shape[1] * 2 // 32)
        if tuple(scale.shape) != expected:
            raise CheckpointError(f"{name}: FP4 scale shape {tuple(scale.shape)} != expected {expected}")
        return QuantizedWeight("fp4", weight, scale, (1, 32))
    return None


def _logical_shape(q: QuantizedWeight) -> tuple[int, ...]:
    shape = tuple(q.data.shape)
    return shape if q.fmt == "fp8" else (*shape[:-1], 2 * shape[-1])


def keeps_bytes_only(fmt: str, device: torch.device | str) -> bool:
    """Whether a quantized Linear keeps only its checkpoint bytes (no dense copy) there:
    always. On CUDA the FP8 GEMM and the fast path's FP8 / FP4 MoE kernels read them
    (the reference path dequantizes per call, as every other device does)."""
    return fmt in ("fp8", "fp4")


def _quantized_weight_names(raw: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> 'fp8' | 'fp4' for the quantized weights of a checkpoint (by dtype)."""
    out = {}
    for name, t in raw.items():
        if name.endswith(".weight") and name[: -len("weight")] + "scale" in raw:
            if t.dtype == torch.float8_e4m3fn:
                out[name] = "fp8"
            elif t.dtype == torch.int8:
                out[name] = "fp4"
    return out


def drop_dense_weights(model: torch.nn.Module, raw: dict[str, torch.Tensor], device: torch.device | str) -> int:
    """Before the model is materialised: remove the dense weight of every Linear that will
    keep only its checkpoint bytes on ``device``, so it is never allocated. Returns how many."""
    owners = dict(model.named_modules())
    dropped = 0
    for name, fmt in _quantized_weight_names(raw).items():
        owner = owners.get(name.rsplit(".", 1)[0])
        if isinstance(owner, Linear) and owner._parameters.get("weight") is not None and keeps_bytes_only(fmt, device):
            owner.weight = None
            dropped += 1
    return dropped


def materialize_dense_weights(model: torch.nn.Module) -> int:
    """Give every bytes-only quantized Linear its dequantized weight back (the bytes stay).
    For small models on the CPU reference path, where dequantizing every weight at every
    call costs several times the step itself. Returns how many weights were materialised."""
    count = 0
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.quantized is not None and mod._parameters.get("weight") is None:
            mod.weight = torch.nn.Parameter(mod.quantized.dequantize(mod.compute_dtype), requires_grad=False)
            count += 1
    return count


def load_weights(model: DeepseekV4Model, path: str, strict: bool = True, show_progress: bool = False,
                 raw: dict[str, torch.Tensor] | None = None) -> dict:
    """Copy every checkpoint tensor into `model` (``raw``: the tensors, if already read).
    Quantized Linears keep only their bytes where :func:`keeps_bytes_only` says so (a dense
    weight still present is dropped), others get the dequantized weight. Returns the tensors
    kept aside (MTP stages the config does not ask for). Raises CheckpointError naming any
    missing / unexpected / misshapen tensor."""
    if raw is None:
        raw = read_checkpoint(path, show_progress)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    device = next(iter(params.values())).device
    owners = {name: mod for name, mod in model.named_modules()}
    bytes_only = {f"{n}.weight" for n, m in owners.items()
                  if isinstance(m, Linear) and "weight" in m._parameters and m._parameters["weight"] is None}
    loaded, extra = set(), {}
    for name, tensor in raw.items():
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in raw:
            continue  # consumed with its weight
        if name not in params and name not in bytes_only:
            if name.startswith(getattr(model, "ignored_prefixes", ())):  # e.g. V4.1's vision tower
                extra[name] = tensor
                continue
            if name.startswith("mtp.") and int(name.split(".")[1]) >= len(model.mtp):
                extra[name] = tensor  # stages beyond num_nextn_predict_layers: kept, unused
                continue
            if strict:
                raise CheckpointError(f"unexpected tensor {_named(raw, name)} in checkpoint (not part of the "
                                      "configured model)")
            continue
        scale = raw.get(name[: -len("weight")] + "scale") if name.endswith(".weight") else None
        quantized = _parse_quantized(name, tensor, scale)
        owner = owners.get(name.rsplit(".", 1)[0])
        if isinstance(owner, Linear) and quantized is not None and (
                name in bytes_only or keeps_bytes_only(quantized.fmt, device)):
            want = (owner.out_features, owner.in_features)
            if _logical_shape(quantized) != want:
                raise CheckpointError(f"tensor {_named(raw, name)} has shape {_logical_shape(quantized)} in the "
                                      f"checkpoint but the config implies {want}")
            owner.quantized = QuantizedWeight(quantized.fmt, quantized.data.to(device), quantized.scale.to(device),
                                              quantized.block)
            if owner._parameters.get("weight") is not None:
                owner.weight = None  # loaded into a materialised model: free its dense copy
        else:
            if name in bytes_only:
                raise CheckpointError(f"tensor {name!r} is not quantized in the checkpoint")
            target = params[name]
            dense = quantized.dequantize(target.dtype) if quantized is not None else tensor
            if tuple(dense.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"tensor {_named(raw, name)} has shape {tuple(dense.shape)} in the checkpoint but the config "
                    f"implies {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(dense.to(target.dtype))
        loaded.add(name)
    missing = [n for n in [*params, *sorted(bytes_only)] if n not in loaded]
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint at {path!r} is missing {len(missing)} tensor(s): {shown}")
    return extra


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes the model's weights take: dense parameters + buffers, and checkpoint bytes
    (+ scales) held by quantized Linears."""
    dense = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    quantized = sum(m.quantized.nbytes() for m in model.modules() if isinstance(m, Linear) and m.quantized is not None)
    return {"dense": dense, "quantized": quantized, "total": dense + quantized}


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
    try:
        cfg = read_model_config(path)
    except DeepInferError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:  # a value of the wrong type
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: malformed value "
                              f"({type(exc).__name__}: {exc})") from None
    check_config_against_files(cfg, path)  # before anything is built or allocated
    torch_dtype = parse_dtype(dtype, cfg)
    raw = read_checkpoint(path, show_progress)
    check_finite(raw)
    cfg = without_absent_mtp(cfg, raw)
    with torch.device("meta"):
        model = build_model(cfg, torch_dtype)
    drop_dense_weights(model, raw, device)  # never allocate what only the checkpoint bytes will hold
    model = model.to_empty(device=device)
    model.extra_tensors = load_weights(model, path, raw=raw)
    if hasattr(model, "bind_engram_tokenizer"):
        try:
            model.bind_engram_tokenizer(path)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
    model.model_dir = path
    return model.eval()
