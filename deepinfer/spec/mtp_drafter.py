"""MTP drafter: the checkpoint's next-n stage drafts k tokens autoregressively.

Convention: the MTP row at position t combines the target's final streams h_t with the
embedding of token x_{t+1} and predicts x_{t+2}; it writes the MTP stage's window cache
(layer id num_hidden_layers + stage) at row t. Every step it runs over each position whose
next token became known (prefill chunks included, so its window cache is complete); the
last row of a chunk that did not sample has no next token yet and waits ("pending", its
stream kept) for the next chunk. Drafts 2..k feed the stage its own output stream and
the previous draft at the following positions (these rows are speculative and get
rewritten once the real tokens are verified). Only stage 0 is used (base V4 has one).
Draft tokens are drawn with the request's sampling settings from the DRAFT stream.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from deepinfer import batch_invariant
from deepinfer.engine.sampler import Sampler, SamplingTensors, unpack_greedy
from deepinfer.engine.transfer import to_device
from deepinfer.models.fast.forward import blocks_supported, head_hidden, mtp_stage_streams, run_block
from deepinfer.models.fast.runner import MAX_ROWS
from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
from deepinfer.models.registry import family_of
from deepinfer.models.v4.kv_cache import GROUP_SWA, KVCache

from .drafter import Draft, DraftContext, Drafter
from .mtp_graphs import MTPStageGraphs
from .verify import sample_draft


class MTPDrafter(Drafter):
    plans_ahead = True
    def __init__(self, model, cache: KVCache, k: int) -> None:
        self.model, self.cache, self.k = model, cache, k
        self.lookahead = max(0, k - 1)
        self.sampler = Sampler()
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}  # req_id -> (position, streams [N, D])
        self.graphs: MTPStageGraphs | None = None  # the stage's graphed passes (prepare_graphs)

    def prepare_graphs(self, max_num_seqs: int, enabled: bool = True, fast=None, max_model_len: int = 0) -> bool:
        """Capture the stage's passes over decode-like rows (`spec/mtp_graphs.py`) when the
        runner's fast path (``fast``) warms its graphs up at start, the stage fits the fused
        kernels and batch-invariant mode is off; else the eager drafter. Returns whether the
        graphed passes are on."""
        self.graphs = None
        if (not enabled or fast is None or self.fast_ops is None or batch_invariant.enabled()
                or not blocks_supported([self.model.mtp[0]]) or not fast.warms_up()
                or family_of(self.model.cfg).mtp_stage_attention is None):
            return False
        graphs = MTPStageGraphs(self.model, self.cache, fast, self.k, max_num_seqs)
        graphs.warmup(max_num_seqs, max_model_len + self.k, self.cache.block_size)  # drafts reach past the last token
        self.graphs = graphs
        return True

    def _stage(self, prev: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``model.mtp_forward(0, ...)``; with the GPU fast path's ops the stage's mHC and MoE
        run the fused kernels (its window attention stays the reference module: rows of any
        length per request, written into the stage's paged window cache)."""
        model, mtp, ops = self.model, self.model.mtp[0], self.fast_ops
        if ops is None or batch_invariant.enabled() or not blocks_supported([mtp]):
            return model.mtp_forward(0, prev, batch, self.cache)
        ctx = model.context(batch, self.cache)
        streams = mtp_stage_streams(model, mtp, ops, batch.input_ids, prev)
        streams, last = run_block(mtp, streams, None, batch.input_ids, ops, lambda attn, x: attn(x, ctx))
        h, streams = head_hidden(mtp, ops, streams, last, return_streams=True)
        return streams, model.head(h).float()

    def drop(self, req_ids: list[str]) -> None:
        for r in req_ids:
            self.pending.pop(r, None)

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> dict[str, Draft]:
        if self.graphs is not None and k > 0:
            out = self._propose_graphed(ctx, k)
            if out is not None:
                return out
        dev = ctx.streams.device
        ids: list[int] = []
        prev: list[torch.Tensor] = []
        seqs: list[SeqMeta] = []
        heads = []  # (scheduled index, row of draft-1 logits, position of that MTP row)
        for i, r in enumerate(ctx.scheduled):
            seq, emitted, valid = ctx.batch.seqs[i], ctx.emitted[i], ctx.valid[i]
            toks = list(r.token_ids[:valid]) + (emitted[-1:] if emitted else [])
            pend = self.pending.pop(r.req_id, None)
            offset, p0 = len(ids), seq.start
            if pend is not None and not r.is_new and pend[0] == seq.start - 1:
                prev.append(pend[1].unsqueeze(0))
                ids.append(toks[0])
                p0 = seq.start - 1
            m = valid if emitted else valid - 1
            if m > 0:
                prev.append(ctx.streams[seq.offset: seq.offset + m])
                ids.extend(toks[1: m + 1])
            if not emitted and valid > 0:
                self.pending[r.req_id] = (seq.start + valid - 1, ctx.streams[seq.offset + valid - 1].clone())
            length = len(ids) - offset
            if length:
                seqs.append(SeqMeta(p0, length, offset, r.block_table, r.state_slot, False, r.num_prompt_tokens))
                if emitted:
                    heads.append((i, len(ids) - 1, p0 + length - 1))
        if not seqs:
            return {}
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.long, device=dev),
                             torch.cat([torch.arange(s.start, s.start + s.length) for s in seqs]).to(dev), seqs)
        streams, logits = self._stage(torch.cat(prev), batch)
        if not heads or k <= 0:
            return {}
        B = self.cache.block_size
        rows = [h[1] for h in heads]
        cur_streams, cur_logits = streams[rows], logits[rows]
        reqs = [ctx.scheduled[h[0]] for h in heads]
        mtp_pos = [h[2] for h in heads]  # position of the MTP row that produced cur_logits
        toks_out: list[list[int]] = [[] for _ in heads]
        q_out: list[list[torch.Tensor]] = [[] for _ in heads]
        conf: list[list[float]] = [[] for _ in heads]
        alive = list(range(len(heads)))
        for j in range(k):
            params = SamplingTensors.from_params([reqs[a].sampling_params for a in alive],
                                                 [mtp_pos[a] + 2 for a in alive], dev)
            tok, q = sample_draft(cur_logits, params, self.sampler)
            probs = torch.softmax(cur_logits.float(), dim=-1) if q is None else q
            pt = probs.gather(1, tok.unsqueeze(1)).squeeze(1).tolist()
            tl = tok.tolist()
            for n, a in enumerate(alive):
                toks_out[a].append(tl[n])
                conf[a].append(float(pt[n]))
                if q is not None:
                    q_out[a].append(q[n])
            if j == k - 1:
                break
            # next MTP row: one position further, fed its own stream and the new draft
            nxt, seqs2, prev2, ids2 = [], [], [], []
            for n, a in enumerate(alive):
                pos = mtp_pos[a] + 1
                table = reqs[a].block_table[GROUP_SWA]
                if pos // B >= len(table) or table[pos // B] < 0:
                    continue  # no block reserved there (near max_model_len): stop drafting
                seqs2.append(SeqMeta(pos, 1, len(ids2), reqs[a].block_table, reqs[a].state_slot, False))
                ids2.append(tl[n])
                prev2.append(cur_streams[n: n + 1])
                mtp_pos[a] = pos
                nxt.append(a)
            if not nxt:
                break
            b2 = ForwardBatch(torch.tensor(ids2, dtype=torch.long, device=dev),
                              torch.tensor([s.start for s in seqs2], dtype=torch.long, device=dev), seqs2)
            cur_streams, cur_logits = self._stage(torch.cat(prev2), b2)
            alive = nxt
        out = {}
        for a, r in enumerate(reqs):
            probs = torch.stack(q_out[a]) if q_out[a] else None
            out[r.req_id] = Draft(toks_out[a], probs, conf[a])
        return out

    def draft_after_verify(self, so, batch: ForwardBatch, streams: torch.Tensor, hidden, lane) -> torch.Tensor | None:
        """The graphed stage's k passes on the device (packed [requests, k, 2]): the catch-up
        over every verify row of every request, each row fed the verify's own argmax as its
        next token, then each request's first draft read at its last accepted row, then
        ``k - 1`` one-row passes at the positions after it (built for no accepted draft and
        shifted by the accepted count on the device). Rows up to the accepted run's end get
        exactly the tokens verification emits there; the rows after it are rejected
        positions, rewritten by the next step's catch-up before any row reads them (a row
        attends to positions up to its own). None (`propose` drafts from the host result)
        unless every request continues greedily with nothing pending and owns the blocks of
        its drafts however many are accepted."""
        if lane is None or lane.greedy is None:
            return None
        rows = self._after_verify_rows(so)
        if rows is None:
            return None
        shift = batch.position_shift  # a step planned ahead: its rows' true positions are shifted
        if lane.row_shift is not None:  # (the verify graph shifted them itself)
            shift = lane.row_shift[:batch.num_tokens]
        b = len(so.scheduled)
        if lane.tail is not None:  # the catch-up and its pick ran inside the verify graph
            first, first_streams, _, later = (t[:b] for t in lane.tail)
            if self.k == 1:
                self.graphs.stats["after_verify_passes"] += 1
                return first.unsqueeze(1)  # (read before the next replay: the lane's copy is on its stream)
        else:
            out = self.graphs.run(rows, lane.row_argmax(batch.num_tokens), streams, shift=shift)
            if out is None:
                return None
            starts, accepted = lane.accepted([s.offset for s in batch.seqs], [r.num_draft_tokens for r in so.scheduled])
            first, first_streams = out[1][starts + accepted], out[0][starts + accepted]
            later = accepted if shift is None else accepted + shift[starts]
        picked = self._later_passes([(p, t, s) for p, _, t, s in rows], first_streams, first, self.k, shift=later)
        if picked is None:
            return None  # (no shape: the host path redrafts; its KV writes are the same)
        self.graphs.stats["after_verify_passes"] += 1
        return torch.stack(picked, dim=1)

    def _after_verify_rows(self, so) -> list[tuple[int, int, dict, int]] | None:
        """The catch-up rows (first position, rows, block table, state slot) per request of
        :meth:`draft_after_verify`, or None when it cannot draft behind ``so``'s verify graph
        (positions are the plan's: a step planned ahead has its true ones at or below them)."""
        # the planner asks first, then the step itself; keyed by the rows too: a plan that lands
        # first (`SpeculativePlanner.resolve`) gets its true start positions in place
        key = tuple((r.start_pos, r.num_tokens) for r in so.scheduled)
        memo = getattr(self, "_rows_memo", None)
        if memo is not None and memo[0] is so and memo[1] == key:
            return memo[2]
        rows = self._find_after_verify_rows(so)
        self._rows_memo = (so, key, rows)
        return rows

    def _find_after_verify_rows(self, so) -> list[tuple[int, int, dict, int]] | None:
        k, B = self.k, self.cache.block_size
        if self.graphs is None or not so.scheduled:
            return None
        rows = []
        for r in so.scheduled:
            table = r.block_table[GROUP_SWA]
            last = r.start_pos + r.num_draft_tokens  # the last row's position when every draft is accepted
            if (r.is_new or r.req_id in self.pending or not r.sampling_params.is_greedy
                    or not 1 <= r.num_tokens <= MAX_ROWS
                    or any(p // B >= len(table) or table[p // B] < 0 for p in range(last + 1, last + k))):
                return None
            rows.append((r.start_pos, r.num_tokens, r.block_table, r.state_slot))
        if not self.graphs.has_shape(rows) or (k > 1 and not self.graphs.has_shape([(p, 1, t, s) for p, _, t, s
                                                                                   in rows])):
            return None
        return rows

    def can_draft_after_verify(self, so) -> bool:
        return self._after_verify_rows(so) is not None

    def verify_tail(self, last: torch.Tensor, shift: torch.Tensor) -> Any:
        if self.graphs is None:
            return None
        from .mtp_verify_tail import MTPVerifyTail  # (it imports mtp_graphs, as this module does)
        return MTPVerifyTail(self.graphs, last, shift)

    def record_tail_drafts(self, buffer, so, drafts: torch.Tensor) -> None:
        """The tail recorded the bonus and the first draft: the later drafts go behind them."""
        if drafts.shape[1] > 1:
            slots = to_device([r.state_slot for r in so.scheduled], torch.long, drafts.device)
            buffer.last[slots, 2:drafts.shape[1] + 1] = self.device_draft_tokens(drafts)[:, 1:]

    def device_draft_tokens(self, drafts: torch.Tensor) -> torch.Tensor:
        return drafts[:, :, 0]

    def _later_passes(self, last_rows: list[tuple[int, dict, int]], streams: torch.Tensor, cur: torch.Tensor,
                      k: int, shift: torch.Tensor | None = None) -> list[torch.Tensor] | None:
        """Drafts 2..k after the first (``cur`` packed [R, 2], ``streams`` its output streams):
        one-row passes one position further each, fed their own stream and the previous
        draft. ``last_rows``: per request (position of the row that drafted ``cur``, block
        table, state slot), positions shifted by ``shift`` on the device. Returns the packed
        drafts per pass ([R, 2] each, the first included), None when a pass has no shape."""
        picked = [cur]
        for j in range(1, k):
            out = self.graphs.run([(p + j, 1, t, s) for p, t, s in last_rows], cur[:, 0], streams, shift=shift)
            if out is None:
                return None
            streams, cur = out[0].clone(), out[1].clone()
            picked.append(cur)
        return picked

    def drafts_from_host(self, so, host: torch.Tensor) -> dict[str, Draft]:
        k = host.shape[1]
        toks, lps = unpack_greedy(host.reshape(-1, 2))
        return {r.req_id: Draft(toks[g * k:(g + 1) * k], None, [math.exp(x) for x in lps[g * k:(g + 1) * k]])
                for g, r in enumerate(so.scheduled)}

    def _propose_graphed(self, ctx: DraftContext, k: int) -> dict[str, Draft] | None:
        """:meth:`propose` as graph replays (the catch-up over every request's valid rows, then
        ``k - 1`` one-row passes fed on the device) and one device -> host copy, for a step
        whose requests all continue greedily with at most ``MAX_ROWS`` valid rows, emitted a
        token, have nothing pending and own the blocks of their drafts; None otherwise (the
        eager path drafts, with the same rows)."""
        B = self.cache.block_size
        rows, ids, prev = [], [], []
        for i, r in enumerate(ctx.scheduled):
            seq, emitted, valid = ctx.batch.seqs[i], ctx.emitted[i], ctx.valid[i]
            table = r.block_table[GROUP_SWA]
            last = seq.start + valid - 1  # the position of the row whose output drafts first
            if (not emitted or r.is_new or r.req_id in self.pending or not 1 <= valid <= MAX_ROWS
                    or not r.sampling_params.is_greedy
                    or any(p // B >= len(table) or table[p // B] < 0 for p in range(last + 1, last + k))):
                return None
            rows.append((seq.start, valid, r.block_table, r.state_slot))
            ids.extend(list(r.token_ids[1:valid]) + emitted[-1:])
            prev.append(ctx.streams[seq.offset: seq.offset + valid])
        if not rows:
            return None
        ends = np.cumsum([m for _, m, _, _ in rows]) - 1  # each request's last row
        out = self.graphs.run(rows, np.asarray(ids, dtype=np.int32), torch.cat(prev))
        if out is None:
            return None
        streams, packed = out
        at = torch.from_numpy(ends).to(packed.device)
        picked = self._later_passes([(p + m - 1, t, s) for p, m, t, s in rows], streams[at], packed[at], k)
        if picked is None:
            return None  # (no shape for it: the eager path redrafts; its KV writes are the same)
        host = torch.stack(picked, dim=1).cpu()  # [R, k, 2]: the step's one copy
        toks, lps = unpack_greedy(host.view(-1, 2))
        return {r.req_id: Draft(toks[a * k:(a + 1) * k], None, [math.exp(x) for x in lps[a * k:(a + 1) * k]])
                for a, r in enumerate(ctx.scheduled)}
