"""CUDA graphs of speculative verify steps, captured at engine start beside the decode set.

A verify step feeds every request its last token and its drafts (1..``MAX_ROWS`` rows per
request, groups delimited by ``StepInputs.starts``) through the family's decode program
and returns the final streams (plus the drafter's captured layer inputs), from which the
spec runner computes the logits of those rows. Its row count is ``B * (k + 1)`` for a
fixed-length step of B requests, anything in between when drafts are cut (max_tokens,
grammars, the confidence scheduler), so the row buckets are the powers of two plus the
multiples ``(k + 1) * b`` of the decode batch buckets (a full fixed-k step pads nothing),
up to the step of ``max_num_seqs`` requests with ``k`` drafts each. Widths are the decode
set's (:func:`decode_graphs.graph_shapes`).

The graphs live in the fast path's one pool (``FastPath.graphs``) under keys
``("verify", rows, width, layers)``; :meth:`VerifyGraphs.warmup` captures all of them,
largest first, and the engine's warm-up (``SpecDecoder.warmup``) then seals the set, so
nothing is captured while serving: a step of a shape outside the set (more rows than the
largest bucket) runs eagerly on the same padded buffers and is counted
(``graphs.stats["uncaptured_steps"]``). Padded rows repeat row 0 (its own group each), as
in decode graphs: they write what row 0 writes.

Greedy lane: a step whose requests are all greedy (no top log-probs, no grammar) and whose
rows fit ``greedy_lane_max_rows`` (by vocabulary) replays a graph that also computes every row's logits, argmax
and log-prob and verifies the drafts (``ops.greedy_verify``, deepinfer_kernels/spec_lane.py): the step's
logits, sampling and acceptance then launch nothing of their own and reach the host in one
copy. Its logits stay in the pool (R x V float32), hence the row cap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.engine.transfer import copy_to_device, to_device

from ..paged_batch import ForwardBatch
from .decode_graphs import BUCKETS, graph_shapes, next_pow2, reserved_bytes
from .runner import StepInputs

#: What a speculative step's forward gives the spec runner, whichever executor ran it (the
#: verify graphs here, a family prefill executor's ``spec_forward``, the reference path):
#: (final streams [T, N, D] or V4.1's collapsed hidden [T, D], captured layer inputs,
#: rows -> float32 logits [R, V])
SpecForward = tuple[torch.Tensor, dict[int, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


#: Fewest rows a greedy-lane verify graph may reach, whatever the vocabulary.
GREEDY_MAX_ROWS = 128
#: The float32 logits a greedy-lane graph may keep in the graph pool: 128 rows at V4's
#: 129,280-token vocabulary (66 MB), so a smaller vocabulary gets more rows.
GREEDY_LOGITS_BYTES = 128 * 129_280 * 4


def greedy_lane_max_rows(vocab_size: int) -> int:
    """Most rows of a greedy-lane verify graph for ``vocab_size``: its float32 logits stay in
    the pool, so ``GREEDY_LOGITS_BYTES`` of them, at least ``GREEDY_MAX_ROWS`` rows (larger
    steps amortise their eager launches)."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"greedy_lane_max_rows: vocab_size must be an int >= 1, got {vocab_size!r}")
    return max(GREEDY_MAX_ROWS, GREEDY_LOGITS_BYTES // (4 * vocab_size))


@dataclass
class VerifyStep:
    """A decode-like verify step's outputs: the final streams (V4.1: the collapsed hidden)
    of its real rows, and in the greedy lane ``greedy`` (``ops.greedy_verify``'s
    int64 [3R + 1] over the step's R padded rows; None off the lane)."""

    streams: torch.Tensor
    greedy: torch.Tensor | None = None
    rows: int = 0
    #: the outputs of the graph's ``VerifyGraphs.tail`` (None without one, off the lane)
    tail: tuple | None = None
    #: [R] int64 per row: the position shift the graph added (a step planned ahead; zeros
    #: otherwise), when the lane's graph fed itself from the token buffer (``ops.feed_placeholders``)
    row_shift: torch.Tensor | None = None
    _accepted: tuple | None = None

    def row_argmax(self, n: int) -> torch.Tensor:
        """The lane's argmax of the step's first ``n`` rows, on the device."""
        return self.greedy[:2 * self.rows].view(self.rows, 2)[:n, 0]

    def accepted(self, offsets: list[int], num_drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device, per request group starting at ``offsets`` with ``num_drafts``: (its
        first row, its accepted drafts), what ``spec.verify.greedy_verify_result`` reads on
        the host. Computed once per step (the drafter and the token buffer both read it)."""
        key = (tuple(offsets), tuple(num_drafts))
        if self._accepted is None or self._accepted[0] != key:
            meta = to_device(list(offsets) + list(num_drafts), torch.long, self.greedy.device).view(2, -1)
            first = self.greedy[2 * self.rows: 2 * self.rows + len(offsets)]
            self._accepted = (key, meta[0], torch.minimum(first - meta[0], meta[1]))
        return self._accepted[1], self._accepted[2]


def verify_row_buckets(max_num_seqs: int, num_drafts: int) -> list[int]:
    """Row buckets of verify steps with up to ``num_drafts`` drafts per request, ascending:
    powers of two and ``(num_drafts + 1) * b`` for the decode buckets b, up to the first
    holding ``max_num_seqs * (num_drafts + 1)`` rows."""
    for name, value, low in (("max_num_seqs", max_num_seqs, 1), ("num_drafts", num_drafts, 0)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"verify_row_buckets: {name} must be an int >= {low}, got {value!r}")
    per = num_drafts + 1
    most = max_num_seqs * per
    top = min(next_pow2(most), per * next((b for b in BUCKETS if b >= max_num_seqs), BUCKETS[-1]))
    pow2 = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    multiples = [per * b for b in BUCKETS if per * b <= top]
    return sorted(set(pow2 + multiples + [top]))


def verify_shapes(max_num_seqs: int, num_drafts: int, max_model_len: int, block_size: int) -> list[tuple[int, int]]:
    """Every (rows bucket, width class) of a verify step under these limits, largest first."""
    widths = sorted({w for _, w in graph_shapes(max_num_seqs, max_model_len + num_drafts, block_size)})
    rows = verify_row_buckets(max_num_seqs, num_drafts)
    return sorted(((r, w) for r in rows for w in widths), key=lambda rw: (-rw[0], -rw[1]))


class VerifyGraphs:
    """The verify steps of one fast path (``FastPath``): bucketed, padded, graphed.

    ``layers``: the drafter's target layers whose input streams each step captures."""

    def __init__(self, fast: Any, layers: tuple[int, ...], buckets: list[int]) -> None:
        if fast.program.streams is None:
            raise ValueError("VerifyGraphs: the family's decode program has no streams() (verify rows)")
        self.fast, self.layers, self.buckets = fast, tuple(sorted(layers)), sorted(buckets)
        self.warmed: list[tuple] = []  # (rows, width) and (rows, width, "greedy") captured
        #: device bytes the captured verify set took (None: not measured / not captured)
        self.graph_bytes: int | None = None
        #: tail_steps: greedy-lane steps whose graph also ran the ``tail``
        self.counts = {"steps": 0, "graph_steps": 0, "eager_steps": 0, "greedy_steps": 0, "tail_steps": 0}
        self.greedy_max_rows = greedy_lane_max_rows(fast.model.cfg.vocab_size)
        #: work captured at the end of the greedy lane's graphs, set before the warm-up:
        #: the async token buffer's storage (last, shift), set before the warm-up: the lane's
        #: graphs then gather a planned step's placeholder ids and shift its positions
        #: themselves (``ops.feed_placeholders``), from host ids and buffer indices in the step's copy
        self.token_storage: tuple[torch.Tensor, torch.Tensor] | None = None
        #: work captured at the end of the lane's graphs (needs ``token_storage``), set before
        #: the warm-up: ``tail(meta, streams, packed, greedy, n_groups, row_shift, capture)`` ->
        #: tensors (the MTP stage's catch-up, spec/mtp_verify_tail.py; DSpark's feature writes and
        #: staged draft rows, spec/dspark_verify_tail.py); ``n_groups`` the request count
        self.tail: Callable[..., Any] | None = None
        self._fed_inputs: dict[tuple[int, int], tuple[StepInputs, torch.Tensor, torch.Tensor]] = {}

    def _bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _key(self, rows: int, width: int, greedy: bool = False) -> tuple:
        return ("verify", rows, width, self.layers) + (("greedy",) if greedy else ())

    def _body(self, meta: Any) -> tuple[torch.Tensor, dict]:
        return self.fast._streams(meta, self.layers)

    @property
    def has_greedy_lane(self) -> bool:
        return self.fast.program.verify is not None

    def _body_greedy(self, arg: Any) -> tuple:
        """The lane's graph: ``arg`` a step's meta, or (meta, n_groups, src) fed from the
        token buffer (``ops.feed_placeholders``), then the ``tail`` if there is one."""
        fast = self.fast
        meta, n_groups, src = arg if isinstance(arg, tuple) else (arg, None, None)
        row_shift = None
        if n_groups is not None:
            ids, positions, row_shift = fast.ops.feed_placeholders(*self.token_storage, meta.ids, meta.positions, src)
            meta = dataclasses.replace(meta, ids=ids, positions=positions)
        capture = dict.fromkeys(self.layers) if self.layers else None
        streams, logits = fast.program.verify(fast.model, fast.batch_of(meta), fast.cache, capture)
        r = logits.shape[0]
        greedy = torch.empty(3 * r + 1, dtype=torch.int64, device=logits.device)
        packed = greedy[:2 * r].view(r, 2)  # the rows' (argmax, log-prob bits), in place at the result's head
        fast.ops.argmax_logsumexp(logits, packed=packed)
        fast.ops.greedy_verify(meta.ids, packed, meta.starts, out=greedy)
        if n_groups is None:
            return streams, capture or {}, greedy
        tail = (self.tail(meta, streams, packed, greedy, n_groups, row_shift, capture)
                if self.tail is not None else None)
        return streams, capture or {}, greedy, row_shift, tail

    def _lane_inputs(self, rows: int, width: int) -> tuple[StepInputs, torch.Tensor, torch.Tensor]:
        """A fed lane graph's persistent inputs: the step's, then per row the flat token
        buffer index its id comes from (-1: the id is given), then the request count."""
        buf = self._fed_inputs.get((rows, width))
        if buf is None:
            fast = self.fast
            head = 4 * rows + 1
            body = head + len(fast.groups) * width * rows
            flat = torch.zeros(body + rows + 1, dtype=torch.int32, device=fast.device)
            tables = {g: flat[head + i * width * rows:head + (i + 1) * width * rows].view(rows, width)
                      for i, g in enumerate(fast.groups)}
            inputs = StepInputs(flat, flat[:rows], flat[rows:2 * rows], flat[2 * rows:3 * rows], flat[3 * rows:head],
                                tables)
            buf = self._fed_inputs[(rows, width)] = (inputs, flat[-1:], flat[body:body + rows])
        return buf

    def warmup(self, shapes: list[tuple[int, int]]) -> int:
        """Capture the graphs of ``shapes`` (largest first: the smaller reuse the pool) on
        dummy steps (block 0 / slot 0 / position 0, rewritten before any request reads
        them). Returns how many it captured; the caller seals the set (``SpecDecoder.warmup``:
        after the drafter's graphs, which share the pool)."""
        fast = self.fast
        if not fast.graphs_enabled:
            return 0
        before = reserved_bytes(fast.device)
        for rows, width in shapes:
            key = self._key(rows, width)
            if not fast.graphs.has(key):
                fast.graphs.capture(key, fast._dummy_meta(rows, width), self._body)
                self.warmed.append((rows, width))
            greedy = self._key(rows, width, greedy=True)
            if self.has_greedy_lane and rows <= self.greedy_max_rows and not fast.graphs.has(greedy):
                fast.graphs.capture(greedy, self._dummy_lane_arg(rows, width), self._body_greedy)
                self.warmed.append((rows, width, "greedy"))
        after = reserved_bytes(fast.device)
        if before is not None and after is not None:
            self.graph_bytes = after - before
        return len(self.warmed)

    def _dummy_lane_arg(self, rows: int, width: int) -> Any:
        if self.token_storage is None:
            return self.fast._dummy_meta(rows, width)
        inputs, n_groups, src = self._lane_inputs(rows, width)
        inputs.fill_dummy()  # no request: the tail records into the spare row only
        src.fill_(-1)
        return self.fast._meta(inputs, width, True, rows), n_groups, src

    def _shape(self, so: Any, n: int, width: int) -> tuple[int, bool]:
        """(padded rows, graphed) of a decode-like step of ``n`` rows."""
        bucket = self._bucket(n)
        graphed = self.fast.graphs_enabled and bucket is not None and all(r.needs_sample for r in so.scheduled)
        return (bucket if graphed else n), graphed

    def takes_greedy_lane(self, so: Any) -> bool:
        """Whether :meth:`run` with ``greedy`` replays the greedy lane's graph for ``so``
        (the caller has checked the requests themselves: all greedy, no grammar)."""
        fast = self.fast
        if not so.scheduled or not fast._decode_like(so):
            return False
        width = fast._width(so)
        rows, graphed = self._shape(so, sum(r.num_tokens for r in so.scheduled), width)
        return graphed and fast.graphs.has(self._key(rows, width, greedy=True))

    def forward(self, so: Any, batch: ForwardBatch, capture: dict | None = None) -> torch.Tensor | None:
        """Final streams [T, ...] of a decode-like step (None when it is not one: the
        reference path runs it), from its graph when the shape is in the set; fills
        ``capture`` (layer id -> input streams [T, ...]) for the drafter's layers."""
        step = self.run(so, batch, capture)
        return None if step is None else step.streams

    def run(self, so: Any, batch: ForwardBatch, capture: dict | None = None, greedy: bool = False
            ) -> VerifyStep | None:
        """:meth:`forward`'s step; ``greedy`` (every request greedy, no top log-probs, no
        grammar: the caller knows) takes the greedy lane's graph when the step is graphed
        and fits it, and then returns the verification with the streams."""
        fast = self.fast
        if not fast._decode_like(so):
            return None
        layers = tuple(sorted(capture)) if capture else ()
        if layers and layers != self.layers:
            raise ValueError(f"VerifyGraphs captures layers {self.layers}, the step asked for {layers}")
        n, width = batch.num_tokens, fast._width(so)
        rows, graphed = self._shape(so, n, width)
        lane = greedy and graphed and fast.graphs.has(self._key(rows, width, greedy=True))
        # a fed lane graph gathers the placeholder ids and position shifts itself: the host
        # ids and buffer indices go in the step's one copy below
        tailed = lane and self.token_storage is not None
        host_fed = tailed and batch.host_ids is not None  # (else a batch made by hand: device ids, no shift)
        if not host_fed:
            batch.materialize()
        host = fast._host_inputs(so, width, rows)
        if tailed:
            inputs, n_groups, _ = self._lane_inputs(rows, width)
            src = np.full(rows, -1, dtype=np.int32)
            if host_fed:
                host[:n] = batch.host_ids
                ph_rows, ph_index = batch.placeholders or ([], [])
                host[ph_rows] = 0
                src[ph_rows] = ph_index
                host[n:rows], src[n:] = host[0], src[0]  # padded rows repeat row 0
            elif batch.position_shift is not None:
                raise ValueError("VerifyGraphs.run: a shifted batch without host ids cannot take the fed lane")
            host = np.concatenate([host, src, np.array([len(so.scheduled)], dtype=np.int32)])
        else:
            inputs = (fast._graph_inputs(rows, width) if graphed
                      else StepInputs.allocate(rows, width, fast.groups, fast.device))
        copy_to_device(inputs.flat, host)
        if batch.position_shift is not None and not host_fed:  # planned ahead: true positions (padding repeats row 0)
            inputs.positions[:n] += batch.position_shift.to(inputs.positions.dtype)
            inputs.positions[n:] = inputs.positions[:1]
        if not host_fed:
            inputs.ids[:n].copy_(batch.input_ids)
            if rows > n:
                inputs.ids[n:].copy_(inputs.ids[:1].expand(rows - n))
        meta = fast._meta(inputs, width, graphed, n)
        self.counts["steps"] += 1
        fast._counts["fast_steps"] += 1  # the fast path's step counts include its verify steps
        result = tail = row_shift = None
        if lane:
            self.counts["graph_steps"] += 1
            self.counts["greedy_steps"] += 1
            fast._counts["graph_steps"] += 1
            if self.token_storage is None:
                streams, hidden, result = fast.graphs.replay(self._key(rows, width, greedy=True), meta,
                                                             self._body_greedy)
            else:
                self.counts["tail_steps"] += self.tail is not None
                streams, hidden, result, row_shift, tail = fast.graphs.replay(self._key(rows, width, greedy=True),
                                                                   (meta, n_groups, self._lane_inputs(rows, width)[2]),
                                                                   self._body_greedy)
        elif graphed:
            self.counts["graph_steps"] += 1
            fast._counts["graph_steps"] += 1
            streams, hidden = fast.graphs.replay(self._key(rows, width), meta, self._body)
        else:
            self.counts["eager_steps"] += 1
            streams, hidden = self._body(meta)
        for i in layers:
            capture[i] = hidden[i][:n]
        return VerifyStep(streams[:n], result, rows, tail, row_shift)


__all__ = ["GREEDY_LOGITS_BYTES", "GREEDY_MAX_ROWS", "VerifyGraphs", "VerifyStep", "greedy_lane_max_rows",
           "verify_row_buckets", "verify_shapes"]
