"""DSpark drafter: one parallel pass over a block proposes up to gamma draft tokens, with a
low-rank Markov head and a confidence head (docs/dspark_assumptions.md lists every choice).

Per step (`propose`), after the target forward:

1. Features. The target exposes the INPUT streams of the layers ``dspark_target_layer_ids``
   (their attention input, `DeepseekV4Model.forward(capture=...)`); each is collapsed by
   the mean over its hc streams, the layers are concatenated and
   ``main_x = main_norm(main_proj(concat))``: one row per target position. For every row
   whose KV became valid this step (real tokens + accepted drafts) each stage k writes
   ``RoPE(kv_norm(wkv_k(main_x)))`` at that position into its window cache (paged swa
   layer id num_hidden_layers + k). The paged cache makes rollback, preemption and prefix
   caching free: a position's row is rewritten whenever the target recomputes it.
2. Block. For each request that sampled, with p its last valid position: rows
   [last accepted token, noise x (gamma - 1)] at positions p+1..p+gamma, streams start as
   the embedding repeated hc_mult times. Each stage attends (dense, per request) to its
   context rows at positions within the sliding window of the query (<= p) and
   bidirectionally to all rows of the block; block K/V are never written (lookahead 0).
3. Head. Last stage: hc_head (V4.1: collapse with the last site's pre), norm -> h_k,
   shared LM head -> logits of row k.
4. Drafts, sequentially: d_{k+1} ~ logits_k + W2 W1[x_k] (x_0 = last accepted token,
   x_k = d_k), drawn with the request's sampling settings from the DRAFT stream at the
   position the draft will occupy (p + 2 + k); c_{k+1} = sigmoid(w . [h_k ; W1[x_k]]).

DeepSeek-V4.1 (`models/v41/dspark.py`): the same orchestration; the stages carry the
shifted hyper-connections' ``pre`` from one to the next (starting one-hot on stream 0).
With SWA bounded replay, feature rows below a request's cut are not written (a compact
replay never computes their target-layer inputs, and no draft window reaches them:
keep >= window + backtracking).
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.engine.sampler import Sampler, SamplingTensors
from deepinfer.engine.transfer import to_device
from deepinfer.models.bounded_replay import batch_cuts
import numpy as np

from deepinfer import batch_invariant
from deepinfer.engine import rng
from deepinfer.models.fast.draft_dspark import N_COLS, block_rows, sample_block, write_context_kv
from deepinfer.models.fast.draft_dspark import device_rotary, unpack_block
from deepinfer.models.fast.draft_graphs import DraftGraphs, FeatureGraphs
from deepinfer.models.fast.forward import blocks_supported
from deepinfer.models.paged_batch import paged_slots
from deepinfer.models.registry import family_of
from deepinfer.models.v4.dspark import NO_POSITION
from deepinfer.models.v4.kv_cache import GROUP_SWA, KVCache

from .drafter import Draft, DraftContext, Drafter
from .verify import sample_draft


def _float_bits(x: float) -> int:
    """The float32 bit pattern of ``x`` as an int (how a draft step's input tensor carries it)."""
    return int(np.array([x], dtype=np.float32).view(np.int32)[0])


class DSparkDrafter(Drafter):
    lookahead = 0  # the block's own K/V stay in the pass; nothing beyond verified tokens is written
    plans_ahead = True  # (when graphed: `can_draft_after_verify`)
    #: the captured draft steps (`prepare_graphs`), None = the eager drafter
    graphs: DraftGraphs | None = None
    feature_graphs: FeatureGraphs | None = None
    _n_graph = 0

    def __init__(self, model, cache: KVCache, k: int) -> None:
        cfg = model.cfg
        if not cfg.has_dspark:
            raise ValueError("DSparkDrafter needs a checkpoint with a DSpark drafter (dspark_block_size > 0)")
        self.gamma = int(cfg.dspark_block_size)
        # per-position confidence temperatures fitted at training time (1.0 when the checkpoint has none)
        self.temperatures = [float(t) for t in cfg.dspark_confidence_temperatures] or [1.0] * self.gamma
        if k > self.gamma:
            raise ValueError(f"num_speculative_tokens={k} exceeds the DSpark block size {self.gamma}: "
                             f"the drafter proposes at most dspark_block_size tokens per step")
        bad = [i for i in cfg.dspark_target_layer_ids if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise NotImplementedError(f"DSpark target layers {bad} are not main-model layers; only "
                                      f"layers < num_hidden_layers={cfg.num_hidden_layers} can be captured")
        self.model, self.cache, self.k = model, cache, k
        self.cfg, self.family = cfg, family_of(cfg)  # the family runs its stages' reference pass
        self.stages = list(model.mtp)
        self.target_layers = tuple(int(i) for i in cfg.dspark_target_layer_ids)
        self.sampler = Sampler()

    def _cache_id(self, stage: int) -> int:
        return self.cfg.num_hidden_layers + stage

    def _rows_per_block(self) -> int:
        return self.cache.swa[self._cache_id(0)].shape[1]

    # ------------------------------------------------------------------ features
    def features(self, hidden: dict[int, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """main_norm(main_proj(concat over target layers of mean-over-hc input streams)) for
        the given rows of the step: [L] -> [L, D]."""
        s0 = self.stages[0]
        return s0.main_norm(s0.main_proj(self._target_features(hidden, rows)))

    def _write_features(self, ctx: DraftContext) -> None:
        rows, positions, tables = [], [], []  # per written row: step row, position, its request's swa table
        for i, (seq, cut) in enumerate(zip(ctx.batch.seqs, batch_cuts(ctx.batch))):
            skip = min(max(0, cut - seq.start), ctx.valid[i])  # rows a bounded replay leaves out
            n = ctx.valid[i] - skip
            if n <= 0:
                continue
            rows.extend(range(seq.offset + skip, seq.offset + skip + n))
            positions.extend(range(seq.start + skip, seq.start + skip + n))
            tables.append((seq.block_table[GROUP_SWA], seq.start + skip, n))
        if not rows:
            return
        dev = ctx.streams.device
        flat = np.concatenate([paged_slots(t, start, n, self._rows_per_block()) for t, start, n in tables])
        if self.feature_graphs is not None:  # the projections and every stage's write in one replay
            rows_t = to_device(rows, torch.long, dev)
            self.feature_graphs.run(self._target_features(ctx.hidden, rows_t), positions, flat)
            return
        main_x = self.features(ctx.hidden, torch.tensor(rows, device=dev))
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        self._write_context(main_x, pos, torch.from_numpy(flat).to(dev), self.model.rotary_main)

    def _target_features(self, hidden: dict[int, torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
        """Concat over target layers of the mean-over-hc input streams of ``rows`` (None: all): [L, n * D]."""
        return torch.cat([(hidden[i] if rows is None else hidden[i][rows]).mean(dim=1) for i in self.target_layers],
                         dim=-1)

    def _write_context(self, main_x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, rotary) -> None:
        """Every stage's context K/V of the rows ``main_x`` at ``pos`` into its window pool rows ``slots``."""
        for s, stage in enumerate(self.stages):  # one scatter per stage for every request
            pool = self.cache.swa[self._cache_id(s)]
            kv = stage.context_kv(main_x, pos, rotary)
            pool.view(-1, *pool.shape[2:])[slots] = kv.to(pool.dtype)

    def _feature_body(self, x: torch.Tensor, ints: torch.Tensor) -> None:
        # the ops the graphs were captured with (prepare_graphs: the fast path's)
        pools = [self.cache.swa[self._cache_id(s)] for s in range(len(self.stages))]
        write_context_kv(self.stages, self._graph_ops, x, ints[0], ints[1],
                         [pool.view(-1, *pool.shape[2:]) for pool in pools], self._rotary.inv_freq)

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def draft_logits(self, last_tokens: list[int], last_pos: list[int], tables: list[list[int]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """One parallel pass over R blocks. last_tokens[r] sits at position last_pos[r] + 1;
        the context is the window rows <= last_pos[r] of the stages' caches (swa tables).
        Returns (logits [R, gamma, V] float32 without the Markov bias, h [R, gamma, D])."""
        cfg, G, W = self.cfg, self.gamma, self.cfg.sliding_window
        dev = self.model.embed.weight.device
        R = len(last_tokens)
        ids = torch.full((R, G), cfg.dspark_noise_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor(last_tokens, dtype=torch.long)
        ids = ids.reshape(-1).to(dev)
        pos = (torch.tensor(last_pos, dtype=torch.long)[:, None] + 1 + torch.arange(G)[None, :]).reshape(-1).to(dev)
        # every block's context: the W-1 positions before it (the block's first row, at p+1,
        # sees keys > p+1-W), gathered for all blocks at once; rows before 0 are padding
        ctx_pos = np.asarray(last_pos, dtype=np.int64)[:, None] + (2 - W) + np.arange(W - 1)[None, :]
        slots = np.stack([paged_slots(t, int(row[0]), W - 1, self._rows_per_block(), valid=row >= 0)
                          for t, row in zip(tables, ctx_pos)])
        ctx_pos = np.where(ctx_pos >= 0, ctx_pos, NO_POSITION)
        both = torch.from_numpy(np.stack([slots, ctx_pos])).to(dev)  # one host -> device copy
        slots_t, ctx_pos_t = both[0], both[1]
        rotary = self.model.rotary_main
        if self._fast():
            return self._draft_logits_fast(ids, pos, slots_t, ctx_pos_t, R)
        streams = self.model.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pools = [self.cache.swa[self._cache_id(s)] for s in range(len(self.stages))]
        ctx_kvs = [pool.view(-1, *pool.shape[2:])[slots_t] for pool in pools]  # each [R, W - 1, head_dim]
        x = self.family.dspark_draft_pass(self.stages, streams, ids, pos, G, ctx_kvs, ctx_pos_t, rotary)
        last = self.stages[-1]
        h = last.norm(x)
        logits = self.model.head(h).float()
        return logits.view(R, G, -1), h.view(R, G, -1)

    def _fast(self) -> bool:
        """The stages run on the GPU fast path's fused kernels (mHC, MoE) when the runner
        has one and the family's stages fit them (V4.1's shifted hyper-connections do not);
        batch-invariant mode keeps the reference modules."""
        return (self.fast_ops is not None and self.family.dspark_fused_stages
                and self.family.dspark_stages_hidden is not None and not batch_invariant.enabled()
                and blocks_supported(self.stages))

    def _draft_logits_fast(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, ctx_pos: torch.Tensor,
                           R: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft_logits` through the fused mHC / MoE kernels: the family's compiled pass of the
        stages (``ModelFamily.dspark_stages_hidden``; V4: each stage one `run_block` with the
        stage's dense block attention as its attention sublayer, `models/v4/fast/draft.py`)."""
        stages_hidden = self.family.dspark_stages_hidden()
        h = stages_hidden(self.model, self.stages, self.fast_ops, ids, pos, self.gamma, self._context_kvs(slots),
                          ctx_pos)
        logits = self.model.head(h).float()
        return logits.view(R, self.gamma, -1), h.view(R, self.gamma, -1)

    def _context_kvs(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Every stage's context rows [R, W - 1, head_dim] at the flat pool rows ``slots``."""
        pools = [self.cache.swa[self._cache_id(s)] for s in range(len(self.stages))]
        return [pool.view(-1, *pool.shape[2:])[slots] for pool in pools]

    # ------------------------------------------------------------------ graphed drafting
    def prepare_graphs(self, max_num_seqs: int, enabled: bool = True, fast=None, max_model_len: int = 0) -> bool:
        """Capture the draft step's graphs (one per batch bucket up to ``max_num_seqs`` and
        sampling mode, `fast/draft_graphs.py`) when the runner has the fast path's ops, the
        stages fit the fused MoE, the family has a compiled pass of its stages
        (``ModelFamily.dspark_stages_hidden``) and batch-invariant mode is off; ``enabled`` False (CUDA
        graphs off) keeps the eager drafter. Returns whether the graphed drafter is on.
        (``fast`` / ``max_model_len``: the MTP drafter's; DSpark's graphs lay out their own rows.)"""
        self.graphs = self.feature_graphs = None
        if (not enabled or self.fast_ops is None or batch_invariant.enabled() or not blocks_supported(self.stages)
                or self.family.dspark_stages_hidden is None):
            return False
        self._n_graph = min(self.k, self.gamma)
        self._graph_ops = self.fast_ops
        self._rotary = device_rotary(self.model.rotary_main, self.model.embed.weight.device)
        # the confidence head's per-position temperatures, on the device once (no copy in a capture)
        self._temperatures_dev = torch.tensor(self.temperatures[:self._n_graph], dtype=torch.float32,
                                              device=self.model.embed.weight.device)
        hidden = self.family.dspark_stages_hidden()  # the family's compiled pass of its stages
        cols = N_COLS + self.cfg.sliding_window - 1
        graphs = DraftGraphs(lambda inp, greedy_only: self._graph_body(hidden, inp, greedy_only), cols,
                             max_num_seqs, self.model.embed.weight.device)
        template = np.zeros(cols, dtype=np.int64)
        template[3], template[4] = 1, _float_bits(1.0)  # greedy at temperature 1, position 0, slot 0
        graphs.warmup(template)
        graphs.stats["after_verify_steps"] = 0  # draft_after_verify's blocks
        self.graphs = graphs
        # feature writes: up to every request's token and drafts of a verify step per graph
        dev = self.model.embed.weight.device
        feats = FeatureGraphs(self._feature_body, len(self.target_layers) * self.cfg.hidden_size,
                              self.model.embed.weight.dtype, max_num_seqs * (self.k + 1), dev)
        feats.warmup(0, 0)  # zero features at block 0's row 0: rewritten before any request reads it
        self.feature_graphs = feats
        return True

    def _graph_body(self, hidden, inp: torch.Tensor, greedy_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole draft step of the blocks of ``inp`` on the device (`fast/draft_dspark.py`)."""
        G, R = self.gamma, inp.shape[0]
        ids, pos, slots, ctx_pos = block_rows(inp, G, self.cfg.sliding_window, self.cfg.dspark_noise_token_id)
        h = hidden(self.model, self.stages, self._graph_ops, ids, pos, G, self._context_kvs(slots), ctx_pos,
                   self._rotary)
        logits = self.model.head(h).float()
        return sample_block(inp, logits.view(R, G, -1), h.view(R, G, -1), self.stages[-1], self._temperatures_dev,
                            self._n_graph, greedy_only, lambda z, st: sample_draft(z, st, self.sampler),
                            self._graph_ops)

    def _propose_graphed(self, last_tokens: list[int], last_pos: list[int], tables: list[list[int]],
                         params: list) -> list[Draft]:
        """`draft_logits` + `draft` in one replay of the bucket's graph (temperature sampling
        only: the caller keeps requests with top-k / top-p / min-p on the eager drafter)."""
        W, n = self.cfg.sliding_window, self._n_graph
        rows = np.empty((len(last_tokens), N_COLS + W - 1), dtype=np.int64)
        for r, (tok, p, table, sp) in enumerate(zip(last_tokens, last_pos, tables, params)):
            ctx = p + (2 - W) + np.arange(W - 1)
            rows[r, N_COLS:] = paged_slots(table, int(ctx[0]), W - 1, self._rows_per_block(), valid=ctx >= 0)
            greedy = sp.is_greedy
            rows[r, :N_COLS] = (tok, p, rng.seed_to_int64(sp.seq_seed), int(greedy),
                                _float_bits(1.0 if greedy else sp.temperature))
        packed, q = self.graphs.run(rows, all(sp.is_greedy for sp in params))
        toks, confs = unpack_block(packed, n)
        return [Draft(toks[r], q[r] if q is not None else None, confs[r]) for r in range(len(toks))]

    @torch.no_grad()
    def draft_after_verify(self, so, batch, streams: torch.Tensor, hidden, lane) -> torch.Tensor | None:
        """A greedy-lane step's draft blocks on the device, launched before the verification
        reaches the host (packed [requests, C]): the verify graph's tail (`verify_tail`) wrote
        every verify row's features (rows past a request's accepted run are rejected positions,
        rewritten by the next step's writes before a block reads them) and staged each block's
        inputs (last token = the argmax at the accepted run's end, last position = start +
        accepted, its window's pool rows), so the draft graph replays on them. None (`propose`
        drafts) off the graphed drafter or past its largest bucket."""
        if (self.graphs is None or lane is None or lane.greedy is None or lane.tail is None
                or min(self.k, self.gamma) != self._n_graph or not so.scheduled):
            return None
        out = self.graphs.run_staged(len(so.scheduled), True)
        if out is None:
            return None
        self.graphs.stats["after_verify_steps"] += 1
        return out[0]

    def verify_tail(self, last: torch.Tensor, shift: torch.Tensor) -> Any:
        """The feature writes, the next blocks' inputs and the plan-ahead record inside the
        verify graphs (`spec/dspark_verify_tail.py`), when the draft and feature graphs are captured."""
        if self.graphs is None or self.feature_graphs is None:
            return None
        from .dspark_verify_tail import DSparkVerifyTail

        self._tail = DSparkVerifyTail(self, last, shift)
        return self._tail

    def record_tail_drafts(self, buffer, so, drafts: torch.Tensor) -> None:
        """Record a tailed step's drafts (`draft_after_verify`'s tensor) in the token buffer
        behind the bonus token the verify graph recorded: the slots the tail kept."""
        n = self._n_graph
        buffer.last[self._tail.dest[:drafts.shape[0]], 1:n + 1] = drafts[:, :n]

    def can_draft_after_verify(self, so) -> bool:
        return (self.graphs is not None and self.feature_graphs is not None and min(self.k, self.gamma) == self._n_graph
                and bool(so.scheduled) and self.graphs.has_rows(len(so.scheduled))
                and all(r.sampling_params.is_greedy for r in so.scheduled))

    def device_draft_tokens(self, drafts: torch.Tensor) -> torch.Tensor:
        return drafts[:, :self._n_graph]

    def drafts_from_host(self, so, host: torch.Tensor) -> dict[str, Draft]:
        toks, confs = unpack_block(host.tolist(), self._n_graph)
        return {r.req_id: Draft(toks[g], None, confs[g]) for g, r in enumerate(so.scheduled)}

    @torch.no_grad()
    def draft(self, logits: torch.Tensor, h: torch.Tensor, last_tokens: list[int], last_pos: list[int],
              params: list, n: int) -> list[Draft]:
        """Sequential sampling of n <= gamma drafts per block from one pass's outputs."""
        last = self.stages[-1]
        dev = logits.device
        prev = torch.tensor(last_tokens, dtype=torch.long, device=dev)
        toks: list[list[int]] = [[] for _ in last_tokens]
        confs: list[list[float]] = [[] for _ in last_tokens]
        qs: list[list[torch.Tensor]] = [[] for _ in last_tokens]
        for j in range(n):
            emb = last.markov_head.embedding(prev)
            z = logits[:, j] + last.markov_head(prev)
            conf = last.confidence_head(h[:, j], emb, self.temperatures[j])
            st = SamplingTensors.from_params(params, [p + 2 + j for p in last_pos], dev)
            tok, q = sample_draft(z, st, self.sampler)
            tl, cl = tok.tolist(), conf.tolist()
            for r in range(len(last_tokens)):
                toks[r].append(tl[r])
                confs[r].append(float(cl[r]))
                if q is not None:
                    qs[r].append(q[r])
            prev = tok
        return [Draft(toks[r], torch.stack(qs[r]) if qs[r] else None, confs[r]) for r in range(len(last_tokens))]

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> dict[str, Draft]:
        self._write_features(ctx)
        n = min(k, self.gamma)
        heads = [(i, r) for i, (r, e) in enumerate(zip(ctx.scheduled, ctx.emitted)) if e and ctx.valid[i] > 0]
        if not heads or n <= 0:
            return {}
        last_tokens = [ctx.emitted[i][-1] for i, _ in heads]
        last_pos = [ctx.batch.seqs[i].start + ctx.valid[i] - 1 for i, _ in heads]
        tables = [ctx.batch.seqs[i].block_table[GROUP_SWA] for i, _ in heads]
        params = [r.sampling_params for _, r in heads]
        if self.graphs is not None and n == self._n_graph:
            if all(sp.is_greedy or (sp.top_k == -1 and sp.top_p >= 1.0 and sp.min_p <= 0.0) for sp in params):
                drafts = self._propose_graphed(last_tokens, last_pos, tables, params)
                return {r.req_id: d for (_, r), d in zip(heads, drafts)}
            self.graphs.stats["eager_steps"] += 1  # top-k / top-p / min-p: outside the captured modes
        logits, h = self.draft_logits(last_tokens, last_pos, tables)
        drafts = self.draft(logits, h, last_tokens, last_pos, params, n)
        return {r.req_id: d for (_, r), d in zip(heads, drafts)}

