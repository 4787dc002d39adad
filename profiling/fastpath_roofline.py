"""Bytes and FLOPs a DeepSeek-V4 decode / prefill step must move and compute, for the
roofline figures of benchmarks/fastpath_bench.py (against the ceilings of one H200 measured
in REFERENCE.md section 5: copy bandwidth and bf16 matmul).

Counted from the model object:

* weights: every parameter (a quantized Linear: its stored bytes, its logical parameters
  for FLOPs) except the MTP stages, the embedding (only B rows are read)
  and the routed experts; routed experts as the expected number of distinct experts B
  tokens touch per layer, ``E * (1 - (1 - k / E) ** B)`` (uniform routing: random weights);
* KV read per request and layer at context c: the window ``min(c, W)`` rows, HCA entries
  ``c // 128``, CSA selected entries ``min(top_k, c // 4)`` plus the indexer keys ``c // 4``;
* FLOPs: 2 x active parameters per token (non-routed + k experts) plus attention
  (``4 * H * D`` per key) and indexer scores (``2 * H_idx * D_idx`` per key).
"""

from __future__ import annotations

from dataclasses import dataclass

HBM_BYTES_S = 4.2e12
PEAK_FLOP_S = 800e12


def _weights(root, skip: set) -> tuple[int, int]:
    """(parameters, bytes) of root's weights outside the modules in ``skip`` (ids)."""
    params = nbytes = 0
    for mod in root.modules():
        if id(mod) in skip:
            continue
        for p in mod.parameters(recurse=False):
            params, nbytes = params + p.numel(), nbytes + p.numel() * p.element_size()
        q = getattr(mod, "quantized", None)
        if q is not None and mod._parameters.get("weight") is None:
            params, nbytes = params + mod.in_features * mod.out_features, nbytes + q.nbytes()
    return params, nbytes


@dataclass
class ModelCosts:
    dense_bytes: int  # weights read every step whatever the batch (incl. shared experts, head)
    expert_bytes: int  # one routed expert of one layer
    dense_params: int
    expert_params: int
    n_experts: int
    top_k: int
    elt: int  # activation / KV element size
    cfg: object

    @classmethod
    def of(cls, model) -> ModelCosts:
        """Costs of ``model``; Linears that keep only checkpoint bytes (FP8 / FP4) count their
        logical parameters for FLOPs and their stored bytes (data + scales) for traffic."""
        cfg = model.cfg
        skip = {id(m) for m in model.mtp.modules()} | {id(model.embed)}
        routed = {id(m) for layer in model.layers for ex in layer.ffn.experts for m in ex.modules()}
        dense_params, dense_bytes = _weights(model, skip | routed)
        ex = model.layers[0].ffn.experts[0]
        expert_params, expert_bytes = _weights(ex, set())
        return cls(dense_bytes, expert_bytes, dense_params, expert_params, cfg.n_routed_experts,
                   cfg.num_experts_per_tok, model.embed.weight.element_size(), cfg)

    def _keys(self, ctx: int, ratio: int) -> tuple[int, int]:
        """(attention keys, indexer keys) of one query at context length ctx in a layer."""
        cfg = self.cfg
        keys = min(ctx, cfg.sliding_window)
        # V4.1 has no csa_ratio: every compressed layer attends to an indexer top-k (index
        # keys are counted at every such layer, an upper bound: only index sources score)
        selects = ratio == cfg.csa_ratio if hasattr(cfg, "csa_ratio") else ratio > 0
        if ratio and selects:
            return keys + min(cfg.index_topk, ctx // ratio), ctx // ratio
        if ratio:
            return keys + ctx // ratio, 0
        return keys, 0

    def kv_bytes(self, ctx: int) -> int:
        cfg = self.cfg
        total = 0
        for ratio in cfg.compress_ratios:
            keys, idx = self._keys(ctx, ratio)
            total += keys * cfg.head_dim * self.elt + idx * cfg.index_head_dim * self.elt
        return total

    def _attn_flops(self, ctx: int) -> int:
        cfg = self.cfg
        total = 0
        for ratio in cfg.compress_ratios:
            keys, idx = self._keys(ctx, ratio)
            total += 4 * cfg.num_attention_heads * cfg.head_dim * keys + 2 * cfg.index_n_heads * cfg.index_head_dim * idx
        return total

    def decode_bytes(self, batch: int, ctx: int) -> float:
        distinct = self.n_experts * (1 - (1 - self.top_k / self.n_experts) ** batch)
        layers = len(self.cfg.compress_ratios)
        return self.dense_bytes + layers * distinct * self.expert_bytes + batch * self.kv_bytes(ctx)

    def decode_flops(self, batch: int, ctx: int) -> float:
        layers = len(self.cfg.compress_ratios)
        per_token = 2 * (self.dense_params + layers * self.top_k * self.expert_params) + self._attn_flops(ctx)
        return batch * per_token

    def prefill_flops(self, tokens: int) -> float:
        layers = len(self.cfg.compress_ratios)
        weights = 2 * tokens * (self.dense_params + layers * self.top_k * self.expert_params)
        step = max(1, tokens // 64)  # attention cost grows with the position: sum it coarsely
        return weights + sum(self._attn_flops(p) * min(step, tokens - p) for p in range(0, tokens, step))

    def prefill_bytes(self, tokens: int) -> float:
        """Weights once (every expert the tokens touch) + the window KV written and read once."""
        layers = len(self.cfg.compress_ratios)
        distinct = self.n_experts * (1 - (1 - self.top_k / self.n_experts) ** tokens)
        return self.dense_bytes + layers * distinct * self.expert_bytes + 2 * tokens * layers * self.cfg.head_dim * self.elt


def roofline(bytes_moved: float, flops: float, seconds: float) -> dict:
    """Achieved GB/s and TFLOP/s and their fractions of the ceilings."""
    gbps, tflops = bytes_moved / seconds / 1e9, flops / seconds / 1e12
    return {"gb_s": round(gbps, 1), "hbm_frac": round(gbps * 1e9 / HBM_BYTES_S, 4),
            "tflop_s": round(tflops, 2), "peak_frac": round(tflops * 1e12 / PEAK_FLOP_S, 4),
            "floor_ms": round(max(bytes_moved / HBM_BYTES_S, flops / PEAK_FLOP_S) * 1e3, 4)}
