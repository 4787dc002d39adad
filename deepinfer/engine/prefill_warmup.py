"""Prefill / mixed step compiles (and the sampler's) moved from the first ``generate()`` to engine start.

Triton compiles a kernel once per specialization of its launch: integer arguments equal
to 1, divisible by 16, or neither are three different binaries (and so are the step's
static flags). The memory profile's worst-case step (``memory_profile.worst_case_step``)
compiles only its own kind: one fresh request of ``max_num_batched_tokens`` tokens. A
first ``generate()`` of a few short prompts, the second chunk of a long one, or a step
where new prompts join decoding requests would compile its variants while the user
waits, which the decode grid (``profiling/decode_grid.py``) reports as the first call
against the steady state. :func:`warm_prefill_kinds` runs such steps once over a
throwaway cache on the prefill path the engine takes, before the KV cache exists (the
graphs of pure-decode steps are captured separately, ``FastPath.warmup``).

The sampler of a step that is not an all-greedy graphed decode (every prefill step, mixed
steps, sampled requests) has kernels of its own: the fused argmax / log-sum-exp reduction
without the greedy lane's packed output is another binary than the one the decode graphs
compiled. :func:`warm_sampler` runs each lane of ``Sampler.sample`` once on the device.

On a GPU the kinds above are not enough. A bf16 GEMM costs extra the first time the
process runs it at a token count M (profiling/gemm_first_use.py: per new M, with lazy and
eager CUDA module loading alike, so it is per-shape setup, not module loads), so a first
prefill at a token count no start-up step ran (8 prompts of 100 tokens: M = 800) pays it
in every linear layer. :func:`token_ladder` runs prefill steps over a geometric ladder of
common token counts up to the step budget, a few requests each; a count off the ladder
still pays it once. :func:`prefix_ladder` runs prompts that continue after a prefix-cache
hit, over block tables of every width class, for the Triton kernels specialised on them.
"""

from __future__ import annotations

import torch

from deepinfer.config import EngineConfig
from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
from deepinfer.models.registry import family_of

def step_kinds(block_size: int) -> list[tuple[tuple[int, int, bool], ...]]:
    """The step kinds warmed, as (start, length, is_new) per request: one 1-token prompt;
    four new prompts of odd lengths (up to 16 rows and 17..32 rows: the prefill indexer's
    row tiles of 16 and 32; the second chunk's 33 takes its 64); the second chunk of a
    prompt (after one block) beside a decoding request; 16 one-token prompts (a count
    divisible by 16)."""
    return [((0, 1, True),),
            ((0, 5, True), (0, 11, True), (0, 13, True), (0, 21, True)),
            ((block_size, 33, False), (5, 1, False)),
            tuple((0, 1, True) for _ in range(16))]


#: total tokens of the ladder's steps: geometric, x1.25 .. x1.5 apart (800 = 8 prompts of 100)
LADDER_TOKENS = (48, 64, 96, 128, 192, 256, 384, 512, 640, 800, 1024, 1280, 1536, 2048, 2560, 3072,
                 4096, 5120, 6144, 8192, 12288, 16384)


def token_ladder(max_tokens: int, max_seqs: int, max_model_len: int,
                 requests: int = 8) -> list[tuple[tuple[int, int, bool], ...]]:
    """Step kinds of :data:`LADDER_TOKENS` up to ``max_tokens``, each total split over
    ``requests`` new prompts (the last takes the remainder), or over as many as prompts of
    at most ``max_model_len`` tokens need (a short-context engine's full step holds many
    prompts); at most ``max_seqs``: a total that still does not fit is dropped."""
    out = []
    for total in LADDER_TOKENS:
        if total > max_tokens:
            break
        n = max(1, min(max(requests, -(-total // max_model_len)), max_seqs))
        each, rest = divmod(total, n)
        lengths = [each] * (n - 1) + [each + rest]
        if each >= 1 and max(lengths) <= max_model_len:
            out.append(tuple((0, length, True) for length in lengths))
    return out


def prefix_ladder(block_size: int, max_model_len: int, max_tokens: int,
                  max_start: int = 1 << 20) -> list[tuple[tuple[int, int, bool], ...]]:
    """One request continuing after a prefix-cache hit, for k = 1, 2, ...: ``block_size``
    new tokens after ``block_size * (2**k - 1)`` cached ones (a table of exactly 2**k
    blocks) and 37 after ``block_size * 2**k`` (2**k + 1 blocks). Triton specialises a
    kernel on integer arguments divisible by 16, and the table width is one (its row
    stride): both kinds of width, over every power-of-two class, as a first prompt that
    shares a long system prompt would meet them."""
    out, blocks = [], 2
    while block_size * blocks <= max_start:
        for start, length in ((block_size * (blocks - 1), block_size), (block_size * blocks, 37)):
            if start + length <= max_model_len and length <= max_tokens:
                out.append(((start, length, False),))
        blocks *= 2
    return out


def _step(kind: tuple[tuple[int, int, bool], ...], block_size: int, groups: list[str],
          device: torch.device, vocab: int) -> tuple[ForwardBatch, int]:
    """The kind's batch over a cache whose requests own consecutive blocks; (batch, blocks)."""
    seqs, ids, pos, next_block, offset = [], [], [], 0, 0
    for slot, (start, length, is_new) in enumerate(kind):
        # blocks wholly before ``start`` (a prefix-cache hit) are only read: one shared block
        # stands for them all, so a long prefix costs the throwaway cache one block
        n_blocks, n_prefix = -(-(start + length) // block_size), start // block_size
        first_own = next_block + (1 if n_prefix else 0)  # after the shared block, if any
        own = list(range(first_own, first_own + n_blocks - n_prefix))
        table = {g: [next_block] * n_prefix + own for g in groups}
        next_block = first_own + len(own)
        seqs.append(SeqMeta(start, length, offset, table, slot, is_new=is_new, prompt_len=start + length))
        ids += [(7 * slot + 3 * j) % vocab for j in range(length)]
        pos += list(range(start, start + length))
        offset += length
    batch = ForwardBatch(torch.tensor(ids, device=device), torch.tensor(pos, device=device), seqs)
    return batch, next_block


def _zero_tensors(cache: object) -> None:
    """Zero every tensor of a throwaway cache (its attributes, and tensors in dict attributes).
    Caches are allocated uninitialised, and the kinds that continue a request read rows no
    earlier step of the warm-up wrote: V4.1's Engram reads its token history as indices."""
    for value in vars(cache).values():
        for t in (value.values() if isinstance(value, dict) else (value,)):
            if isinstance(t, torch.Tensor):
                t.zero_()


@torch.no_grad()
def warm_prefill_kinds(model: torch.nn.Module, config: EngineConfig, device: torch.device,
                       ladder: bool | None = None) -> int:
    """Run every kind of :func:`step_kinds` once on the engine's prefill path (when it has
    a compiled one) over a throwaway cache, then (``ladder``; default: on CUDA) the steps of
    :func:`token_ladder` and :func:`prefix_ladder`; returns how many ran (0: nothing to compile)."""
    family = family_of(model.cfg)
    if config.batch_invariant or family.prefill_executor is None:
        return 0
    mcfg, bs = model.cfg, config.block_size
    groups = family.kv_group_names(mcfg)
    kinds = step_kinds(bs)
    if ladder is None:
        ladder = device.type == "cuda"  # what it saves is GEMM setup and Triton compiles on a GPU
    if ladder:
        kinds += token_ladder(config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len)
        kinds += prefix_ladder(bs, config.max_model_len, config.max_num_batched_tokens)
    steps = [_step(kind, bs, groups, device, mcfg.vocab_size) for kind in kinds
             if max(s + n for s, n, _ in kind) <= config.max_model_len
             and sum(n for _, n, _ in kind) <= config.max_num_batched_tokens and len(kind) <= config.max_num_seqs]
    if not steps:
        return 0
    blocks = max(n for _, n in steps)
    cache = family.new_kv_cache(mcfg, dict.fromkeys(groups, blocks), bs, max(len(b.seqs) for b, _ in steps),
                                model.dtype, device)
    _zero_tensors(cache)
    prefill = family.prefill_executor(model, cache)  # as ModelRunner builds it
    if prefill is None:
        return 0
    ran = 0
    for batch, _ in steps:
        meta = prefill.prepare(batch)
        if meta is None:  # a kind this path does not take (the reference path serves it: nothing compiles)
            continue
        last = torch.tensor([s.offset + s.length - 1 for s in batch.seqs], device=device)
        model.compute_logits(prefill.forward(batch, meta, last))
        ran += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ran


@torch.no_grad()
def warm_sampler(vocab_size: int, device: torch.device, rows: int = 4) -> list[str]:
    """Run ``Sampler.sample`` once per lane on throwaway float32 logits [rows, vocab_size]
    (the vocabulary sets the kernels' row stride): all greedy (the fused reduction, unpacked),
    greedy beside a sampled top-p / top-k / min-p row, and a row asking for top log-probs;
    returns the lanes run, in order."""
    from deepinfer.engine.sampler import Sampler, SamplingTensors
    from deepinfer.sampling_params import SamplingParams

    if rows < 2:
        raise ValueError(f"warm_sampler: rows must be >= 2 (a greedy row beside a sampled one), got {rows}")
    lanes = {"greedy": [SamplingParams(temperature=0, seq_seed=0)] * rows,
             "sampled": [SamplingParams(temperature=0, seq_seed=0)] * (rows - 1)
             + [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seq_seed=1)],
             "top_logprobs": [SamplingParams(temperature=0, seq_seed=0)] * (rows - 1)
             + [SamplingParams(temperature=0, top_logprobs=2, seq_seed=2)]}
    logits = torch.randn(rows, vocab_size, device=device, dtype=torch.float32)
    sampler = Sampler()
    for params in lanes.values():
        sampler.sample(logits, SamplingTensors.from_params(params, list(range(rows)), device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return list(lanes)
