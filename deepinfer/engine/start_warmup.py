"""Serve throwaway requests through the whole engine loop before the first real one.

The start-up warm-ups compile kernels and capture graphs (``ModelRunner.warmup``,
``engine/prefill_warmup.py``), but a process's first ``generate()`` also pays for every
host path's first run: lazy imports, the output processor's and detokenizer's first
decode, first-use allocations in the scheduler, sampler and result copies. The decode grid
(``profiling/decode_grid.py``) sees it as the first engine of a process slower on its first
call than a second engine in the same process. SGLang sends a warm-up request at server
start for the same reason; here the engine does it itself, so the offline ``LLM``, the
server and the benchmark scripts all get it.

It covers the loop at its own small shapes only: a first prefill of a token count no
start-up step ran still pays first-use costs inside its matrix products
(``profiling/first_generate_profile.py`` measures where the first call's time goes).

The requests are built to leave nothing behind: prompt + output stay inside one KV block,
so no block is ever full and none is hashed into the prefix cache; their outputs are
dropped; the step and request metrics (engine and speculative) restart afterwards.
"""

from __future__ import annotations

from typing import Any

from deepinfer.engine.admission import admit_generate
from deepinfer.sampling_params import SamplingParams

__all__ = ["warm_engine_loop", "warmup_requests", "WARMUP_ID_PREFIX"]

#: request ids of the warm-up requests (never an id the LLM or the server hands out)
WARMUP_ID_PREFIX = "__deepinfer_warmup"
PROMPT_TOKENS = 16
NEW_TOKENS = 4


def warmup_requests(vocab_size: int, block_size: int) -> list[tuple[list[int], SamplingParams]]:
    """(prompt ids, params) of the warm-up: one greedy request and one sampled request with
    top log-probs (the sampler's two lanes). Prompt + output stay below ``block_size``
    tokens; an empty list when a block is too small for that (then nothing is served)."""
    prompt = min(PROMPT_TOKENS, block_size - NEW_TOKENS - 1)
    if prompt < 1:
        return []
    ids = [(17 + 31 * i) % vocab_size for i in range(prompt)]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, seq_seed=0)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=NEW_TOKENS, ignore_eos=True,
                             top_logprobs=2, seq_seed=1)
    return [(ids, greedy), (ids[::-1], sampled)]


def warm_engine_loop(core: Any) -> int:
    """Serve :func:`warmup_requests` through ``core``'s own loop (async or synchronous,
    speculative or not), drop their outputs and restart the metrics; returns how many
    requests ran."""
    requests = warmup_requests(core.model_config.vocab_size, core.config.block_size)
    if not requests:
        return 0
    items, params = admit_generate(core, None, [sp for _, sp in requests], [ids for ids, _ in requests])
    rids = [f"{WARMUP_ID_PREFIX}-{i}" for i in range(len(items))]
    try:
        for rid, (_, tokens), sp in zip(rids, items, params):
            core.add_request(rid, tokens, sp)
        while core.has_unfinished():
            core.step()
    except BaseException:
        core.discard_in_flight()
        for rid in rids:
            core.abort(rid)
        raise
    for rid in rids:
        core.output(rid)  # detokenizes (its first run) and forgets the request
    core.metrics.reset()
    if core.runner.spec is not None:
        core.runner.spec.metrics.reset()
    return len(rids)
