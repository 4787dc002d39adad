"""The speculative step: verify the scheduled drafts, then draft for the next step.

`ModelRunner.execute` hands the whole step here when speculation is on
(``runner.spec``). Invariant of `execute`: every sampled request's chunk ends with its
``num_draft_tokens`` drafts; its logits rows are the last ``k + 1`` rows of the chunk
(the last real token's row scores draft 1, ..., the last draft's row gives the bonus);
the returned tokens are the accepted drafts plus one target token, and the drafter then
sees exactly which rows hold valid KV (real tokens + accepted drafts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deepinfer import batch_invariant
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.request import PLACEHOLDER_TOKEN_ID
from deepinfer.engine.transfer import HostResult, to_device
from deepinfer.models.bounded_replay import replay_free
from deepinfer.models.fast.decode_graphs import BUCKETS
from deepinfer.models.fast.verify_graphs import SpecForward, VerifyGraphs, VerifyStep, verify_row_buckets, verify_shapes
from deepinfer.profiling.markers import MODEL, PREPARE_INPUTS, SAMPLE, phase

from .drafter import Draft, DraftContext, Drafter
from .host_verify import StepTokens, verify_on_host
from .metrics import SpecMetrics
from .scheduling import StepTimeCurve, split_budget
from .step_curve import OnlineStepTimeCurve
from .verify import drafts_to_verify, greedy_verify_result


def forward_capture(model, batch, cache, layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """`DeepseekV4Model.forward` (the reference path) that also returns the INPUT streams
    [T, N, D] of ``layers`` (their attention input: DSpark's target features)."""
    if not layers:
        return model(batch, cache), {}
    hidden: dict = dict.fromkeys(layers)
    streams = model(batch, cache, capture=hidden)
    return streams, hidden


@dataclass
class LaneInFlight:
    """A greedy-lane verify step whose next drafts were made behind it, between `launch` and
    `collect`: its verification and drafts on their way to the host (``result``), and
    ``device_drafts``: whether they are also in the device token buffer (a plan may feed them)."""

    so: SchedulerOutput
    picks: list[int]
    num_drafts: list[int]
    offsets: list[int]
    rows: int
    result: HostResult
    device_drafts: bool


class SpecDecoder:
    """Owns the drafter, the pending drafts and the speculative metrics of one runner."""

    def __init__(self, drafter: Drafter, num_speculative_tokens: int, varlen: bool = False,
                 curve: StepTimeCurve | OnlineStepTimeCurve | None = None, rule: str = "standard",
                 curve_source: str = "default") -> None:
        self.drafter, self.k, self.varlen = drafter, num_speculative_tokens, varlen
        #: T(verify tokens) of the confidence scheduler; an OnlineStepTimeCurve also learns from
        #: the verify steps run here (`execute` reports their wall time)
        self.curve = curve or StepTimeCurve.default()
        self.curve_source = curve_source  # "measured:<json>", "profiled" or "default"
        self.rule = rule  # acceptance rule (tests break it on purpose)
        self.metrics = SpecMetrics()
        self.confidences: dict[str, list[float]] = {}  # req_id -> confidences of its attached drafts
        self.drafts: dict[str, Draft] = {}  # proposed after the last step, not yet attached
        #: drafts a step in flight verifies from the device (attach's ``in_flight``), on the host
        self.device_drafts: dict[str, Draft] = {}
        self.probs: dict[str, torch.Tensor | None] = {}  # q of the drafts attached to requests
        #: confidences of the previous plan: the confidence-scheduled budget comes from them and is
        #: split with the newest (REFERENCE.md sections 3, 8; with async scheduling they are two
        #: steps old). A budget that depended on the newest confidences would make whether draft j
        #: is verified depend on draft j itself (c_{j+1} reads x_j): not lossless.
        self.older_confidences: list[list[float]] | None = None
        self._verify = None  # VerifyGraphs once built (verify_executor)
        #: (last, shift) device storage of the async loop's token buffer (set by ``spec.setup``)
        self.token_storage: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------ compiled verify
    def verify_executor(self, runner, max_num_seqs: int = BUCKETS[-1]):
        """The runner's compiled verify executor (built once; None off the fast path or for a
        family whose verify rows stay on the reference path)."""
        if self._verify is None and runner.fast is not None and runner.fast.program.streams is not None:
            self._verify = VerifyGraphs(runner.fast, tuple(self.drafter.target_layers),
                                        verify_row_buckets(max_num_seqs, self.k))
        return self._verify

    def warmup(self, runner, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
        """Capture the verify graphs of every shape these limits allow, then seal the fast
        path's graph set: nothing is captured while serving (the drafter's graphs have a pool
        of their own, captured by ``spec.setup``). Returns the number of graphs captured (0
        off the fast path, without graphs, or in batch-invariant mode, whose speculative
        steps run the mode's prefill rows: the prefill executor's ``spec_forward``)."""
        fast = runner.fast
        verify = self.verify_executor(runner, max_num_seqs)
        if verify is None or not fast.warms_up() or runner.batch_invariant:
            return 0
        n = verify.warmup(verify_shapes(max_num_seqs, self.k, max_model_len, block_size))
        fast.graphs.seal()
        return n

    def _forward(self, runner, so: SchedulerOutput, batch, greedy: bool = False
                 ) -> tuple[SpecForward, VerifyStep | None]:
        """The step's final streams, the drafter's captured layer inputs and a rows -> logits
        function: decode-like steps replay the verify graphs; prompt / mixed steps, and every
        step in batch-invariant mode (the mode's rows, the decode head: bitwise what a
        non-speculative decode step gives), run the compiled prefill path; the reference
        path runs the rest (bounded replay with a cut inside the step, other families).
        Second: the verify graphs' greedy-lane step (`VerifyStep`) when ``greedy`` asked for
        it and it ran, else None."""
        model, layers = runner.model, tuple(self.drafter.target_layers)
        invariant = batch_invariant.enabled()
        # bounded replay changes nothing for rows whose windows start after the cut
        if not invariant and replay_free(so, runner.replay, model.cfg):
            verify = self.verify_executor(runner)
            hidden = dict.fromkeys(layers)
            step = verify.run(so, batch, hidden if layers else None, greedy) if verify is not None else None
            if step is not None:
                streams = step.streams
                lane = step if step.greedy is not None else None
                return (streams, hidden, lambda rows: model.compute_logits(streams[rows])), lane
        # the family's prefill executor (V4.1's includes bounded replay); without one, or one
        # without speculative steps, the reference path below runs the step
        batch.materialize()
        spec_forward = getattr(runner.fast_prefill, "spec_forward", None)
        out = spec_forward(batch, layers, invariant) if spec_forward is not None else None
        if out is not None:
            return out, None
        streams, hidden = forward_capture(model, batch, runner.cache, layers)
        return (streams, hidden, lambda rows: model.compute_logits(streams[rows])), None

    def _launch_lane(self, runner, so: SchedulerOutput, batch, lane: VerifyStep, early: torch.Tensor,
                     nd: list[int], picks: list[int]) -> LaneInFlight:
        """Record the verification and the next drafts in the device token buffer (what a
        step planned ahead reads) and start their copy to the host; nothing waits."""
        offsets = [s.offset for s in batch.seqs]
        greedy = lane.greedy
        buffer = runner.token_buffer
        if batch.input_ids is None:  # the graph gathered the placeholders itself
            buffer.filled = so
            buffer.num_gathered += len(batch.placeholders[0]) if batch.placeholders else 0
        if self.drafter.plans_ahead and lane.tail is not None:  # the graph recorded the bonus and the shift
            buffer.recorded = so
            self.drafter.record_tail_drafts(buffer, so, early)
        elif self.drafter.plans_ahead:
            starts, accepted = lane.accepted(offsets, nd)
            dev = greedy.device
            meta = to_device([r.state_slot for r in so.scheduled] + nd, torch.long, dev).view(2, -1)
            bonus = lane.row_argmax(batch.num_tokens)[starts + accepted]
            buffer.record_verify(so, meta[0], bonus, self.drafter.device_draft_tokens(early), accepted - meta[1])
        with phase(SAMPLE):  # on the compute stream: the next replay rewrites the graph's outputs after it
            result = runner.copier.start([greedy, early], in_order=True)
        return LaneInFlight(so, picks, nd, offsets, lane.rows, result, self.drafter.plans_ahead)

    def collect(self, step: ModelRunnerOutput | LaneInFlight) -> ModelRunnerOutput:
        """The output of a step `launch` returned; lands a `LaneInFlight` (waits for its copy)."""
        if not isinstance(step, LaneInFlight):
            return step
        so = step.so
        with phase(SAMPLE):
            host = step.result.wait()
            res = greedy_verify_result(host[0], step.offsets, step.num_drafts, step.rows)
        self.drafts = self.drafter.drafts_from_host(so, host[1])
        self._record(so, step.picks, step.num_drafts, res)
        sampled: list[list[int]] = [[] for _ in so.scheduled]
        logprobs: list[list[float]] = [[] for _ in so.scheduled]
        for i in step.picks:
            sampled[i], logprobs[i] = res.tokens[i], res.logprobs[i]
        return ModelRunnerOutput([r.req_id for r in so.scheduled], sampled, logprobs, None)

    def _record(self, so: SchedulerOutput, picks: list[int], nd: list[int], res) -> None:
        self.metrics.record(nd, res.num_accepted)
        self.metrics.record_confidences([self.confidences.pop(so.scheduled[i].req_id, [])[:k]
                                         for i, k in zip(picks, nd)], res.num_accepted)

    # ------------------------------------------------------------------ host side
    def attach(self, scheduler, structured=None, in_flight: frozenset[str] | set[str] = frozenset()) -> None:
        """Give running requests the drafts proposed for them (after Scheduler.update).
        Fixed-length: k each; confidence-scheduled: the budget from the previous plan's
        confidences, split by the newest ones (`split_budget`). Requests of a step still in
        flight (``in_flight``: planned ahead, `spec/plan_ahead.py`) verify these drafts there,
        fed from the device: they are kept in ``device_drafts`` instead.

        Constrained requests (``structured``: the engine's StructuredOutputManager) keep
        the drafts their grammar accepts, plus the first rejected one when the proposal
        is stochastic (`drafts_to_verify` says why: it keeps verification lossless)."""
        cands = []  # (request, draft, grammar-valid drafts, drafts to verify at most)
        self.device_drafts = {}
        for req in scheduler.running:
            d = self.drafts.pop(req.req_id, None)
            if d is None:
                if PLACEHOLDER_TOKEN_ID in req.draft_token_ids:  # marked for a plan that did not take it
                    req.draft_token_ids, req.draft_confidences = [], []
                continue
            if req.req_id in in_flight:
                self.device_drafts[req.req_id] = d
                self.confidences[req.req_id] = list(d.confidences[:self.k])
                continue
            n = min(self.k, len(d.tokens))
            valid = structured.valid_draft_prefix(req, d.tokens[:n]) if structured is not None else None
            if valid is None:
                cands.append((req, d, n, n))
            else:
                deterministic = d.probs is None or req.sampling_params.is_greedy
                cands.append((req, d, valid, drafts_to_verify(n, valid, deterministic)))
        self.drafts.clear()
        if self.varlen and cands:
            lengths = self._split(newest=[d.confidences[:v] for _, d, v, _ in cands])
        else:
            lengths = [v for _, _, v, _ in cands]
        for (req, d, v, most), m in zip(cands, lengths):
            if m == v:  # every valid draft admitted: a grammar-rejected one to verify follows
                m = most
            req.draft_token_ids = list(d.tokens[:m])
            req.draft_confidences = list(d.confidences[:m])
            self.confidences[req.req_id] = req.draft_confidences
            self.probs[req.req_id] = d.probs

    def planned_ahead_lengths(self, req_ids: list[str]) -> list[int]:
        """Draft counts to verify for the requests of a step planned ahead (every one: k when
        verification is not confidence-scheduled). That step's drafts are still being made
        on the device, so the newest confidences the host has are those of the drafts the
        step in flight verifies (``self.confidences``, one block older than the sync loop's
        split): the budget comes from the plan before (``older_confidences``) and is split
        with these. Lossless: every count is fixed before the drafts it covers exist."""
        if not self.varlen:
            return [self.k] * len(req_ids)
        known = [rid for rid in req_ids if rid in self.confidences]
        by_id = dict(zip(known, self._split([self.confidences[rid][:self.k] for rid in known]))) if known else {}
        return [by_id.get(rid, self.k) for rid in req_ids]

    def _split(self, newest: list[list[float]]) -> list[int]:
        """Draft counts for confidences ``newest``: the budget of the previous plan's
        (``older_confidences``; none yet: every draft), split with these, which the next plan's
        budget then comes from."""
        lengths = ([len(c) for c in newest] if self.older_confidences is None
                   else split_budget(self.older_confidences, newest, self.curve))
        self.older_confidences = newest
        return lengths

    # ---------------------------------------------------------------- device side
    @torch.no_grad()
    def execute(self, runner, so: SchedulerOutput, grammar=None) -> ModelRunnerOutput:
        """Run one speculative step and wait for its results (the synchronous loop)."""
        return self.collect(self.launch(runner, so, grammar))

    @torch.no_grad()
    def launch(self, runner, so: SchedulerOutput, grammar=None) -> ModelRunnerOutput | LaneInFlight:
        """Run one speculative step. Under async scheduling (the runner has a device token
        buffer) a fixed-length greedy-lane step that drafted behind its verify graph returns
        as soon as its copy to the host has started (`LaneInFlight`, landed by `collect`);
        every other step returns its output."""
        t0 = time.perf_counter()
        out = self._execute(runner, so, grammar)
        if isinstance(out, LaneInFlight):
            return out
        # a pure verify step (every request: last token + drafts) corrects the step-time curve;
        # its results reached the host above, so the host clock covers the device work
        if isinstance(self.curve, OnlineStepTimeCurve) and so.scheduled and all(
                r.needs_sample and r.num_tokens == r.num_draft_tokens + 1 for r in so.scheduled):
            self.curve.observe(sum(r.num_tokens for r in so.scheduled), time.perf_counter() - t0)
        return out

    def _execute(self, runner, so: SchedulerOutput, grammar=None) -> ModelRunnerOutput:
        model = runner.model
        self.drafter.drop(so.preempted_req_ids + so.finished_req_ids)
        for rid in so.preempted_req_ids + so.finished_req_ids:
            self.probs.pop(rid, None)
        req_ids = [r.req_id for r in so.scheduled]
        sampled: list[list[int]] = [[] for _ in so.scheduled]
        if not so.scheduled:
            return ModelRunnerOutput(req_ids, sampled)
        with phase(PREPARE_INPUTS):  # the lane's verify graphs gather placeholders themselves
            verify = self._verify
            batch = runner.build_batch(so, deferred=verify is not None and verify.token_storage is not None)
        # the verify graphs' greedy lane: acceptance inside the graph, one copy to the host
        lane_ok = grammar is None and self.rule == "standard" and all(
            r.needs_sample and r.num_tokens == r.num_draft_tokens + 1 and r.sampling_params.is_greedy
            and not r.sampling_params.top_logprobs for r in so.scheduled)
        with phase(MODEL):
            (streams, hidden, logits_of), lane = self._forward(runner, so, batch, greedy=lane_ok)
        picks = [i for i, r in enumerate(so.scheduled) if r.needs_sample]
        valid = [r.num_tokens - r.num_draft_tokens for r in so.scheduled]
        emitted: list[list[int] | None] = [None] * len(so.scheduled)
        logprobs: list[list[float]] = [[] for _ in so.scheduled]
        tops: list = [[] for _ in so.scheduled]
        any_top = any(so.scheduled[i].sampling_params.top_logprobs for i in picks)
        drafted = None  # drafts launched behind the verify graph (Drafter.draft_after_verify)
        if batch.planned_ahead and lane is None:
            raise RuntimeError("a speculative step planned ahead left the verify graphs' greedy lane")
        if lane is not None:
            for r in so.scheduled:
                self.probs.pop(r.req_id, None)
            nd = [r.num_draft_tokens for r in so.scheduled]
            early = self.drafter.draft_after_verify(so, batch, streams, hidden, lane)
            if early is None and batch.planned_ahead:
                raise RuntimeError("a speculative step planned ahead did not draft behind its verify graph")
            if early is not None and runner.token_buffer is not None:
                return self._launch_lane(runner, so, batch, lane, early, nd, picks)
            batch.materialize()  # the host paths below read the batch's device ids
            with phase(SAMPLE):
                host = runner.copier.start([lane.greedy] + ([early] if early is not None else [])).wait()
                res = greedy_verify_result(host[0], [s.offset for s in batch.seqs], nd, lane.rows)
            if early is not None:
                drafted = self.drafter.drafts_from_host(so, host[1])
            self._record(so, picks, nd, res)
            for i in picks:
                sampled[i] = emitted[i] = res.tokens[i]
                logprobs[i] = res.logprobs[i]
                valid[i] += res.num_accepted[i]
            picks = []  # verified above (no top log-probs: the lane's condition)
        if picks:  # rejection sampling of the logits rows (any sampling settings, grammars, top log-probs)
            verify_on_host(self, runner, so, batch, logits_of, picks, grammar, any_top,
                           StepTokens(sampled, emitted, logprobs, tops, valid))
        if drafted is None:
            drafted = self.drafter.propose(DraftContext(batch, streams, hidden, so.scheduled, valid, emitted), self.k)
        self.drafts = drafted
        return ModelRunnerOutput(req_ids, sampled, logprobs, tops if any_top else None)
