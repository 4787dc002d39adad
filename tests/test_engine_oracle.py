"""End to end: LLM.generate (greedy) == transformers' generate() token for token on the
same tiny checkpoint, under every scheduling mode (chunked prefill on/off, prefix
caching on/off, a KV pool small enough to force preemption)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

transformers = pytest.importorskip("transformers")
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    cfg = tiny_config(vocab_size=1024, sliding_window=32)
    write_tiny_checkpoint(str(path), seed=11, cfg=cfg)
    return str(path)


@pytest.fixture(scope="module")
def prompts_and_reference(checkpoint):
    """Mixed prompts (shared prefixes, > window, > 128 so HCA compresses, odd lengths)
    and transformers' greedy continuations of each, generated one prompt at a time."""
    rng = random.Random(5)
    shared = [rng.randrange(1024) for _ in range(256)]
    prompts = [
        [rng.randrange(1024) for _ in range(5)],
        shared + [rng.randrange(1024) for _ in range(21)],
        shared + [rng.randrange(1024) for _ in range(40)],
        [rng.randrange(1024) for _ in range(129)],
        shared[:130] + [rng.randrange(1024) for _ in range(3)],
        [rng.randrange(1024) for _ in range(301)],
        [rng.randrange(1024) for _ in range(33)],
    ]
    orig_topk = torch.Tensor.topk

    def stable(self, k, dim=-1, largest=True, sorted=True):
        v, i = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))

    torch.Tensor.topk = stable  # see conftest.stable_topk
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
            hf.generation_config.eos_token_id = None  # like ignore_eos: EOS may be emitted, never stops
            refs = []
            for p in prompts:
                ids = torch.tensor([p])  # explicit mask: a prompt may contain the pad id
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=0)
                refs.append(out[0, len(p):].tolist())
    finally:
        torch.Tensor.topk = orig_topk
    return prompts, refs


@pytest.mark.parametrize("mode", [
    dict(),
    dict(chunked_prefill=False, max_num_batched_tokens=4096),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=64),  # many small chunks
    dict(num_kv_blocks=6, max_num_batched_tokens=128),  # forces preemption
])
def test_greedy_matches_transformers(checkpoint, prompts_and_reference, mode):
    prompts, refs = prompts_and_reference
    llm = LLM(checkpoint, dtype="float32", max_model_len=512, max_num_seqs=8, **mode)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # Twice: the second pass starts from whatever the first left in the prefix cache.
    for attempt in range(2):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        for i, (out, ref) in enumerate(zip(outs, refs)):
            assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) under {mode}, pass {attempt}"
            assert out.finish_reason == "length"
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    if llm.config.enable_prefix_caching and not mode.get("num_kv_blocks"):
        assert cached >= 4 * 128, "the second pass should hit the prefix cache"
    if not llm.config.enable_prefix_caching:
        assert cached == 0
    if mode.get("num_kv_blocks"):
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the small pool should force preemption"
    llm.kv_manager.assert_consistent()
    for name, pool in llm.kv_manager.pools.items():
        assert pool.num_free == pool.num_blocks, f"group {name} leaked blocks"
