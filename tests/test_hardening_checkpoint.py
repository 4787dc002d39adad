"""Untrusted checkpoints: config.json sizes and types are checked against the shard headers
before anything is allocated, non-regular files (FIFOs, /dev/zero behind a symlink) are
refused unread, shard names stay inside the directory, NaN weights are refused at load,
and every error names the file."""

from __future__ import annotations

import json
import math
import os
import shutil
import time

import pytest
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.models.config_common import ModelConfigError
from deepinfer.models.loader import CheckpointError, load_model
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.tokenizer import TokenizerNotFoundError


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("pristine")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(vocab_size=256))
    return str(path)


@pytest.fixture()
def ckpt(pristine, tmp_path) -> str:
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return str(dst)


def edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    raw = json.loads(open(file).read())
    raw.update(changes)
    open(file, "w").write(json.dumps(raw))


def index(path: str) -> tuple[str, dict]:
    file = os.path.join(path, "model.safetensors.index.json")
    return file, json.loads(open(file).read())


def a_shard(path: str) -> str:
    return os.path.join(path, sorted(set(index(path)[1]["weight_map"].values()))[0])


@pytest.mark.parametrize("changes,match", [
    (dict(hidden_size=2**20), r"hidden_size=1048576 imply embed.weight \(256, 1048576\), but .*safetensors stores"),
    (dict(n_routed_experts=100000), r"n_routed_experts=100000, but the shards hold experts 0\.\.7"),
])
def test_config_sizes_checked_against_the_files_before_allocating(ckpt, changes, match) -> None:
    edit_config(ckpt, **changes)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=match) as exc:
        load_model(ckpt, dtype="float32")
    assert "config.json" in str(exc.value)
    assert time.monotonic() - start < 5, "failed before building the model"


@pytest.mark.parametrize("changes,match", [
    (dict(hidden_size="256"), r"hidden_size must be an integer, got '256' \(str\)"),
    (dict(num_experts_per_tok=2.0), r"num_experts_per_tok must be an integer, got 2.0 \(float\)"),
    (dict(norm_topk_prob="yes"), r"norm_topk_prob must be true or false"),
    (dict(compress_ratios="0,4"), r"compress_ratios must be a list of integers, got '0,4' \(str\)"),
    (dict(compress_ratios="04"), r"compress_ratios must be a list of integers, got '04' \(str\)"),  # was [0, 4]
])
def test_config_types_named(ckpt, changes, match) -> None:
    edit_config(ckpt, **changes)
    with pytest.raises((ModelConfigError, CheckpointError), match=match):
        load_model(ckpt, dtype="float32")


def test_malformed_value_outside_the_fields_names_the_key(ckpt) -> None:
    edit_config(ckpt, compress_rate_csa="four")  # a flat V4 key outside the dataclass fields
    with pytest.raises(ModelConfigError, match=r"compress_rate_csa must be an integer, got 'four'") as exc:
        load_model(ckpt, dtype="float32")
    assert exc.value.field == "compress_rate_csa"


def test_non_regular_files_are_refused_unread(ckpt) -> None:
    config = os.path.join(ckpt, "config.json")
    os.replace(config, config + ".bak")
    os.symlink("/dev/zero", config)
    with pytest.raises((ModelConfigError, CheckpointError), match="is a device .via a symlink.*regular file"):
        load_model(ckpt, dtype="float32")
    os.unlink(config)
    os.mkfifo(config)  # opening it for reading would block forever
    with pytest.raises((ModelConfigError, CheckpointError), match="is a FIFO.*regular file"):
        load_model(ckpt, dtype="float32")
    os.unlink(config)
    os.replace(config + ".bak", config)
    shard = a_shard(ckpt)
    os.unlink(shard)
    os.mkfifo(shard)
    with pytest.raises(CheckpointError, match=rf"checkpoint shard {shard} is a FIFO"):
        load_model(ckpt, dtype="float32")


@pytest.mark.parametrize("name", ["../elsewhere/x.safetensors", "/tmp/x.safetensors", "a/../../x.safetensors"])
def test_shards_outside_the_directory_are_refused(ckpt, tmp_path, name) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir(exist_ok=True)
    shutil.copy(a_shard(ckpt), outside / "x.safetensors")  # a loadable file is there: it must not load
    file, raw = index(ckpt)
    first = next(iter(raw["weight_map"]))
    raw["weight_map"][first] = name
    open(file, "w").write(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"lies outside the checkpoint directory"):
        load_model(ckpt, dtype="float32")


@pytest.mark.parametrize("content,match", [
    ("{not json", r"shard index .*model.safetensors.index.json is not valid JSON"),
    ('{"metadata": {}}', r"model.safetensors.index.json must be a JSON object with a 'weight_map'"),
    ('{"weight_map": {"embed.weight": 7}}', r"weight_map values must be shard file names, got 7"),
])
def test_bad_index_named(ckpt, content, match) -> None:
    open(index(ckpt)[0], "w").write(content)
    with pytest.raises(CheckpointError, match=match):
        load_model(ckpt, dtype="float32")


@pytest.mark.parametrize("size", [0, 100, -1000])
def test_truncated_or_empty_shard_named(ckpt, size) -> None:
    shard = a_shard(ckpt)
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:size] if size >= 0 else data[:len(data) + size])
    with pytest.raises(CheckpointError, match=rf"checkpoint shard {shard}"):
        load_model(ckpt, dtype="float32")


def test_nan_weights_refused_at_load(ckpt) -> None:
    shard = a_shard(ckpt)
    tensors = load_file(shard)
    name = next(n for n, t in tensors.items() if t.is_floating_point() and t.dim() == 2)
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = math.nan
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=rf"{name}.* in {shard} holds 1 NaN/Inf value"):
        load_model(ckpt, dtype="float32")


def test_tokenizer_must_exist(ckpt, pristine) -> None:
    with pytest.raises(TokenizerNotFoundError, match="'/typo' does not exist"):
        LLM(pristine, tokenizer="/typo", dtype="float32", max_model_len=128)
    raw = json.loads(open(os.path.join(ckpt, "config.json")).read())
    raw.pop("deepinfer_tokenizer")  # a small-vocab checkpoint without tokenizer.json, no opt-in
    open(os.path.join(ckpt, "config.json"), "w").write(json.dumps(raw))
    with pytest.raises(TokenizerNotFoundError, match=r"no tokenizer.json and its vocab_size is 256"):
        LLM(ckpt, dtype="float32", max_model_len=128)
    llm = LLM(pristine, dtype="float32", max_model_len=128)  # the explicit opt-in serves
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2
