"""MoE router: scores, biased top-k (or hash lookup), gather, normalise, scale.

Same math as ``deepinfer.models.moe.Gate`` applied to the gate logits [T, E]
(the gate GEMM stays in cuBLAS), with torch's rounding points kept when the logits
are bf16: ``s = round(sqrt(round(softplus(l))))`` (``sqrtsoftplus``; softplus has
torch's threshold 20) or ``round(sigmoid(l))``; selection on ``s + bias`` in float32;
``w = s[ids]``, ``w = round(w / (round(sum w) + 1e-20))`` when normalising, then
``round(w * route_scale)``. Weights come back in the logits' dtype, ids as int32.

Order and ties: slots are in descending order of ``s + bias``; among exactly equal
values the lowest expert index wins (``torch.topk`` leaves ties unspecified, so the
reference may pick another of several tied experts). Hash routing (``tid2eid``) keeps
the table's slot order. Limits: E <= 1024 (one register tile per row), k <= 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to


@triton.jit
def _score(logit, FUNC: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr):
    """Expert affinity from a float32 logit; FUNC 0 = sqrtsoftplus, 1 = sigmoid."""
    if FUNC == 0:
        u = tl.exp(tl.minimum(logit, 20.0))  # above 20 softplus is the identity
        w = 1.0 + u
        exact = w == 1.0
        log1p = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))  # accurate log1p(u)
        sp = tl.where(logit > 20.0, logit, log1p)
        s = round_to(tl.sqrt(round_to(sp, CODE, INTERP)), CODE, INTERP)
    else:
        s = round_to(1.0 / (1.0 + tl.exp(-logit)), CODE, INTERP)
    return s


@triton.jit(do_not_specialize=["T"])
def _router_kernel(logits_ptr, bias_ptr, tid2eid_ptr, ids_in_ptr, w_out_ptr, id_out_ptr,
                   T, E, stride_l, stride_tab, route_scale, extra_id,
                   K: tl.constexpr, EXTRA: tl.constexpr, HASH: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                   FUNC: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    tmask = toks < T
    emask = experts < E
    toks64 = toks.to(tl.int64)
    logit = tl.load(logits_ptr + toks64[:, None] * stride_l + experts[None, :],
                    mask=tmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
    s = _score(logit, FUNC, CODE, INTERP)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    ws = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    if HASH:
        tok_ids = tl.load(ids_in_ptr + toks64, mask=tmask, other=0).to(tl.int64)
        for j in tl.static_range(K):
            e = tl.load(tid2eid_ptr + tok_ids * stride_tab + j, mask=tmask, other=0).to(tl.int32)
            w = tl.sum(tl.where(experts[None, :] == e[:, None], s, 0.0), axis=1)
            ids = tl.where(slots[None, :] == j, e[:, None], ids)
            ws = tl.where(slots[None, :] == j, w[:, None], ws)
    else:
        sel = s
        if HAS_BIAS:
            sel = s + tl.load(bias_ptr + experts, mask=emask, other=0.0)[None, :]
        sel = tl.where(emask[None, :], sel, float("-inf"))
        for j in tl.static_range(K):
            best = tl.max(sel, axis=1)
            e = tl.min(tl.where(sel == best[:, None], experts[None, :], BLOCK_E), axis=1)
            hit = experts[None, :] == e[:, None]
            w = tl.sum(tl.where(hit, s, 0.0), axis=1)
            sel = tl.where(hit, float("-inf"), sel)
            ids = tl.where(slots[None, :] == j, e[:, None], ids)
            ws = tl.where(slots[None, :] == j, w[:, None], ws)
    if NORMALIZE:
        total = round_to(tl.sum(ws, axis=1), CODE, INTERP)
        ws = round_to(ws / (total[:, None] + 1e-20), CODE, INTERP)
    ws = round_to(ws * route_scale, CODE, INTERP)
    if EXTRA:  # an always-on slot after the routed ones (the shared expert): weight 1
        ws = tl.where(slots[None, :] == K, 1.0, ws)
        ids = tl.where(slots[None, :] == K, extra_id, ids)
    out_mask = tmask[:, None] & (slots[None, :] < K + EXTRA)
    offs = toks64[:, None] * (K + EXTRA) + slots[None, :]
    tl.store(w_out_ptr + offs, ws.to(w_out_ptr.dtype.element_ty), mask=out_mask)
    tl.store(id_out_ptr + offs, ids, mask=out_mask)


_FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1}


def router(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, route_scale: float = 1.0,
           normalize: bool = True, func: str = "sqrtsoftplus", tid2eid: torch.Tensor | None = None,
           input_ids: torch.Tensor | None = None, extra_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens from gate logits [T, E] (bf16/fp32).

    Routed layers: pass `bias` (float32 [E], or None). Hash layers: pass `tid2eid`
    ([vocab, >=k] int) and `input_ids` ([T] int). Returns (weights [T, k] in the logits'
    dtype, expert ids [T, k] int32). ``extra_id`` appends one slot (weight 1, that id) to
    every token: the shared expert stacked after the routed ones for ``fused_moe``.
    """
    check_device(logits)
    if func not in _FUNCS:
        raise ValueError(f"router: unsupported score function {func!r}")
    t, e = logits.shape
    assert logits.stride(1) == 1 and 1 <= top_k <= min(16, e) and e <= 1024
    extra = extra_id is not None
    weights = torch.empty(t, top_k + extra, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k + extra, dtype=torch.int32, device=logits.device)
    is_hash = tid2eid is not None
    if is_hash:
        assert input_ids is not None and tid2eid.stride(1) == 1 and tid2eid.shape[1] >= top_k
    block_e = next_pow2(e)
    block_t = max(1, min(16, 4096 // block_e))
    if t:
        _router_kernel[(triton.cdiv(t, block_t),)](
            logits, bias if bias is not None else logits, tid2eid if is_hash else ids,
            input_ids if is_hash else ids, weights, ids, t, e, logits.stride(0),
            tid2eid.stride(0) if is_hash else 0, float(route_scale), int(extra_id or 0),
            K=top_k, EXTRA=extra, HASH=is_hash, HAS_BIAS=bias is not None, NORMALIZE=normalize, FUNC=_FUNCS[func],
            CODE=dtype_code(logits.dtype), INTERP=interpreting(), BLOCK_T=block_t, BLOCK_E=block_e,
            BLOCK_K=next_pow2(top_k + extra), num_warps=4)
    return weights, ids


def router_ref(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, route_scale: float = 1.0,
               normalize: bool = True, func: str = "sqrtsoftplus", tid2eid: torch.Tensor | None = None,
               input_ids: torch.Tensor | None = None, extra_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference with the signature of :func:`router`: ``Gate.forward`` after its
    GEMM (``deepinfer.models.moe.score``, ``torch.topk(sorted=False)``)."""
    from deepinfer.models.moe import score

    scores = score(logits, func)
    if tid2eid is not None:
        ids = tid2eid[input_ids][:, :top_k].long()
    else:
        ids = torch.topk(scores if bias is None else scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights, ids = weights * route_scale, ids.to(torch.int32)
    if extra_id is not None:
        weights = torch.cat([weights, weights.new_ones(weights.shape[0], 1)], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], extra_id)], dim=1)
    return weights, ids
