"""CUDA graphs of the MTP stage (``MTPDrafter``) over decode-like rows.

After a verify step every request of a decode-like step knows the next token of each of
its ``m`` valid rows (its last real token and its accepted drafts), so the stage runs over
those rows (the catch-up, up to ``k + 1`` per request) and then ``k - 1`` times over one
row per request (its own output stream and the previous draft). Each of these passes is
one replay here: the rows laid out as a decode step's (``fast.runner.StepInputs``: ids,
positions, slots, request groups, block tables; the stage's window attention is the
family's decode attention, ``ModelFamily.mtp_stage_attention``, over the stage's own
window cache), the previous streams in a persistent buffer, and the stage's output
streams, logits and their per-row argmax / log-prob (``argmax_logsumexp``) as the graph's
outputs. A pass's ids may come from the
device (the previous pass's argmax): the drafts of one step reach the host in one copy.

Keys ``("mtp", rows, width)`` in a pool of the drafter's own, rows the verify row buckets
(a catch-up of every request's k + 1 rows fits the largest), widths the decode set's.
Captured at start-up (``deepinfer.spec.setup``) and sealed; on a host cache the replays run
the body eagerly on the same padded buffers (CPU tests). Padded rows repeat row 0 (its own
group each): they write what row 0 writes.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from deepinfer.engine.transfer import copy_to_device
from deepinfer.models.fast.decode_graphs import DecodeGraphs, graph_shapes
from deepinfer.models.fast.forward import head_hidden, head_logits, mtp_stage_streams, run_block
from deepinfer.models.fast.runner import StepInputs
from deepinfer.models.fast.verify_graphs import verify_row_buckets
from deepinfer.models.registry import family_of


class MTPStageGraphs:
    """The MTP stage ``stage`` of ``model`` over decode-like rows, graphed per (rows, width)."""

    def __init__(self, model: Any, cache: Any, fast: Any, k: int, max_num_seqs: int, stage: int = 0) -> None:
        self.model, self.cache, self.fast, self.mtp = model, cache, fast, model.mtp[stage]
        self.ops, self.groups, self.device = fast.ops, fast.groups, fast.device
        self.attention = family_of(model.cfg).mtp_stage_attention()  # the family's decode attention
        self.buckets = verify_row_buckets(max_num_seqs, max(1, k))
        self.graphs = DecodeGraphs(self.device)
        cfg = model.cfg
        self._streams_shape = (cfg.hc_mult, cfg.hidden_size)
        self._inputs: dict[tuple[int, int], tuple[StepInputs, torch.Tensor]] = {}
        #: after_verify_passes: steps whose k drafts ran behind the verify graph (`MTPDrafter.draft_after_verify`)
        self.stats = {"graph_passes": 0, "eager_passes": 0, "after_verify_passes": 0}

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def _buffers(self, rows: int, width: int) -> tuple[StepInputs, torch.Tensor]:
        buf = self._inputs.get((rows, width))
        if buf is None:
            prev = torch.zeros(rows, *self._streams_shape, dtype=self.model.embed.weight.dtype, device=self.device)
            buf = self._inputs[(rows, width)] = (StepInputs.allocate(rows, width, self.groups, self.device), prev)
        return buf

    def _meta(self, inputs: StepInputs, width: int, n: int) -> Any:
        return self.fast._meta(inputs, width, True, n)

    def _body(self, arg: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage over the rows of ``meta``: (output streams [R, N, D], packed [R, 2] of
        each row's argmax and its log-prob bits)."""
        meta, prev = arg
        model, mtp, ops = self.model, self.mtp, self.ops
        ctx = model.context(self.fast.batch_of(meta), self.cache)
        streams = mtp_stage_streams(model, mtp, ops, meta.ids, prev)
        streams, last = run_block(mtp, streams, None, meta.ids, ops, lambda attn, x: self.attention(attn, x, ctx))
        h, streams = head_hidden(mtp, ops, streams, last, return_streams=True)
        logits = head_logits(model, ops, h)
        packed = torch.empty(logits.shape[0], 2, dtype=torch.int64, device=logits.device)
        ops.argmax_logsumexp(logits, packed=packed)
        return streams, packed

    def warmup(self, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
        """Capture every (rows bucket, width) these limits allow, largest first, on dummy rows
        (position 0, block 0, slot 0: the stage rewrites that row before any request reads
        it), then seal. Returns how many graphs it captured."""
        widths = sorted({w for _, w in graph_shapes(max_num_seqs, max_model_len, block_size)}, reverse=True)
        n = 0
        for rows in sorted(self.buckets, reverse=True):
            for width in widths:
                inputs, prev = self._buffers(rows, width)
                inputs.fill_dummy()
                prev.zero_()
                self.graphs.capture(("mtp", rows, width), (self._meta(inputs, width, rows), prev), self._body)
                n += 1
        self.graphs.seal()
        return n

    def _shape(self, rows: list[tuple[int, int, dict, int]]) -> tuple[Any, int, int | None, int]:
        """(the rows as a plan, their count, their rows bucket or None, their width class)."""
        so = SimpleNamespace(scheduled=[SimpleNamespace(start_pos=p, num_tokens=m, block_table=t, state_slot=s)
                                        for p, m, t, s in rows])
        n = sum(m for _, m, _, _ in rows)
        return so, n, next((b for b in self.buckets if b >= n), None), self.fast._width(so)

    def has_shape(self, rows: list[tuple[int, int, dict, int]]) -> bool:
        """Whether :meth:`run` over ``rows`` replays a captured graph."""
        _, _, bucket, width = self._shape(rows)
        return bucket is not None and self.graphs.has(("mtp", bucket, width))

    def run(self, rows: list[tuple[int, int, dict, int]], ids: torch.Tensor | np.ndarray, prev: torch.Tensor,
            shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One pass over ``rows`` [(first position, rows, block table, state slot)] per request
        (its rows consecutive), ``ids`` the next token of every row (host array or device
        tensor), ``prev`` [n, N, D] the streams they follow. Returns (output streams [n, N, D],
        packed [n, 2]) as views of the graph's outputs (valid until its next replay), or None
        when no captured shape holds the pass (the caller drafts eagerly). ``shift`` (device,
        one per row): added to the rows' positions on the device (positions the host does
        not know yet: `MTPDrafter.draft_after_verify`; the tables must hold them)."""
        so, n, bucket, width = self._shape(rows)
        if bucket is None or not self.graphs.has(("mtp", bucket, width)):
            self.stats["eager_passes"] += 1
            return None
        inputs, buf = self._buffers(bucket, width)
        host = self.fast._host_inputs(so, width, bucket)
        on_host = isinstance(ids, np.ndarray)
        if on_host:
            host[:n] = ids
            host[n:bucket] = ids[0]
        copy_to_device(inputs.flat, host)
        if shift is not None:  # padded rows repeat row 0, its shift included
            inputs.positions[:n] += shift.to(inputs.positions.dtype)
            inputs.positions[n:] = inputs.positions[:1]
        if not on_host:
            inputs.ids[:n].copy_(ids)
            if bucket > n:
                inputs.ids[n:].copy_(inputs.ids[:1].expand(bucket - n))
        buf[:n].copy_(prev)
        if bucket > n:
            buf[n:].copy_(prev[:1].expand(bucket - n, *prev.shape[1:]))
        streams, packed = self.graphs.replay(("mtp", bucket, width), (self._meta(inputs, width, bucket), buf),
                                             self._body)
        self.stats["graph_passes"] += 1
        return streams[:n], packed[:n]


__all__ = ["MTPStageGraphs"]
