"""DSpark's draft step on the compiled executor: the stages' one parallel block pass and
the sequential sampling of the block, as device work with no host read (CUDA-graph safe).

Same math as ``DSparkDrafter.draft_logits`` + ``DSparkDrafter.draft``
(`deepinfer/spec/dspark_drafter.py`), on the fast path's kernels:

* the stages' block pass is the family's (``ModelFamily.dspark_stages_hidden``): V4's in
  `deepinfer/models/v4/fast/draft.py` (fused mHC, the fused MoE), V4.1's in
  `deepinfer/models/v41/fast/draft.py` (shifted hyper-connections);
* :func:`sample_block`: for j < n, ``d_{j+1} ~ logits_j + W2 W1[x_j]`` with the request's
  settings and the DRAFT stream at position ``p + 2 + j``, then ``c_{j+1} = sigmoid(w . [h_j ;
  W1[x_j]] / T_j)`` for every j at once; every draw stays on the device (``sample`` is the spec runner's
  ``sample_draft``, passed in so that this package does not import ``deepinfer.spec``).

The block's inputs come from one int64 tensor per bucket (:data:`INPUT_COLUMNS` then the
W - 1 context slots): ids, positions and the context's positions are derived on the device.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from deepinfer.engine.sampler import SamplingTensors

from ..rope import Rotary
from ..v4.dspark import NO_POSITION
from .decode import _inv_freq, grouped_out
from .fused_weights import project

#: Per-request columns of a draft step's input tensor, before the context slots.
INPUT_COLUMNS = ("last_token", "last_pos", "seed", "greedy", "temperature_bits")
N_COLS = len(INPUT_COLUMNS)


def block_rows(inp: torch.Tensor, gamma: int, window: int, noise_token: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [R * gamma], positions [R * gamma], context slots [R, W - 1], context positions
    [R, W - 1]) of R draft blocks from their input tensor ``inp`` [R, N_COLS + W - 1]: block r
    is [last token, noise x (gamma - 1)] at positions p+1..p+gamma and sees the W - 1
    positions before it (rows before 0 are padding at ``NO_POSITION``)."""
    r, dev = inp.shape[0], inp.device
    last_tok, last_pos = inp[:, 0], inp[:, 1]
    noise = torch.full((r, gamma - 1), noise_token, dtype=torch.long, device=dev)
    ids = torch.cat([last_tok[:, None], noise], dim=1).reshape(-1)
    pos = (last_pos[:, None] + 1 + torch.arange(gamma, device=dev)[None, :]).reshape(-1)
    ctx_pos = last_pos[:, None] + (2 - window) + torch.arange(window - 1, device=dev)[None, :]
    ctx_pos = torch.where(ctx_pos >= 0, ctx_pos, torch.full_like(ctx_pos, NO_POSITION))
    return ids, pos, inp[:, N_COLS:], ctx_pos


def device_rotary(rotary: Rotary, device: torch.device) -> Rotary:
    """A copy of ``rotary`` whose frequencies live on ``device``: `Rotary.cos_sin` moves them
    from the host on every call, a copy that a graph capture forbids."""
    out = copy.copy(rotary)
    out.inv_freq = _inv_freq(rotary, device)
    return out


def stage_block_attention(attn: torch.nn.Module, ops: Any, x: torch.Tensor, pos: torch.Tensor, gamma: int,
                          ctx_kv: torch.Tensor, ctx_pos: torch.Tensor, inv_freq: torch.Tensor, q_norm: str,
                          kv_quant: str = "none") -> torch.Tensor:
    """A DSpark stage's ``_block_attention`` on the fast path's kernels: x [R * gamma, D]
    (normed) -> [R * gamma, D]. One GEMM for [wq_a, wkv], q_norm, wq_b, the query's norm
    (``q_norm``: V4 ``unweighted``, V4.1 ``none``) + RoPE and kv's norm + RoPE (+ the window
    KV rounding ``kv_quant``) each one ``norm_rope``, the block attention with the output's
    inverse RoPE one ``draft_block_attention``, wo_a, wo_b: the reference's rms norms, three
    RoPEs and the attention's softmax pieces are dozens of small kernels a stage, which a
    graphed draft step pays one by one."""
    n, cfg = x.shape[0], attn.cfg
    proj = project(attn, "x", [attn.wq_a, attn.wkv], x)
    q_res = ops.rms_norm(proj[0], attn.q_norm.weight, attn.q_norm.eps)
    q = ops.norm_rope(attn.wq_b(q_res).view(n, attn.n_heads, attn.head_dim), pos, inv_freq, q_norm,
                      eps=cfg.rms_norm_eps)
    kv = ops.norm_rope(proj[1], pos, inv_freq, "weighted", attn.kv_norm.weight, attn.kv_norm.eps, quant=kv_quant,
                       quant_block=32)
    o = ops.draft_block_attention(q, kv, pos, gamma, ctx_kv, ctx_pos, attn.window, attn.attn_sink, inv_freq,
                                  out_dtype=x.dtype)
    return attn.wo_b(grouped_out(attn.wo_a, o.reshape(n, cfg.o_groups, -1), ops))


def write_context_kv(stages: list, ops: Any, features: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                     pools: list[torch.Tensor], inv_freq: torch.Tensor) -> None:
    """``DSparkDrafter._write_context`` of target-feature rows on the fast path's kernels:
    main_norm(main_proj(features)) [L, D], every stage's wkv in one GEMM, then per stage its
    kv_norm + RoPE (+ its window KV rounding) in one ``norm_rope`` and one scatter into its
    window pool (``pools[s]`` flattened to [rows, head_dim], rows ``slots``)."""
    s0 = stages[0]
    main_x = ops.rms_norm(s0.main_proj(features), s0.main_norm.weight, s0.main_norm.eps)
    kvs = project(s0, "dspark_context_wkv", [stage.attn.wkv for stage in stages], main_x)
    for stage, kv_raw, pool in zip(stages, kvs, pools):
        attn = stage.attn
        kv = ops.norm_rope(kv_raw, pos, inv_freq, "weighted", attn.kv_norm.weight, attn.kv_norm.eps,
                           quant=stage.window_kv_quant, quant_block=32)
        pool[slots] = kv.to(pool.dtype)


def draft_position(inp: torch.Tensor, j: int) -> torch.Tensor:
    """Position of draft j of every block of ``inp``: p + 2 + j (p: the last token's)."""
    return inp[:, 1] + 2 + j


def block_sampling(inp: torch.Tensor, j: int, greedy_only: bool) -> SamplingTensors:
    """Sampling tensors of draft j of every block (temperature only: steps with top-k / top-p /
    min-p run eagerly), position p + 2 + j, on the device."""
    r, dev = inp.shape[0], inp.device
    greedy = inp[:, 3] != 0
    temperature = inp[:, 4].to(torch.int32).view(torch.float32)
    return SamplingTensors(temperature=temperature, top_k=torch.full((r,), -1, dtype=torch.long, device=dev),
                           top_p=torch.ones(r, device=dev), min_p=torch.zeros(r, device=dev), seed=inp[:, 2],
                           position=draft_position(inp, j), greedy=greedy, max_top_logprobs=0, all_greedy=greedy_only,
                           any_top_k=False, any_top_p=False, any_min_p=False)


def sample_block(inp: torch.Tensor, logits: torch.Tensor, h: torch.Tensor, last_stage: Any,
                 temperatures: torch.Tensor, n: int, greedy_only: bool, sample: Callable, ops: Any = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sequential sampling of n drafts per block: logits [R, gamma, V] (no Markov bias yet),
    h [R, gamma, D], ``temperatures`` float32 [n] on the device (the confidence head's per
    position) -> (packed [R, 2n] int64: the tokens, then the confidences' float32 bits;
    q [R, n, V] or None when ``greedy_only``). Only the draws are sequential: the sampling
    tensors are built once and the confidences of all n positions come from one head call,
    so each draft costs the Markov bias and the draw (a graphed step pays every kernel). With
    ``ops`` (the fast path's) a greedy-only block takes all n draws from ``markov_greedy_draws``
    (n + 1 launches)."""
    markov, head = last_stage.markov_head, last_stage.confidence_head
    r = inp.shape[0]
    qs: list[torch.Tensor] = []
    if greedy_only and ops is not None and markov.markov_w1.quantized is None and markov.markov_w2.quantized is None:
        tokens = ops.markov_greedy_draws(logits, inp[:, 0], markov.markov_w1.weight, markov.markov_w2.weight, n)
        embs = markov.embedding(torch.cat([inp[:, :1], tokens[:, :n - 1]], dim=1))  # W1[token before draw j]
    else:
        params = block_sampling(inp, 0, greedy_only)
        prev, toks, emb_list = inp[:, 0], [], []
        for j in range(n):
            emb = markov.embedding(prev)
            emb_list.append(emb)
            if j and not greedy_only:  # greedy draws read no position
                params = dataclasses.replace(params, position=draft_position(inp, j))
            prev, q = sample(logits[:, j] + markov.bias(emb), params)
            toks.append(prev)
            if q is not None:
                qs.append(q)
        tokens, embs = torch.stack(toks, dim=1), torch.stack(emb_list, dim=1)
    conf = head(h[:, :n].reshape(r * n, -1), embs.reshape(r * n, -1), temperatures.repeat(r))
    conf_bits = conf.float().view(r, n).view(torch.int32).to(torch.int64)
    packed = torch.cat([tokens, conf_bits], dim=1)
    return packed, (torch.stack(qs, dim=1) if qs else None)


def unpack_block(packed: list[list[int]], n: int) -> tuple[list[list[int]], list[list[float]]]:
    """Host (tokens, confidences) per block of a :func:`sample_block` result read with one ``tolist``."""
    bits = torch.tensor([row[n:] for row in packed], dtype=torch.int64).to(torch.int32).view(torch.float32)
    return [row[:n] for row in packed], bits.tolist()


__all__ = ["INPUT_COLUMNS", "N_COLS", "block_rows", "block_sampling", "device_rotary", "sample_block",
           "stage_block_attention", "unpack_block", "write_context_kv"]
