"""ProcessEngineClient without HTTP: the engine core in a spawned process streams the same
tokens as `LLM.generate`, refuses a bad request at admission (the field named, the engine
serving on), frees an aborted request's KV blocks, fails waiting consumers when the engine
process dies, and reports a bad engine argument as the thread client would."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.client_base import EngineDeadError
from deepinfer.engine.process_client import ProcessEngineClient
from deepinfer.errors import ConfigError, InvalidRequestError

ENGINE = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 256}


def _wait(cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_process_client_serves_like_generate():
    llm = LLM(**ENGINE)
    # with a stop string the engine decodes the text; without one the client does, from ids
    sps = [SamplingParams(max_tokens=16, temperature=0.9, seq_seed=21, stop=[" the"], top_logprobs=1),
           SamplingParams(max_tokens=24, temperature=0.9, seq_seed=22, top_logprobs=1)]
    sp = sps[0]
    # one prompt per call, as the client sends them (another batch rounds logprobs differently)
    refs = [llm.generate([p], s, use_tqdm=False)[0] for p, s in zip(["The old man and", "Once upon"], sps)]
    steps: list[float] = []
    client = ProcessEngineClient(ENGINE, max_waiting=8, on_step=lambda d, t, s, st: steps.append(s))
    client.start()
    try:
        assert client.config.max_model_len == 256 and client.model_config.vocab_size == llm.model_config.vocab_size

        async def run() -> tuple[list, list, float]:
            outs = []
            for i, prompt in enumerate(["The old man and", "Once upon"]):
                ids, checked = await client.admit(prompt, None, [sps[i]])
                outs.append([d async for d in client.generate(f"r{i}", ids, checked[0], prompt)])
            with pytest.raises(InvalidRequestError) as bad:
                await client.admit(None, [10, 10**9], [sp])
            # an abort mid-generation frees the request's blocks in the engine process
            ids, checked = await client.admit(None, list(range(10, 60)), [SamplingParams(max_tokens=200,
                                                                                           ignore_eos=True)])
            gen = client.generate("long", ids, checked[0])
            seen = [await gen.__anext__() for _ in range(2)]
            assert client.num_running() == 1
            await gen.aclose()
            freed = await asyncio.to_thread(_wait, lambda: client.num_running() == 0
                                            and client._stats.kv_usage == 0.0)
            # the engine process dies mid-request: the consumer hears of it, and new requests too
            gen = client.generate("dies", ids, checked[0])
            await gen.__anext__()
            client._proc.kill()
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
            with pytest.raises(EngineDeadError):
                client.submit("after", ids, checked[0])
            return outs, [bad.value.field, len(seen)], freed

        outs, (field, n_seen), freed = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        client.shutdown()
    for deltas, ref in zip(outs, refs):
        assert "".join(d.text for d in deltas) == ref.text
        assert [t for d in deltas for t in d.token_ids] == ref.token_ids
        assert [x for d in deltas for x in d.logprobs] == pytest.approx(ref.logprobs, abs=1e-5)
        assert deltas[-1].finish_reason == ref.finish_reason and deltas[-1].output.text == ref.text
    assert field == "prompt_token_ids" and n_seen == 2 and freed
    assert any(s > 0 for s in steps) and not client.alive


def test_process_client_start_errors():
    with pytest.raises(ConfigError, match="max_num_seqs"):  # the child's own exception, not a traceback dump
        ProcessEngineClient({"max_num_seqs": 0}).start()



def test_admission_in_the_server_process_equals_the_engines():
    """`admit_locally` over the engine's `AdmissionView` (pickled, as the engine process sends
    it, with the server's tokenizer) admits what the engine admits, with the same ids and
    params; it leaves to the engine every request the engine would refuse (which words the
    error), and structured output (the grammar compiles there)."""
    import pickle

    from deepinfer.engine.admission import admit_generate
    from deepinfer.engine.admission_local import AdmissionView, admit_locally
    from deepinfer.structured.spec import StructuredOutputSpec

    llm = LLM(**ENGINE, num_kv_blocks=1)  # one 128-token block per group: a request past 128 tokens never fits
    core = llm.engine
    view = pickle.loads(pickle.dumps(AdmissionView.of(core)))
    assert view.tokenizer is None and view.kv_fit == core.scheduler.kv.fit
    assert admit_locally(view, "Once upon", None, [SamplingParams()]) is None  # no tokenizer yet: the engine's
    view.tokenizer = llm.tokenizer
    for prompt, ids, sp in [("The old man and", None, SamplingParams(max_tokens=8, seq_seed=3)),
                            (None, [5, 6, 7, 300], SamplingParams(max_tokens=100, temperature=0.5, seq_seed=4))]:
        kw = {"prompts": [prompt], "prompt_token_ids": None} if prompt else {"prompts": None, "prompt_token_ids": [ids]}
        items, want = admit_generate(core, sampling_params=[sp], **kw)
        got_ids, got = admit_locally(view, prompt, ids, [sp])
        assert got_ids == items[0][1] and got == want
    refused = [(None, [5, 10**9], SamplingParams()), (None, list(range(300)), SamplingParams()),
               (None, [5, 6], SamplingParams(max_tokens=200)),  # more blocks than the cache has
               (None, [], SamplingParams()), ("", None, SamplingParams())]
    for prompt, ids, sp in refused:
        kw = {"prompts": [prompt], "prompt_token_ids": None} if prompt is not None else {
            "prompts": None, "prompt_token_ids": [ids]}
        with pytest.raises(InvalidRequestError):
            admit_generate(core, sampling_params=[sp], **kw)
        assert admit_locally(view, prompt, ids, [sp]) is None
    schema = SamplingParams(structured_output=StructuredOutputSpec(kind="json_object"))
    assert admit_locally(view, None, [5, 6], [schema]) is None
    assert admit_generate(core, sampling_params=[schema], prompts=None, prompt_token_ids=[[5, 6]])


def test_process_client_admits_in_the_server_process():
    """Plain requests are admitted without a round trip to the engine process; structured
    output and a bad request still go there (the grammar compiled, the field named)."""
    from deepinfer.structured.spec import StructuredOutputSpec

    client = ProcessEngineClient(ENGINE, max_waiting=8)
    client.start()
    try:
        async def run() -> tuple[int, str | None, list[int]]:
            ids, checked = await client.admit("Once upon", None, [SamplingParams(max_tokens=4, ignore_eos=True)])
            plain = [t for d in [d async for d in client.generate("plain", ids, checked[0])] for t in d.token_ids]
            schema = SamplingParams(max_tokens=8, structured_output=StructuredOutputSpec(kind="json_object"))
            await client.admit(None, [5, 6, 7], [schema])
            with pytest.raises(InvalidRequestError) as bad:
                await client.admit(None, list(range(5, 300)), [SamplingParams()])
            return client.local_admits, bad.value.field, plain

        local, field, plain = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        client.shutdown()
    assert local == 1 and field == "max_model_len" and len(plain) == 4


def test_stream_deltas_cross_the_pipe_whole():
    """A step's deltas pickle as field tuples (the engine process's message per step): every
    field survives, the final delta's RequestOutput included."""
    import pickle

    from deepinfer.engine.output_processor import StreamDelta

    llm = LLM(**ENGINE)
    out = llm.generate(["Once upon"], SamplingParams(max_tokens=3, top_logprobs=2, seq_seed=1), use_tqdm=False)[0]
    deltas = [StreamDelta("r-0", "", [5, 6], [-0.5, -1.25], [[(5, -0.5), (7, -2.0)], [(6, -1.25)]]),
              StreamDelta("r-1", "a b", [9], None, None, "stop", " the", out)]
    back = pickle.loads(pickle.dumps(deltas, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == deltas and back[1].output.token_ids == out.token_ids and back[1].finished
