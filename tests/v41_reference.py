"""A dense, single-sequence reference of the DeepSeek-V4.1 forward for the tests.

It reuses the model's parameters (and its n-gram hasher, tested on its own) but none of
its orchestration: no paged cache, no chunks, no per-request rings, no query blocks, no
sub-batches. Every layer sees the whole sequence at once with explicit dense masks, the
way transformers' DeepseekV41ForCausalLM computes a prefill. `cut` applies the
bounded-replay visibility (`mask` semantics) to the decoder layers' window.
KV-cache rounding is not simulated: compare models built with simulate_kv_quant=False.

The indexer's top-k is a discrete choice over float32 sums that often sit at zero (relu
zeroes many head scores, and weights of both signs can cancel what remains), so a sum that
one op order makes -5e-8 and another exactly 0 can pick a different entry and move the
logits by 1e-1: numerics, not a bug. The MoE router's top-k of score + bias is the same
kind of choice. ``ties`` (a list) collects, per index layer and per router, the rows whose
choice rests on such a near-tie, judged on float64 sums; tests draw another prompt
instead of comparing those (`unambiguous_tokens`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.models.moe import score
from deepinfer.models.rope import apply_rope


def _mix(streams, fn, base, scale, cfg):
    n = cfg.hc_mult
    flat = streams.reshape(streams.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    m = flat @ fn.float().T
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax((m[:, 2 * n:] * scale[2] + base[2 * n:]).view(-1, n, n), dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(1, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(2, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(1, keepdim=True) + cfg.hc_eps)
    return pre, post, comb


def _collapse(streams, pre):
    return (pre[:, :, None] * streams.float()).sum(1).to(streams.dtype)


def _expand(out, streams, post, comb):
    # new stream k = post_k * out + sum_j comb[j, k] * old stream j
    mixed = (comb[:, :, :, None] * streams.float()[:, :, None, :]).sum(1)
    return (post[:, :, None] * out.float()[:, None, :] + mixed).to(streams.dtype)


#: a selected and an unselected score closer than this (relative to the row's largest) and
#: not exactly equal is a near-tie: float32 op order may swap them
NEAR_TIE_REL = 1e-6


def _near_tie_rows(scores64: torch.Tensor, k: int) -> list[int]:
    """Rows of ``scores64`` [t, g] (float64, -inf = unavailable, +inf = always kept) whose top-``k`` boundary
    has an unselected score within NEAR_TIE_REL of the k-th that is not exactly equal to it
    (exact ties, e.g. relu's zeros, break by entry id on every path)."""
    rows = []
    order = torch.sort(scores64, dim=-1, descending=True, stable=True).values
    for row in range(scores64.shape[0]):
        forced = int((order[row] == float("inf")).sum())  # always kept: not part of the contest
        vals = order[row][(order[row] > float("-inf")) & (order[row] < float("inf"))]
        k_row = k - forced
        if k_row <= 0 or len(vals) <= k_row:
            continue
        eps = NEAR_TIE_REL * float(vals.abs().max())
        kth, rest = vals[k_row - 1], vals[k_row:]
        near = rest[(kth - rest) <= eps]
        if len(near) and not bool((near == kth).all() and (vals[:k_row][(vals[:k_row] - kth) <= eps] == kth).all()):
            rows.append(row)
    return rows


def _router_scores64(gate, x: torch.Tensor) -> torch.Tensor:
    """The router's selection scores (score + bias) in float64: its top-k is the same kind
    of discrete choice as the indexer's, and a batch of another size may round it apart."""
    with torch.no_grad():
        return score(x.double() @ gate.weight.double().T / gate.temp, gate.func) + gate.bias.double()


def unambiguous_tokens(model, draw, cuts: tuple[int, ...] = (0,), tries: int = 20, views=None) -> list[int]:
    """The first of ``draw()``'s token lists whose dense reference (at each replay cut of
    ``cuts``; of each sequence ``views(tokens)`` makes of them, default the list itself) makes
    no near-tie choice (see the module doc); fails after ``tries`` draws."""
    for _ in range(tries):
        tokens = draw()
        ties: list = []
        for seq in (views(tokens) if views else [tokens]):
            for cut in cuts:
                dense_logits(model, seq, cut=cut, ties=ties)
        if not ties:
            return tokens
    raise AssertionError(f"{tries} prompts in a row hit an indexer near-tie")


def _candidates(scores, lens, topk_blocks, block):
    t, g = scores.shape
    nb = -(-g // block)
    blocks = F.pad(scores, (0, nb * block - g), value=float("-inf")).view(t, nb, block).amax(-1)
    for row in range(t):
        if lens[row] > 0:
            blocks[row, (lens[row] - 1) // block] = float("inf")
    keep = torch.zeros(t, nb, dtype=torch.bool)
    for row in range(t):
        order = torch.sort(blocks[row], descending=True, stable=True)
        for j in range(min(topk_blocks, nb)):
            if order.values[j] > float("-inf"):
                keep[row, order.indices[j]] = True
    return keep.repeat_interleave(block, dim=1)[:, :g]


@torch.no_grad()
def dense_logits(model, tokens: list[int], cut: int = 0, ties: list | None = None) -> torch.Tensor:
    cfg = model.cfg
    t, w, hc = len(tokens), cfg.sliding_window, cfg.hc_mult
    ids = torch.tensor(tokens)
    pos = torch.arange(t)
    streams = model.embed(ids)[:, None, :].repeat(1, hc, 1)
    pre = torch.zeros(t, hc)
    pre[:, 0] = 1
    hashes = None
    if model.hasher is not None:
        lb = model.hasher.lookback
        hashes = model.hasher(torch.cat([torch.full((lb,), -1), ids]), 0)
    entries, index_keys, sel, cand = {}, {}, None, None
    start = cfg.replay_start_layer
    for i, layer in enumerate(model.layers):
        attn, r = layer.attn, cfg.compress_ratios[i]
        if layer.engram_index is not None:
            streams = layer.engram(streams, hashes[:, layer.engram_index])
        a_pre, a_post, a_comb = _mix(streams, layer.hc_attn_fn, layer.hc_attn_base, layer.hc_attn_scale, cfg)
        x = layer.attn_norm(_collapse(streams, pre))
        rot = model.rotary_compress if r else model.rotary_main
        cos, sin = rot.cos_sin(pos, x.dtype)
        if i in cfg.kv_source_layer_ids:
            comp, g = attn.compressor, t // r
            if r == 1:
                lat = comp.norm(comp.wkv(x))
            else:
                kv_f = x.float() @ comp.wkv.weight.float().T
                gate_f = x.float() @ comp.wgate.weight.float().T
                kv_g = kv_f[: g * r].view(g, r, kv_f.shape[-1])
                gate_g = gate_f[: g * r].view(g, r, kv_f.shape[-1])
                lat = comp.norm((kv_g * gate_g.softmax(dim=1)).sum(1).to(x.dtype))
            c2, s2 = model.rotary_compress.cos_sin(torch.arange(g) * r, x.dtype)
            index_keys[i] = apply_rope(attn.indexer.k_norm(attn.indexer.wk(lat)), c2, s2)
            entries[i] = apply_rope(lat, c2, s2)
        h, d = attn.n_heads, attn.head_dim
        q_res = attn.q_norm(attn.wq_a(x))
        q = apply_rope(attn.wq_b(q_res).view(t, h, d), cos, sin)
        kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin)
        floor = cut if start is not None and i >= start else 0
        kp, qp = pos[None, :], pos[:, None]
        visible = (kp <= qp) & (kp > qp - w) & (kp >= floor)
        logits = torch.einsum("thd,kd->thk", q, kv).float() * d ** -0.5
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        parts, values = [logits], [kv]
        if r:
            src = cfg.kv_source_of(i)
            ent = entries[src]
            g = ent.shape[0]
            lens = (pos + 1) // r
            reach = torch.arange(g)[None, :] < lens[:, None]
            if i in cfg.index_source_layer_ids:
                ix = attn.indexer
                ci, si = model.rotary_compress.cos_sin(pos, x.dtype)
                qi = apply_rope(ix.wq_b(q_res).view(t, ix.n_heads, ix.dim), ci, si)
                sc = torch.relu(torch.einsum("thd,gd->thg", qi.float(), index_keys[src].float())) * ix.dim ** -0.5
                wts = ix.weights_proj(x).float() * ix.n_heads ** -0.5
                s = (sc * wts[:, :, None]).sum(1).masked_fill(~reach, float("-inf"))
                c = cfg.candidate_source_layer_id
                if ties is not None:  # the same sums in float64, for the near-tie check
                    sc64 = torch.relu(torch.einsum("thd,gd->thg", qi.double(), index_keys[src].double()))
                    s64 = (sc64 * ix.dim ** -0.5 * wts.double()[:, :, None]).sum(1).masked_fill(~reach, float("-inf"))
                    if i == c:
                        bs = cfg.candidate_block_size
                        nb = -(-g // bs)
                        blocks = F.pad(s64, (0, nb * bs - g), value=float("-inf")).view(t, nb, bs).amax(-1)
                        # the newest block is always kept (as `_candidates` does): the others compete for the rest
                        for row in range(t):
                            if lens[row] > 0:
                                blocks[row, (lens[row] - 1) // bs] = float("inf")
                        ties += [(i, "blocks", row) for row in _near_tie_rows(blocks, cfg.candidate_topk_blocks)]
                if i == c:
                    cand = _candidates(s, lens, cfg.candidate_topk_blocks, cfg.candidate_block_size)
                elif 0 <= c < i and cand is not None:
                    s = s.masked_fill(~cand, float("-inf"))
                    if ties is not None:
                        s64 = s64.masked_fill(~cand, float("-inf"))
                if ties is not None:
                    ties += [(i, "entries", row) for row in _near_tie_rows(s64, cfg.index_topk)]
                sel = torch.zeros(t, g, dtype=torch.bool)
                order = torch.sort(s, dim=-1, descending=True, stable=True)
                k = min(cfg.index_topk, g)
                for row in range(t):
                    for j in range(k):
                        if order.values[row, j] > float("-inf"):
                            sel[row, order.indices[row, j]] = True
            comp_logits = torch.einsum("thd,gd->thg", q, ent).float() * d ** -0.5
            parts.append(comp_logits.masked_fill(~sel[:, None, :], float("-inf")))
            values.append(ent)
        sink = attn.attn_sink.float()[None, :, None].expand(t, -1, 1)
        probs = torch.softmax(torch.cat(parts + [sink], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("thk,kd->thd", probs.to(kv.dtype), torch.cat(values))
        out = apply_rope(out, cos, -sin)
        out = attn.wo_b(attn.wo_a(out.reshape(t, cfg.o_groups, -1)))
        streams = _expand(out, streams, a_post, a_comb)
        f_pre, f_post, f_comb = _mix(streams, layer.hc_ffn_fn, layer.hc_ffn_base, layer.hc_ffn_scale, cfg)
        x = layer.ffn_norm(_collapse(streams, a_pre))
        if ties is not None:
            ties += [(i, "experts", row) for row in _near_tie_rows(_router_scores64(layer.ffn.gate, x), layer.ffn.gate.top_k)]
        streams = _expand(layer.ffn(x, ids), streams, f_post, f_comb)
        pre = f_pre
    return model.compute_logits(_collapse(streams, pre))
