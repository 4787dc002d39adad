"""Pre-queue admission (deepinfer/engine/admission.py): a generate() call is checked whole
before anything is queued, bad values are refused in the dtype the engine computes in,
prompt containers get clear errors, and the engine serves normally after every refusal."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # one KV block of 128 tokens: a request reaching past 128 tokens can never be scheduled
    return LLM(max_model_len=256, max_num_seqs=4, num_kv_blocks=1, block_size=128, dtype="float32")


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY,
                                              use_tqdm=False)]


def idle(llm: LLM) -> bool:
    return not llm.scheduler.has_unfinished() and not llm.structured.pending


def serves(llm: LLM, reference: list[list[int]]) -> None:
    outs = llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference, "the next call returns its own outputs"


def test_unfittable_third_prompt_queues_nothing(llm, reference) -> None:
    prompts = [[5, 6, 7], [8, 9], list(range(2, 202))]  # the 3rd needs 2 blocks of the 1 there is
    with pytest.raises(InvalidRequestError, match=r"prompt 2 .* could never be scheduled; nothing was queued"):
        llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert idle(llm), "the first two prompts were left in the scheduler"
    serves(llm, reference)


@pytest.mark.parametrize("spec,match", [
    ({"regex": r"[^\s\S]"}, r"sampling_params\[1\].*language is empty"),  # a class no character is in
    ({"ebnf": "root ::= x\nx ::= x"}, r"sampling_params\[1\].*language is empty"),  # a rule that never ends
    ({"ebnf": "root ::= [^\\x00-\\U0010FFFF]"}, r"sampling_params\[1\].*language is empty"),
    ({"ebnf": ""}, "structured_output: ebnf needs a non-empty str"),  # refused by SamplingParams itself
    # our message, naming the keyword, its path and the range (was xgrammar's compile error)
    ({"json": {"type": "string", "minLength": -1}},
     r"sampling_params\[1\].*schema/minLength: 'minLength' must be a non-negative integer.*got -1"),
    ({"json": {"type": "string", "maxLength": -1}}, r"schema/maxLength: 'maxLength' must be a non-negative integer"),
    ({"json": {"type": "object", "properties": {"t": {"type": "array", "minItems": -1}}}},
     r"schema/properties/t/minItems: 'minItems' must be a non-negative integer"),
    ({"json": {"type": "string", "minLength": 3, "maxLength": 1}}, r"'minLength' 3 > 'maxLength' 1"),
    # no finite string: the first step allows "a", so only the productive-rule check refuses them
    ({"ebnf": 'root ::= "a" root'}, r"sampling_params\[1\].*rule 'root' derives no finite string"),
    ({"ebnf": 'root ::= a\na ::= "x" root'}, r"rule 'root' derives no finite string.*\['a'\]"),
])
def test_bad_grammar_second_prompt_queues_nothing(llm, reference, spec, match) -> None:
    """Grammars are compiled and their first step checked before anything is queued (before,
    an empty language or a schema xgrammar cannot compile failed after admission and aborted
    every request of the call)."""
    good = SamplingParams(structured_output={"regex": "[ab]+"}, max_tokens=4)
    with pytest.raises(InvalidRequestError, match=match):
        bad = SamplingParams(structured_output=spec, max_tokens=4)
        llm.generate(["Hello", "World"], [good, bad], use_tqdm=False)
    assert idle(llm)
    serves(llm, reference)


@pytest.mark.parametrize("field,value,match", [
    ("temperature", 1e39, "finite in float32"),
    ("top_k", 2**70, r"int64"),
    ("top_p", 1e-50, r"\(0, 1\] as a float32"),
    ("stop_token_ids", [10**9], r"stop_token_ids must be token ids in \[0, 8192\)"),
    ("stop_token_ids", 5, r"stop_token_ids must be a list of token ids, got 5"),
    ("stop", "x", r"stop must be a list of non-empty str, got 'x'"),
    ("structured_output", {"regex": "a"}, r"structured_output must be set through SamplingParams"),
])
def test_values_checked_in_the_engines_dtype(llm, reference, field, value, match) -> None:
    sp = SamplingParams(max_tokens=4)
    setattr(sp, field, value)  # set after construction: only admission can catch it
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=[GREEDY, sp], use_tqdm=False)
    assert idle(llm)
    serves(llm, reference)


def test_sampling_params_refuse_float32_infinite_and_int64_overflow() -> None:
    with pytest.raises(InvalidRequestError, match="temperature.*float32"):
        SamplingParams(temperature=1e39)
    with pytest.raises(InvalidRequestError, match=r"top_k.*2\*\*63 - 1"):
        SamplingParams(top_k=2**63)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=1e-50)  # 0 in float32
    assert SamplingParams(top_k=2**63 - 1).top_k == 2**63 - 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=b"hi"), "got bytes; decode them first"),
    (dict(prompts={"a": 1}), "must be a str or a list of str, got dict"),
    (dict(prompts="a\ud800"), r"lone surrogate"),
    (dict(prompts=["ok", 3]), r"prompts\[1\] must be a str, got int"),
    (dict(prompt_token_ids=5), r"bare int 5 \(one prompt of one token is \[5\]\)"),
    (dict(prompt_token_ids=[1.0, 2.0]), r"prompt_token_ids\[0\] must be an int token id, got 1.0 \(float\)"),
    (dict(prompt_token_ids=[None]), r"prompt_token_ids\[0\] must be a list of int token ids, got NoneType"),
    (dict(prompt_token_ids=[[1, 2], None]), r"prompt_token_ids\[1\] must be a list"),
    (dict(prompt_token_ids=[True, 2]), r"must be an int token id, got True"),
    (dict(prompt_token_ids=np.array([1.5, 2.0])), "1-D integer array, got 1-D float64"),
    (dict(prompt_token_ids=torch.zeros(2, 2, 2, dtype=torch.long)), "got 3-D"),
    (dict(prompt_token_ids=[[1, 8192]]), r"outside \[0, 8192\): \[8192\]"),
    (dict(prompt_token_ids=[[3, -1]]), r"outside \[0, 8192\): \[-1\]"),
    (dict(prompt_token_ids=[[1, 2**70]]), r"outside \[0, 8192\): \[1180591620717411303424\]"),  # past int64
    (dict(prompt_token_ids=[[1, np.int64(9000)]]), r"outside \[0, 8192\): \[9000\]"),
    (dict(prompt_token_ids=np.array([[1, 2**63 + 5]], dtype=np.uint64)), r"outside \[0, 8192\): \[9223372036854775813\]"),
    (dict(prompt_token_ids=torch.tensor([4, 8200])), r"outside \[0, 8192\): \[8200\]"),
])
def test_prompt_types_refused_clearly(llm, reference, kwargs, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(**kwargs, sampling_params=GREEDY, use_tqdm=False)
    assert idle(llm)
    serves(llm, reference)


def test_numpy_and_torch_ids_are_ids(llm, reference) -> None:
    for ids in (np.array([[5, 6, 7]]), torch.tensor([5, 6, 7]), [np.int64(5), np.int32(6), torch.tensor(7)]):
        out = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)
        assert [o.token_ids for o in out] == reference[:1], type(ids)
    rows = llm.generate(prompt_token_ids=torch.tensor([[5, 6, 7], [8, 9, 9]]), sampling_params=GREEDY,
                        use_tqdm=False)
    assert rows[0].token_ids == reference[0] and rows[1].prompt_token_ids == [8, 9, 9]


def test_max_tokens_past_the_context_is_reported(caplog) -> None:
    small = LLM(max_model_len=128, max_num_seqs=2, num_kv_blocks=1, block_size=128, dtype="float32")
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine.admission"):
        out = small.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                           sampling_params=SamplingParams(temperature=0, max_tokens=10**9, ignore_eos=True))
    assert "max_model_len=128" in caplog.text and "finish_reason 'length'" in caplog.text
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 128 - 3
