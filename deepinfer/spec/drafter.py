"""The drafter interface and two reference drafters (oracle, random) used by the tests.

After every step the spec runner (`deepinfer/spec/runner.py`) hands the drafter a
`DraftContext`: the step's flattened batch, the target's final streams (and captured
input streams of the layers the drafter asked for), and per scheduled request how many
of its rows hold valid KV and which tokens were emitted. The drafter returns, per
sampled request, up to ``k`` draft tokens, their draft distributions ``q`` (``None`` =
deterministic proposal, q one-hot) and per-draft confidences (survival probabilities
used by the confidence-scheduled budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.engine import rng
from deepinfer.engine.outputs import ScheduledRequest
from deepinfer.models.paged_batch import ForwardBatch


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] draft distributions, None = one-hot
    confidences: list[float] = field(default_factory=list)


@dataclass
class DraftContext:
    batch: ForwardBatch
    streams: torch.Tensor  # the target's final output rows: V4 streams [T, N, D], V4.1 collapsed [T, D]
    hidden: dict[int, torch.Tensor]  # captured layer INPUT streams (layer id -> [T, N, D])
    scheduled: list[ScheduledRequest]
    valid: list[int]  # per scheduled request: rows of the step whose KV is now valid
    emitted: list[list[int] | None]  # per scheduled request: tokens returned (None = no sample)


class Drafter:
    """Proposes draft tokens after a step. ``target_layers``: hidden states to capture."""

    target_layers: tuple[int, ...] = ()
    #: positions beyond the last verified token a drafter writes into the paged cache.
    lookahead: int = 0
    #: the GPU fast path's batched ops (``FastPath.ops``) when the runner has one (``spec.setup``)
    fast_ops: Any = None
    #: drafts behind the verify graph at positions shifted on the device, with
    #: `device_draft_tokens`: the next step may be planned before this one lands
    plans_ahead: bool = False

    def propose(self, ctx: DraftContext, k: int) -> dict[str, Draft]:
        raise NotImplementedError

    def draft_after_verify(self, so: Any, batch: ForwardBatch, streams: torch.Tensor,
                           hidden: dict[int, torch.Tensor], lane: Any) -> torch.Tensor | None:
        """The next step's drafts as a device tensor, launched right behind a greedy-lane
        verify step (``lane``: its `VerifyStep`) before the verification reaches the host,
        so that one copy carries both and the draft's host inputs are built while the
        verify graph runs; None when this drafter drafts from the host result (`propose`).
        `drafts_from_host` reads the copied tensor."""
        return None

    def drafts_from_host(self, so: Any, host: torch.Tensor) -> dict[str, Draft]:
        """The drafts of `draft_after_verify`'s tensor, copied to the host."""
        raise NotImplementedError

    def can_draft_after_verify(self, so: Any) -> bool:
        """Whether `draft_after_verify` drafts behind the verify graph of ``so`` even when its
        positions are shifted on the device (``VerifyStep.row_shift``): the condition
        for planning the step after ``so`` before ``so`` lands (`spec/plan_ahead.py`)."""
        return False

    def verify_tail(self, last: torch.Tensor, shift: torch.Tensor) -> Any:
        """Work captured at the end of the verify graphs' greedy lane, recording into the
        token buffer's storage (``last``, ``shift``): `VerifyGraphs.tail`; None: none."""
        return None

    def record_tail_drafts(self, buffer: Any, so: Any, drafts: torch.Tensor) -> None:
        """Record `draft_after_verify`'s drafts of a step whose verify graph ran this drafter's
        `verify_tail` (which recorded the bonus token) in the device token buffer."""
        raise NotImplementedError

    def device_draft_tokens(self, drafts: torch.Tensor) -> torch.Tensor:
        """[requests, k] draft token ids of `draft_after_verify`'s tensor, on the device."""
        raise NotImplementedError

    def drop(self, req_ids: list[str]) -> None:
        """Forget per-request state of finished / preempted requests."""


class OracleDrafter(Drafter):
    """Drafts the known target continuation (``reference[req_id]``: the request's output
    tokens as the target produces them). Acceptance is 100% when the reference is right."""

    def __init__(self, reference: dict[str, list[int]]) -> None:
        self.reference = reference

    def propose(self, ctx: DraftContext, k: int) -> dict[str, Draft]:
        out = {}
        for r, emitted in zip(ctx.scheduled, ctx.emitted):
            if emitted is None or r.req_id not in self.reference:
                continue
            done = r.output_len + len(emitted)
            toks = self.reference[r.req_id][done: done + k]
            out[r.req_id] = Draft(toks, None, [1.0] * len(toks))
        return out


class RandomDrafter(Drafter):
    """Uniformly random drafts from the counter RNG (independent of the target's noise, so
    treating them as deterministic proposals is lossless). Acceptance ~ 1/V."""

    def __init__(self, vocab_size: int, seed: int = 1234) -> None:
        self.vocab_size, self.seed = vocab_size, seed

    def propose(self, ctx: DraftContext, k: int) -> dict[str, Draft]:
        out = {}
        for i, (r, emitted) in enumerate(zip(ctx.scheduled, ctx.emitted)):
            if emitted is None:
                continue
            pos = r.start_pos + ctx.valid[i] + 1
            seed = torch.tensor([self.seed], dtype=torch.int64)
            u = rng.uniform(seed, torch.tensor([pos], dtype=torch.int64), rng.SAMPLE, k)[0]
            toks = (u * self.vocab_size).long().clamp(max=self.vocab_size - 1).tolist()
            out[r.req_id] = Draft(toks, None, [0.5] * k)
        return out
