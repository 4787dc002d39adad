"""Engine behaviour through the public API: seeded sampling, stress under preemption,
bad inputs with clear errors while the engine keeps serving."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError, InvalidRequestError
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_small")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


def make_llm(ckpt: str, **kw) -> LLM:
    kw.setdefault("max_model_len", 512)
    kw.setdefault("max_num_seqs", 16)
    return LLM(ckpt, dtype="float32", **kw)


def test_seeded_sampling_is_independent_of_batch_composition(ckpt, fresh_seed):
    rng = random.Random(fresh_seed)
    llm = make_llm(ckpt, max_num_batched_tokens=96)
    target = [rng.randrange(VOCAB) for _ in range(70)]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seq_seed=fresh_seed)
    alone = llm.generate(prompt_token_ids=[target], sampling_params=params, use_tqdm=False)[0]
    assert alone.seq_seed == fresh_seed
    for batch_size in (3, 9):
        others = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 200))] for _ in range(batch_size)]
        other_params = [SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 20)) for _ in others]
        pos = rng.randrange(batch_size + 1)
        batch = others[:pos] + [target] + others[pos:]
        sps = other_params[:pos] + [params] + other_params[pos:]
        outs = llm.generate(prompt_token_ids=batch, sampling_params=sps, use_tqdm=False)
        assert outs[pos].token_ids == alone.token_ids, f"batch of {batch_size + 1}, position {pos}"
        assert outs[pos].logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    # A different seed gives a different sample (12 tokens at temperature 0.9: collision is negligible).
    other = llm.generate(prompt_token_ids=[target], use_tqdm=False,
                         sampling_params=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12,
                                                        seq_seed=fresh_seed + 1))[0]
    assert other.token_ids != alone.token_ids


def test_omitted_seed_is_reported_and_replays(ckpt):
    llm = make_llm(ckpt)
    first = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=8),
                         use_tqdm=False)[0]
    replay = llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                          sampling_params=SamplingParams(max_tokens=8, seq_seed=first.seq_seed))[0]
    assert replay.token_ids == first.token_ids


def test_stress_200_requests_with_preemption(ckpt, fresh_seed):
    rng = random.Random(fresh_seed)
    llm = make_llm(ckpt, max_num_seqs=32, num_kv_blocks=8, max_num_batched_tokens=256)
    prompts, params = [], []
    for _ in range(200):
        prompts.append([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 300))])
        greedy = rng.random() < 0.3
        params.append(SamplingParams(temperature=0.0 if greedy else rng.uniform(0.5, 1.5),
                                     top_p=rng.uniform(0.5, 1.0), top_k=rng.choice([-1, 5, 50]),
                                     min_p=rng.choice([0.0, 0.05]), max_tokens=rng.randrange(1, 12),
                                     ignore_eos=True))
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert len(outs) == 200
    for out, prompt, sp in zip(outs, prompts, params):
        assert out.prompt_token_ids == prompt
        assert len(out.token_ids) == sp.max_tokens and out.finish_reason == "length"
        assert all(0 <= t < VOCAB for t in out.token_ids)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool is small enough to force preemption"
    llm.kv_manager.assert_consistent()
    for name, pool in llm.kv_manager.pools.items():
        assert pool.num_free == pool.num_blocks, f"group {name} leaked blocks"
    assert llm.kv_manager.num_free_slots == llm.config.max_num_seqs


def test_stop_token_and_stop_string(ckpt):
    llm = make_llm(ckpt)
    base = llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                      stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    text = base.text
    assert len(text) > 4, "the stop-string half needs a few characters of output"
    stop_str = text[2:4]
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                      stop=[stop_str]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str
    assert out.text == text[: text.index(stop_str)]


def test_text_is_the_same_detokenized_once_or_incrementally():
    """Requests without stop strings are detokenized once, when their output is built;
    with a stop string that never matches they are detokenized token by token: the text
    is the same, and it is the tokenizer's decode of the output ids (trained tiny model:
    real multi-byte text)."""
    llm = LLM(max_num_seqs=4)
    prompts = ["The history of", "Dear friend,", "def main():"]
    once = llm.generate(prompts, SamplingParams(temperature=0.8, seq_seed=3, max_tokens=40), use_tqdm=False)
    steps = llm.generate(prompts, SamplingParams(temperature=0.8, seq_seed=3, max_tokens=40, stop=["\x00never"]),
                         use_tqdm=False)
    for a, b in zip(once, steps):
        assert a.token_ids == b.token_ids and len(a.text) > 10
        assert a.text == b.text == llm.tokenizer.decode(a.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("call,message", [
    (lambda llm: llm.generate(prompt_token_ids=[[]]), r"prompt_token_ids\[0\] is empty"),
    (lambda llm: llm.generate([""]), r"prompts\[0\] is empty"),
    (lambda llm: llm.generate(prompt_token_ids=[[1] * 600]), r"600 tokens.*max_model_len\) is 512"),
    (lambda llm: llm.generate(prompt_token_ids=[[VOCAB + 3]]), rf"outside \[0, {VOCAB}\)"),
    (lambda llm: llm.generate(["a"], SamplingParams(max_tokens=-1)), r"max_tokens"),
    (lambda llm: llm.generate(["a"], SamplingParams(top_p=1.5)), r"top_p must be in \(0, 1\], got 1.5"),
    (lambda llm: llm.generate(["a", "b"], [SamplingParams()] * 3), r"3 sampling_params for 2 prompts"),
])
def test_bad_inputs_raise_clear_errors_and_engine_keeps_serving(ckpt, call, message):
    llm = make_llm(ckpt)
    with pytest.raises(InvalidRequestError, match=message):
        call(llm)
    assert not llm.scheduler.has_unfinished(), "a rejected call must not leave requests behind"
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)  # ignore_eos: an unseeded draw may be EOS (the test checks serving, not EOS)
    assert len(out[0].token_ids) == 3


def test_unknown_env_value_and_unknown_argument(ckpt, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "maybe")
    with pytest.raises(ConfigError, match="DEEPINFER_BATCH_INVARIANT"):
        make_llm(ckpt)
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIENT", "1")
    with pytest.raises(ConfigError, match="DEEPINFER_BATCH_INVARIENT"):
        make_llm(ckpt)
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIENT")
    with pytest.raises(ConfigError, match="max_num_seq"):
        make_llm(ckpt, max_num_seq=4)


def test_text_prompt_outside_model_vocab_is_rejected(ckpt):
    llm = make_llm(ckpt)  # a 512-token checkpoint with the 129k-token V4 tokenizer
    with pytest.raises(InvalidRequestError, match="tokenizes to ids >= the model's vocab_size 512"):
        llm.generate(["Hello world, this is long enough to use rare tokens"])


def test_cli_generate_runs_on_the_default_model():
    proc = subprocess.run([sys.executable, "-m", "deepinfer.cli", "generate", "--prompt", "Hi", "--prompt", "Yo",
                           "--max-tokens", "4", "--json", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count('"finish_reason": "length"') == 2


def test_top_logprobs_are_reported(ckpt):
    llm = make_llm(ckpt)
    out = llm.generate(prompt_token_ids=[[4, 5, 6, 7]], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, max_tokens=5, top_logprobs=3))[0]
    assert len(out.logprobs) == 5 and len(out.top_logprobs) == 5
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert top[0][0] == tok and top[0][1] == pytest.approx(lp)  # greedy: the top choice is the token
    plain = llm.generate(prompt_token_ids=[[4, 5, 6, 7]], use_tqdm=False,
                         sampling_params=SamplingParams(temperature=0, max_tokens=5))[0]
    assert plain.top_logprobs is None and plain.token_ids == out.token_ids


def test_shared_unseeded_params_give_each_request_its_own_seed(ckpt):
    llm = make_llm(ckpt)
    outs = llm.generate(prompt_token_ids=[[9, 9, 9]] * 4, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=1.0, max_tokens=8))
    assert len({o.seq_seed for o in outs}) == 4
    assert len({tuple(o.token_ids) for o in outs}) > 1, "four unseeded samples of one prompt should differ"
    seeded = llm.generate(prompt_token_ids=[[9, 9, 9]] * 2, use_tqdm=False,
                          sampling_params=SamplingParams(temperature=1.0, max_tokens=8, seq_seed=7))
    assert seeded[0].token_ids == seeded[1].token_ids and seeded[0].seq_seed == 7
