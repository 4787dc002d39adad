"""The HF transformers baseline of benchmarks/fastpath_bench.py: ``DeepseekV4ForCausalLM``
with the same config and random weights, timed with eager ``generate()`` (REFERENCE.md
section 5: its static cache does not support V4's compressed layers and torch.compile
did not finish, so eager generate is the practical baseline).

Decode tok/s = B * n / (t(generate 1 + n tokens) - t(generate 1 token)), i.e. without
the prefill; prefill tok/s = T / t(one forward over the prompt with a cache).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch


def build_hf(cfg, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """transformers' model for our config (official legacy keys), random weights on ``device``;
    hash-routing tables filled with random experts (transformers initialises them to 0,
    which would send every token to expert 0 and flatter its timings)."""
    import transformers

    path = tempfile.mkdtemp(prefix="hf_cfg_")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg.to_official_json(), "deepinfer_tokenizer": "bundled"}, f)  # random ids: the bundled tokenizer, on purpose
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: a float32 flash4 would not fit next to nothing
    try:
        with torch.device(device):
            model = transformers.DeepseekV4ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                noise = torch.rand(buf.shape[0], cfg.n_routed_experts, generator=gen, device=device)
                buf.copy_(noise.argsort(dim=-1)[:, :buf.shape[1]])
    return model.eval()


def _sync_time(fn) -> float:
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return time.perf_counter() - t


@torch.no_grad()
def hf_decode(model: torch.nn.Module, batch: int, prompt_len: int, new: int, vocab: int, seed: int = 0) -> dict:
    """Decode tok/s of eager greedy generate() at ``batch`` prompts of ``prompt_len`` ids."""
    device = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(10, vocab - 10, (batch, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> None:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)

    gen(2)  # warm-up
    t1 = _sync_time(lambda: gen(1))
    tn = _sync_time(lambda: gen(1 + new))
    dt = max(tn - t1, 1e-9)
    return {"tok_s": round(batch * new / dt, 1), "step_ms": round(dt / new * 1e3, 3)}


@torch.no_grad()
def hf_prefill(model: torch.nn.Module, tokens: int, vocab: int, seed: int = 0) -> dict:
    """Prefill tok/s: one forward over a ``tokens``-long prompt, building the cache."""
    device = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(10, vocab - 10, (1, tokens), generator=g).to(device)
    mask = torch.ones_like(ids)

    def fwd() -> None:
        try:
            model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        except TypeError:
            model(input_ids=ids, attention_mask=mask, use_cache=True)

    fwd()  # warm-up
    dt = _sync_time(fwd)
    return {"tok_s": round(tokens / dt, 1), "ms": round(dt * 1e3, 2)}
