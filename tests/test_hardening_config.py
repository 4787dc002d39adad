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
