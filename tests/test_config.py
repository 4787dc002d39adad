"""Tests for deepinfer.config.EngineConfig (kwargs, env parsing, validation, describe)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deepinfer.config as cfgmod
from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make accelerator auto-detection deterministic ('cpu')."""
    monkeypatch.setattr(cfgmod, "detect_accelerator", lambda: "cpu")


def test_defaults() -> None:
    c = EngineConfig.from_kwargs(environ={})
    assert c.model is None and c.tokenizer is None and c.dtype == "auto" and c.seed == 0
    assert c.max_num_seqs == 256 and c.max_num_batched_tokens == 8192
    assert c.max_model_len is None and c.gpu_memory_utilization == 0.9
    assert c.kv_cache_memory_bytes == cfgmod.DEFAULT_CPU_KV_CACHE_BYTES == 2 * 1024**3
    assert c.block_size == 128 and c.chunked_prefill and c.enable_prefix_caching
    assert c.expert_parallel_size == 1 and c.data_parallel_size == 1
    assert c.accelerator == "cpu" and not c.batch_invariant
    assert c.num_speculative_tokens == 0 and not c.enable_mtp_varlen
    assert c.async_scheduling and not c.deterministic  # async scheduling is the default loop
    assert c.sources["accelerator"] == "derived"
    assert EngineConfig() == c  # direct construction needs no environment


def test_gpu_kv_budget_left_to_memory_utilization() -> None:
    assert EngineConfig(accelerator="nvidia").kv_cache_memory_bytes is None


@pytest.mark.parametrize("raw,value", [("1", True), ("0", False), ("TRUE", True),
                                       ("false", False), ("True", True)])
def test_env_bools(raw: str, value: bool) -> None:
    # one at a time: both on together is rejected (tests/test_batch_invariance.py)
    c = EngineConfig.from_kwargs(environ={"DEEPINFER_BATCH_INVARIANT": raw})
    m = EngineConfig.from_kwargs(environ={"DEEPINFER_ENABLE_MTP_VARLEN": raw})
    assert c.batch_invariant is value and m.enable_mtp_varlen is value
    assert c.sources["batch_invariant"] == "env DEEPINFER_BATCH_INVARIANT"


def test_env_values() -> None:
    c = EngineConfig.from_kwargs(environ={
        "DEEPINFER_HF_MODEL_DIR": "/ckpt/v41", "DEEPINFER_ACCELERATOR": "Ascend",
        "DEEPINFER_USE_NEXTN_DECODE": "5", "DEEPINFER_BATCH_INVARIANT": "1",
        "DEEPINFER_ENABLE_MTP_VARLEN": "0"})
    assert c.model == "/ckpt/v41" and c.accelerator == "ascend"
    assert c.num_speculative_tokens == 5 and c.deterministic
    assert c.kv_cache_memory_bytes is None


@pytest.mark.parametrize("var,raw,allowed", [
    ("DEEPINFER_BATCH_INVARIANT", "yes", "0, 1, true, false"),
    ("DEEPINFER_ENABLE_MTP_VARLEN", " 1", "0, 1, true, false"),
    ("DEEPINFER_BATCH_INVARIANT", "", "0, 1, true, false"),
    ("DEEPINFER_USE_NEXTN_DECODE", "-1", "an integer >= 0"),
    ("DEEPINFER_USE_NEXTN_DECODE", "five", "an integer >= 0"),
    ("DEEPINFER_ACCELERATOR", "tpu", "nvidia, ascend, cpu, auto"),
    ("DEEPINFER_HF_MODEL_DIR", "", "non-empty path"),
])
def test_env_bad_values(var: str, raw: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(environ={var: raw})
    assert var in str(info.value) and repr(raw) in str(info.value)
    assert allowed in str(info.value) and info.value.field == var


def test_env_typo_is_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(environ={"DEEPINFER_BATCH_INVARIENT": "1", "PATH": "/bin"})
    msg = str(info.value)
    assert "DEEPINFER_BATCH_INVARIENT" in msg and "DEEPINFER_BATCH_INVARIANT" in msg


def test_register_env_var_is_a_no_op_for_declared_names() -> None:
    """Variables are declared in deepinfer/envs.py only; the old call is kept for modules
    written before it (a no-op for a declared name, an error pointing there otherwise)."""
    known = dict(cfgmod.KNOWN_ENV_VARS)
    cfgmod.register_env_var("DEEPINFER_FASTPATH", "another description")
    cfgmod.register_env_var("DEEPINFER_FASTPATH", "another description")
    assert cfgmod.KNOWN_ENV_VARS == known
    with pytest.raises(ValueError, match="deepinfer/envs.py"):
        cfgmod.register_env_var("DEEPINFER_TEST_ONLY_FLAG", "not declared")
    with pytest.raises(ValueError):
        cfgmod.register_env_var("OTHER_FLAG", "no prefix")


def test_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in __import__("os").environ if k.startswith("DEEPINFER_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    assert EngineConfig.from_kwargs().num_speculative_tokens == 3


def test_kwargs_override_env() -> None:
    env = {"DEEPINFER_BATCH_INVARIANT": "1", "DEEPINFER_HF_MODEL_DIR": "/env/model",
           "DEEPINFER_USE_NEXTN_DECODE": "4"}
    c = EngineConfig.from_kwargs(environ=env, batch_invariant=False, model="/kw/model",
                                 num_speculative_tokens=0)
    assert not c.batch_invariant and c.model == "/kw/model" and c.num_speculative_tokens == 0
    assert c.sources["model"] == "kwarg"
    # model=None falls back to the env checkpoint dir
    assert EngineConfig.from_kwargs(environ=env, model=None).model == "/env/model"


def test_unknown_kwargs() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(environ={}, max_num_seq=8, foo=1)
    msg = str(info.value)
    assert "'foo'" in msg and "'max_num_seq'" in msg and "did you mean 'max_num_seqs'" in msg


@pytest.mark.parametrize("kwargs,field,fragment", [
    ({"dtype": "fp8"}, "dtype", "one of ['auto', 'float32', 'bfloat16', 'float16']"),
    ({"seed": -1}, "seed", "an int in [0, 18446744073709551615]"),
    ({"seed": 1.5}, "seed", "an int in [0,"),
    ({"max_num_seqs": 0}, "max_num_seqs", "an int >= 1"),
    ({"max_num_seqs": True}, "max_num_seqs", "an int >= 1"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens", "None or an int >= 1"),
    ({"max_model_len": -5}, "max_model_len", "None or an int >= 1"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization", "a number in (0, 1]"),
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization", "a number in (0, 1]"),
    ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization", "(0, 1]"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes", "None or an int >= 1"),
    ({"block_size": 0}, "block_size", "an int >= 1"),
    ({"block_size": 96}, "block_size", "a power of two"),
    ({"chunked_prefill": 1}, "chunked_prefill", "True or False"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching", "True or False"),
    ({"expert_parallel_size": 0}, "expert_parallel_size", "an int >= 1"),
    ({"data_parallel_size": 0}, "data_parallel_size", "an int >= 1"),
    ({"accelerator": "tpu"}, "accelerator", "one of ['nvidia', 'ascend', 'cpu', 'auto']"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens", "an int >= 0"),
    ({"batch_invariant": "1"}, "batch_invariant", "True or False"),
    ({"model": ""}, "model", "non-empty str"),
    ({"tokenizer": 3}, "tokenizer", "non-empty str"),
    ({"async_scheduling": 1}, "async_scheduling", "True or False"),
    ({"chunked_prefill": False, "max_model_len": 4096, "max_num_batched_tokens": 1024},
     "max_num_batched_tokens", ">= max_model_len=4096 when chunked_prefill=False"),
])
def test_validation_errors(kwargs: dict, field: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(environ={}, **kwargs)
    assert f"EngineConfig.{field}" in str(info.value) and fragment in str(info.value)
    assert info.value.field == field


def test_validate_after_mutation() -> None:
    c = EngineConfig()
    c.max_num_seqs = 0
    with pytest.raises(ConfigError, match="max_num_seqs"):
        c.validate()


def test_dtype_and_derived_lengths() -> None:
    assert EngineConfig(dtype=torch.bfloat16).dtype == "bfloat16"
    c = EngineConfig.from_kwargs(environ={}, chunked_prefill=False)
    assert c.max_num_batched_tokens is None
    r = c.resolve_max_model_len(65536)
    assert r.max_model_len == 65536 and r.max_num_batched_tokens == 65536
    assert r.sources["max_model_len"] == "derived"
    c2 = EngineConfig(chunked_prefill=False, max_model_len=2048)
    assert c2.max_num_batched_tokens == 2048
    with pytest.raises(ConfigError, match=r"max_model_len must be <= the model's limit 1024"):
        c2.resolve_max_model_len(1024)
    assert EngineConfig().resolve_max_model_len(4096).max_num_batched_tokens == 8192


def test_describe_lists_every_field() -> None:
    c = EngineConfig.from_kwargs(environ={"DEEPINFER_BATCH_INVARIANT": "1"}, max_num_seqs=8)
    text = c.describe()
    lines = text.splitlines()
    assert lines[0] == "EngineConfig" and lines[1].split() == ["field", "value", "source"]
    for f in dataclasses.fields(EngineConfig):
        if f.name != "sources":
            assert any(line.split()[0] == f.name for line in lines[3:]), f.name
    row = next(line for line in lines if line.startswith("max_num_seqs "))
    assert row.split() == ["max_num_seqs", "8", "kwarg"]
    row = next(line for line in lines if line.startswith("batch_invariant "))
    assert row.split() == ["batch_invariant", "True", "env", "DEEPINFER_BATCH_INVARIANT"]
    assert "sources" not in c.to_dict()
