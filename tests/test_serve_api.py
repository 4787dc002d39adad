"""`deepinfer serve` driven with the official `openai` client on the embedded default model
(CPU): chat, streaming, completions, json_schema, 200 concurrent streams equal to
`LLM.generate`, disconnect, malformed bodies, auth, 503 under overload. One server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest

from serve_common import ENGINE, metric, serve

KEY = "sk-test-deepinfer"


@pytest.fixture(scope="module")
def base_url():
    with serve("--api-key", KEY, "--max-waiting", "240") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm():
    from deepinfer import LLM

    return LLM(**ENGINE)


def test_models_health_metrics(base_url, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["deepinfer-tiny"]
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    page = httpx.get(base_url + "/metrics").text
    for name in ("deepinfer:time_to_first_token_seconds_bucket", "deepinfer:num_requests_running",
                 "deepinfer:kv_cache_usage_perc", "deepinfer:prefix_cache_hit_rate",
                 "deepinfer:num_preemptions_total", "deepinfer:spec_decode_draft_acceptance_rate"):
        assert name in page


def test_completions_equal_generate(client, llm):
    from deepinfer import SamplingParams

    r = client.completions.create(model="deepinfer-tiny", prompt="Once upon a time", max_tokens=12, seed=7,
                                  temperature=0.8, logprobs=2)
    ref = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, seq_seed=7, temperature=0.8,
                                                            top_logprobs=2), use_tqdm=False)[0]
    choice = r.choices[0]
    assert choice.text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    tok = llm.tokenizer
    assert choice.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert all(len(t) == 2 for t in choice.logprobs.top_logprobs)


def _generation_tokens(base_url: str) -> float:
    page = httpx.get(base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("deepinfer:generation_tokens_total"))


def test_chat_stream_equals_nonstream_with_usage(client, base_url):
    before = _generation_tokens(base_url)
    kw = dict(model="deepinfer-tiny", messages=[{"role": "user", "content": "Say hello"}], max_tokens=10,
              temperature=0, extra_body={"thinking": {"type": "disabled"}})
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert _generation_tokens(base_url) - before == 20  # /metrics counts every output token once


def test_chat_thinking_and_n(client):
    r = client.chat.completions.create(model="deepinfer-tiny", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=6, n=3, seed=11, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    # thinking is on by default: the recipe splits reasoning from the answer
    assert all(c.message.model_extra.get("reasoning_content") is not None for c in r.choices)


def test_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="deepinfer-tiny", messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        extra_body={"thinking": {"type": "disabled"}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_200_concurrent_streams_equal_generate(base_url, llm):
    from deepinfer import SamplingParams

    prompts = [f"Story {i}" for i in range(200)]

    async def one(http: httpx.AsyncClient, i: int) -> str:
        body = {"model": "deepinfer-tiny", "prompt": prompts[i], "max_tokens": 4, "seed": 1000 + i,
                "temperature": 1.0, "stream": True}
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run() -> list[str]:
        oa = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0)

        async def official(i: int) -> str:  # the official client, streaming
            stream = await oa.completions.create(model="deepinfer-tiny", prompt=prompts[i], max_tokens=4,
                                                 seed=1000 + i, temperature=1.0, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120, limits=httpx.Limits(max_connections=None)) as http:
            tasks = [official(i) if i % 2 == 0 else one(http, i) for i in range(200)]
            try:
                return await asyncio.gather(*tasks)
            finally:
                await oa.close()

    got = asyncio.run(run())
    ref = llm.generate(prompts, [SamplingParams(max_tokens=4, seq_seed=1000 + i, temperature=1.0)
                                 for i in range(200)], use_tqdm=False)
    assert got == [o.text for o in ref]


def test_disconnect_aborts_and_frees_blocks(base_url):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "deepinfer-tiny", "prompt": "Tell me everything", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            page = http.get("/metrics").text
            assert metric(page, "deepinfer:num_requests_running") == 1
            assert metric(page, "deepinfer:kv_cache_usage_perc") > 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            page = http.get("/metrics").text
            if metric(page, "deepinfer:kv_cache_usage_perc") == 0:
                break
            time.sleep(0.05)
        assert metric(page, "deepinfer:num_requests_running") == 0
        assert metric(page, "deepinfer:kv_cache_usage_perc") == 0
        assert 'finished_reason="abort"' in page


def test_disconnect_without_streaming_aborts(base_url):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "deepinfer-tiny", "prompt": "Go on", "max_tokens": 200, "ignore_eos": True}
    aborted = lambda page: sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                               if line.startswith("deepinfer:request_success_total") and 'reason="abort"' in line)
    before = aborted(httpx.get(base_url + "/metrics").text)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up: its connection closes
        httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        page = httpx.get(base_url + "/metrics").text
        if aborted(page) > before and metric(page, "deepinfer:num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert aborted(page) == before + 1 and metric(page, "deepinfer:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("body,param", [
    (b"{not json", "body"), (b"[1, 2]", "body"),
    ({"prompt": "x", "max_tokens": "abc"}, "max_tokens"), ({"prompt": "x", "temperature": 5}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "stop": [1]}, "stop"), ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"), ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "stream_options": {"include_usage": True}},
                                                   "stream_options"),
    ({"prompt": [999999]}, "prompt_token_ids"), ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
])
def test_malformed_completions_bodies(base_url, client, body, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base_url + "/v1/completions", content=data, headers=headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]
    assert client.completions.create(model="deepinfer-tiny", prompt="ok", max_tokens=1).choices[0].finish_reason


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, "model"),
])
def test_malformed_chat_bodies(base_url, body, param):
    r = httpx.post(base_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_auth_and_body_limit(base_url):
    body = {"prompt": "x", "max_tokens": 1}
    assert httpx.post(base_url + "/v1/completions", json=body).status_code == 401
    wrong = httpx.post(base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url + "/v1", api_key="nope", max_retries=0).models.list()
    huge = httpx.post(base_url + "/v1/completions", content=b"x" * (5 * 2**20),
                      headers={"Authorization": f"Bearer {KEY}"})
    assert huge.status_code == 413 and huge.json()["error"]["param"] == "body"
    assert httpx.get(base_url + "/health").status_code == 200  # no key needed outside /v1


def test_overload_answers_503_with_retry_after(base_url, client):
    """400 streams at once on 64 sequence slots and --max-waiting 240: the excess gets 503 with
    Retry-After at once; the streams that got in are held open until every answer arrived,
    then closed (which aborts them), and the server still serves."""
    async def run() -> list[tuple[int, str | None]]:
        answers: list[tuple[int, str | None]] = []
        all_in = asyncio.Event()
        body = {"model": "deepinfer-tiny", "prompt": "Load", "max_tokens": 200, "ignore_eos": True, "stream": True}

        async def one(http: httpx.AsyncClient) -> None:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                answers.append((r.status_code, r.headers.get("retry-after")))
                if r.status_code == 503:
                    assert json.loads(await r.aread())["error"]["code"] == "overloaded"
                if len(answers) == 400:
                    all_in.set()
                await all_in.wait()

        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                                     limits=httpx.Limits(max_connections=None)) as http:
            await asyncio.wait_for(asyncio.gather(*(one(http) for _ in range(400))), 60)
        return answers

    answers = asyncio.run(run())
    codes = [c for c, _ in answers]
    assert set(codes) == {200, 503} and codes.count(200) >= 240, (codes.count(200), codes.count(503))
    assert all(retry == "1" for c, retry in answers if c == 503)
    assert client.completions.create(model="deepinfer-tiny", prompt="after", max_tokens=2).usage.completion_tokens


def test_bench_serve_against_the_server(base_url, tmp_path):
    """`deepinfer bench serve` (the CLI) on this server: every request completes with its exact
    output length, percentiles are ordered, an unmeetable SLO gives zero goodput, the JSON
    carries commit / hardware / config."""
    from deepinfer.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", base_url, "--api-key", KEY, "--num-prompts", "12",
               "--random-input-len", "12", "--random-output-len", "5", "--request-rate", "40", "--arrival", "gamma",
               "--burstiness", "0.5", "--max-concurrency", "6", "--slo-ttft-ms", "0.001", "--out", str(out)])
    rec = json.loads(out.read_text())
    assert rc == 0 and rec["completed"] == 12 and rec["failed"] == 0
    assert rec["total_output_tokens"] == 60 and rec["total_input_tokens"] == 12 * 12
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = rec[key]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"], (key, p)
    assert rec["e2e_ms"]["p50"] >= rec["ttft_ms"]["p50"]
    assert rec["goodput"] == 0.0 and rec["request_throughput"] > 0
    assert len(rec["commit"]) == 40 and rec["hardware"]["cpus"] and rec["config"]["arrival"] == "gamma"
    assert rec["config"]["api_key"] == "<set>"


def test_bench_serve_chat_endpoint(base_url):
    """The benchmark client on /v1/chat/completions (streamed chat chunks, usage last): every
    request completes with its exact output length and a TTFT, and one ITL per later chunk."""
    import asyncio

    from deepinfer.serve.bench import BenchConfig, run_bench, summarize

    cfg = BenchConfig(base_url, endpoint="chat", num_prompts=4, random_input_len=8, random_output_len=6,
                      max_concurrency=2, api_key=KEY)
    results, wall, _ = asyncio.run(run_bench(cfg))
    rec = summarize(cfg, results, wall)
    assert rec["completed"] == 4 and rec["failed"] == 0 and rec["total_output_tokens"] == 24
    assert all(r.ttft is not None and 1 <= len(r.itls) <= 5 for r in results), [(r.ttft, r.itls) for r in results]


def test_arrival_schedules():
    import math
    import statistics

    from deepinfer.serve.bench import BenchConfig, arrival_times

    assert arrival_times(BenchConfig("x", request_rate=math.inf), 5) == [0.0] * 5
    for arrival, shape in (("poisson", 1.0), ("gamma", 0.25)):
        times = arrival_times(BenchConfig("x", request_rate=20.0, arrival=arrival, burstiness=shape, seed=3), 4000)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.1)
        # coefficient of variation of a gamma(k) gap is 1/sqrt(k): burstier below 1
        assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1 / math.sqrt(shape), rel=0.15)
    with pytest.raises(ValueError, match="request-rate"):
        BenchConfig("x", request_rate=0).check()
    for url in ("http://127.0.0.1:8000/v1", "127.0.0.1:8000", "ftp://h:1"):  # aiohttp joins paths to the root
        with pytest.raises(ValueError, match="base-url"):
            BenchConfig(url).check()
    BenchConfig("http://127.0.0.1:8000/").check()
