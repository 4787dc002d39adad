"""``LLM.shutdown`` / ``with LLM(...)``: a one-process engine releases its model, KV cache and
graphs, so another engine can be built in the same process (notebook 06 builds two in turn on
a GPU, where the second failed for want of memory), and refuses new work with a clear error."""

from __future__ import annotations

import gc
import weakref

import pytest

from deepinfer import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_shutdown_releases_the_engine_and_refuses_new_work() -> None:
    with LLM(dtype="float32", max_model_len=128, max_num_seqs=2) as llm:
        first = llm.generate(["hello"], PARAMS, use_tqdm=False)[0].token_ids
        model, cache = weakref.ref(llm.engine.model), weakref.ref(llm.engine.kv_cache)
    gc.collect()
    assert model() is None and cache() is None, "the engine still holds its model or KV cache"
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["hello"], PARAMS, use_tqdm=False)
    llm.shutdown()  # idempotent
    with LLM(dtype="float32", max_model_len=128, max_num_seqs=2) as again:
        assert again.generate(["hello"], PARAMS, use_tqdm=False)[0].token_ids == first
