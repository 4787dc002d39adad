"""Engine configuration refused up front: every set DEEPINFER_* variable is parsed in one
process too, kv_cache_memory_bytes is bounded by the host, and block_size is checked
against the checkpoint's KV layout before any weight loads."""

from __future__ import annotations

import time

import pytest

from deepinfer import LLM
from deepinfer.config import EngineConfig, host_memory_bytes
from deepinfer.errors import ConfigError


@pytest.mark.parametrize("name,value", [("DEEPINFER_DIST_TIMEOUT_S", "abc"), ("DEEPINFER_EPLB_WINDOW_SIZE", "zero"),
                                        ("DEEPINFER_DIST_HOST", "no such/host")])
def test_unread_env_values_are_checked_in_one_process(monkeypatch, name, value) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"{name}={value!r} is invalid; allowed"):
        EngineConfig.from_kwargs()
    with pytest.raises(ConfigError, match=name):
        LLM(max_model_len=128)


def test_kv_cache_bytes_bounded_by_the_host() -> None:
    host = host_memory_bytes()
    assert host and host > 2**30
    with pytest.raises(ConfigError, match=r"kv_cache_memory_bytes must be at most this host's memory"):
        EngineConfig.from_kwargs(kv_cache_memory_bytes=10**15, accelerator="cpu")
    assert EngineConfig.from_kwargs(kv_cache_memory_bytes=2**26, accelerator="cpu").kv_cache_memory_bytes == 2**26


def test_num_kv_blocks_bounded_by_the_host() -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"EngineConfig.num_kv_blocks must be at most \d+ on this host \(\d+ bytes "
                                          r"per block of 128 tokens"):
        LLM(num_kv_blocks=10**12, accelerator="cpu")
    assert time.monotonic() - start < 3, "refused before anything is allocated"
    assert EngineConfig.from_kwargs(num_kv_blocks=64, accelerator="cpu").num_kv_blocks == 64


@pytest.mark.parametrize("block_size", [1, 64])
def test_block_size_checked_against_the_checkpoint_before_loading(block_size) -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"EngineConfig.block_size must be a power of two that every compress "
                                          r"ratio of .*deepinfer-tiny divides.*ratio 128"):
        LLM(block_size=block_size)
    assert time.monotonic() - start < 3, "refused before the weights load"
    assert EngineConfig.from_kwargs(block_size=256).block_size == 256


_BAD_TYPED = [("compress_ratios", "0,4", "compress_ratios", "must be a list of integers"),
              ("compress_ratios", [0, "4"], "compress_ratios", r"compress_ratios\[1\] must be an integer"),
              ("kv_source_layer_ids", "2", "kv_source_layer_ids", "must be a list of integers"),
              ("index_source_layer_ids", [None], "index_source_layer_ids", r"\[0\] must be an integer"),
              ("engram_layer_ids", [1.5], "engram_layer_ids", r"\[0\] must be an integer, got 1.5"),
              ("candidate_source_layer_id", "1", "candidate_source_layer_id", "must be an integer"),
              ("dspark_target_layer_ids", "1", "dspark_target_layer_ids", "must be a list"),
              ("quantization_config", {"weight_block_size": "128"}, "quantization_config.weight_block_size",
               "must be a list of integers"),
              ("quantization_config", "fp8", "quantization_config", "must be an object"),
              ("rope_scaling", "yarn", "rope_scaling", "must be an object or null")]


_V4_KEYS = ("compress_ratios", "quantization_config", "rope_scaling")  # the others are V4.1's only


@pytest.mark.parametrize("family,key,value,field,match",
                         [("v41", *case) for case in _BAD_TYPED] + [("v4", *c) for c in _BAD_TYPED if c[0] in _V4_KEYS])
def test_config_json_values_of_the_wrong_type_name_their_field(family, key, value, field, match) -> None:
    """Every list / int / object value the family parsers read is type-checked with its key
    (before, ``compress_ratios: "04"`` became [0, 4] and "0,4" failed in ``int()`` unnamed)."""
    from deepinfer.models.tiny import tiny_config, tiny_v41_config

    cfg = tiny_config() if family == "v4" else tiny_v41_config()
    raw = cfg.to_official_json()
    text = dict(raw["text_config"]) if "text_config" in raw else raw
    text[key] = value
    if "text_config" in raw:
        raw = {**raw, "text_config": text}
    with pytest.raises(ConfigError, match=match) as info:
        type(cfg).from_dict(raw)
    assert info.value.field == field


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_config_flat_v4_rates_and_image_token_named(family) -> None:
    from deepinfer.models.tiny import tiny_config, tiny_v41_config

    if family == "v4":
        raw = {**tiny_config().to_official_json(), "compress_rate_csa": "4"}
        with pytest.raises(ConfigError, match="compress_rate_csa must be an integer") as info:
            type(tiny_config()).from_dict(raw)
        assert info.value.field == "compress_rate_csa"
    else:
        raw = {**tiny_v41_config().to_official_json(), "image_token_id": "5"}
        with pytest.raises(ConfigError, match="image_token_id must be an integer") as info:
            type(tiny_v41_config()).from_dict(raw)
        assert info.value.field == "image_token_id"


def test_gpu_memory_bounds_checked_against_the_device(monkeypatch) -> None:
    """On CUDA the bound is torch.cuda.mem_get_info's total (this box has no GPU, so the
    device's answer is stood in: 80 GiB total, 70 GiB free); the CPU path is the host's."""
    import deepinfer.config as config_mod

    gib = 2**30
    monkeypatch.setattr(config_mod, "device_memory_bytes", lambda: (70 * gib, 80 * gib))
    with pytest.raises(ConfigError, match=r"kv_cache_memory_bytes must be at most the GPU's memory \(85899345920 "
                                          r"bytes, torch.cuda.mem_get_info\)") as info:
        EngineConfig.from_kwargs(kv_cache_memory_bytes=81 * gib, accelerator="nvidia")
    assert info.value.field == "kv_cache_memory_bytes"
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be above 0.125, the fraction of the GPU "
                                          r"already in use") as info:
        EngineConfig.from_kwargs(gpu_memory_utilization=0.1, accelerator="nvidia")
    assert info.value.field == "gpu_memory_utilization"
    with pytest.raises(ConfigError, match=r"num_kv_blocks must be at most \d+ on this GPU"):
        EngineConfig.from_kwargs(num_kv_blocks=10**12, accelerator="nvidia")
    ok = EngineConfig.from_kwargs(kv_cache_memory_bytes=8 * gib, gpu_memory_utilization=0.9, num_kv_blocks=64,
                                  accelerator="nvidia")
    assert (ok.kv_cache_memory_bytes, ok.num_kv_blocks) == (8 * gib, 64)
    with pytest.raises(ConfigError, match=r"kv_cache_memory_bytes must be at most this host's memory"):
        EngineConfig.from_kwargs(kv_cache_memory_bytes=10**15, accelerator="cpu")  # CPU: the host bound
