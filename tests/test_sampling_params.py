"""Tests for deepinfer.sampling_params.SamplingParams validation and normalisation."""

from __future__ import annotations

import math

import pytest

import deepinfer.sampling_params as spmod
from deepinfer.errors import DeepInferError, InvalidRequestError
from deepinfer.sampling_params import SamplingParams


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.max_tokens, p.min_tokens, p.top_logprobs) == (16, 0, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert p.so_args is None and p.structured_output is None
    assert not p.is_greedy


def test_seq_seed_drawn_when_omitted(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fake_randbits(k: int) -> int:
        calls.append(k)
        return 2**64 - 3

    monkeypatch.setattr(spmod.secrets, "randbits", fake_randbits)
    assert SamplingParams().seq_seed == 2**64 - 3
    assert calls == [64]


def test_seq_seed_random_and_stored() -> None:
    seeds = {SamplingParams().seq_seed for _ in range(8)}
    assert len(seeds) == 8
    assert all(isinstance(s, int) and 0 <= s < 2**64 for s in seeds)
    p = SamplingParams()
    assert p.seq_seed == p.seq_seed  # stored, not redrawn on access


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**63, 2**64 - 1])
def test_seq_seed_kept_when_given(seed: int) -> None:
    assert SamplingParams(seq_seed=seed).seq_seed == seed


@pytest.mark.parametrize("temperature,greedy", [(0.0, True), (9e-6, True), (1e-5, False),
                                                (0.7, False), (2, False)])
def test_is_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(1, 2), temperature=1, top_p=1)
    assert p.stop == ["###"] and p.stop_token_ids == [1, 2]
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


@pytest.mark.parametrize("kwargs,field,fragment", [
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": math.nan}, "temperature", "finite"),
    ({"temperature": math.inf}, "temperature", "finite"),
    ({"temperature": "1"}, "temperature", ">= 0"),
    ({"temperature": True}, "temperature", ">= 0"),
    ({"top_p": 1.5}, "top_p", "in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p", "in (0, 1]"),
    ({"top_p": math.nan}, "top_p", "in (0, 1]"),
    ({"top_k": 0}, "top_k", "-1 (disabled) or >= 1"),
    ({"top_k": -2}, "top_k", "-1 (disabled) or >= 1"),
    ({"top_k": 2.0}, "top_k", "-1 (disabled) or >= 1"),
    ({"min_p": -0.01}, "min_p", "in [0, 1]"),
    ({"min_p": 1.01}, "min_p", "in [0, 1]"),
    ({"min_p": math.inf}, "min_p", "in [0, 1]"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": True}, "max_tokens", ">= 1"),
    ({"max_tokens": 3.0}, "max_tokens", ">= 1"),
    ({"min_tokens": -1}, "min_tokens", "in [0, max_tokens=16]"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "in [0, max_tokens=4]"),
    ({"stop": ""}, "stop", "non-empty str"),
    ({"stop": ["a", 3]}, "stop", "list of non-empty str"),
    ({"stop": 7}, "stop", "list of non-empty str"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "ints >= 0"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "ints >= 0"),
    ({"stop_token_ids": 5}, "stop_token_ids", "ints >= 0"),
    ({"ignore_eos": 1}, "ignore_eos", "True or False"),
    ({"top_logprobs": 21}, "top_logprobs", "in [0, 20]"),
    ({"top_logprobs": -1}, "top_logprobs", "in [0, 20]"),
    ({"seq_seed": -1}, "seq_seed", "in [0, 2**64 - 1]"),
    ({"seq_seed": 2**64}, "seq_seed", "in [0, 2**64 - 1]"),
    ({"seq_seed": 1.0}, "seq_seed", "in [0, 2**64 - 1]"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "True or False"),
    ({"skip_special_tokens": None}, "skip_special_tokens", "True or False"),
    ({"so_args": "json"}, "so_args", "schema_type"),
    ({"so_args": {"schema_type": "json"}}, "so_args", "missing keys ['schema']"),
    ({"so_args": {"schema_type": "json", "schema": {}, "x": 1}}, "so_args", "unknown keys ['x']"),
    ({"so_args": {"schema_type": "yaml", "schema": "a"}}, "so_args",
     "one of ['json', 'regex', 'ebnf']"),
    ({"so_args": {"schema_type": "regex", "schema": {"a": 1}}}, "so_args", "non-empty str"),
    ({"so_args": {"schema_type": "ebnf", "schema": ""}}, "so_args", "non-empty str"),
    ({"so_args": {"schema_type": "json", "schema": 3}}, "so_args", "dict or JSON str"),
])
def test_validation_errors(kwargs: dict, field: str, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    msg = str(info.value)
    assert f"SamplingParams.{field}" in msg
    assert fragment in msg
    assert info.value.field == field
    assert isinstance(info.value, DeepInferError) and isinstance(info.value, ValueError)


def test_top_p_message_exact() -> None:
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams\.top_p must be in \(0, 1\], "
                       r"got 1\.5$"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize("so_args", [
    {"schema_type": "json", "schema": {"type": "object"}},
    {"schema_type": "json", "schema": '{"type": "string"}'},
    {"schema_type": "json", "schema": {}},
    {"schema_type": "regex", "schema": "[a-z]+"},
    {"schema_type": "ebnf", "schema": 'root ::= "yes" | "no"'},
])
def test_so_args_valid(so_args: dict) -> None:
    assert SamplingParams(so_args=so_args).so_args == so_args


def test_structured_output_is_validated() -> None:
    # no longer a reserved opaque field: it is normalised to a StructuredOutputSpec
    # (full coverage in tests/test_structured_spec.py)
    with pytest.raises(InvalidRequestError, match="structured_output"):
        SamplingParams(structured_output=object())
