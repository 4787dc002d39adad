"""The device side of a step: SchedulerOutput -> flattened inputs -> model -> sampler
-> ModelRunnerOutput.

This is the reference (eager) runner used on CPU; the GPU fast path plugs in behind the
same contract. A step runs in three calls so that async scheduling can interleave host
work with it (``execute`` chains them for the synchronous loop):

* ``launch(so)``: inputs, forward and the sampled rows' logits are issued (on a GPU the
  host does not wait for them);
* ``sample(step, grammar)``: grammar bitmask, sampling, the D2H copy of the results on a
  side stream (deepinfer/engine/transfer.py); with async scheduling a constrained step
  calls it once the previous step's tokens reached the matchers;
* ``collect(step)``: waits for that copy only and returns the ModelRunnerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepinfer import batch_invariant as bi  # (the runner's ``batch_invariant`` is its flag)
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.sampler import Sampler, SamplingTensors, unpack_greedy
from deepinfer.engine.transfer import HostResult, ResultCopier, aligned_starts, reserve_staging, to_device
from deepinfer.models.bounded_replay import replay_free
from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
from deepinfer.models.registry import family_of
from deepinfer.models.v4.kv_cache import KVCache
from deepinfer.models.v4.model import DeepseekV4Model
from deepinfer.profiling.markers import LOGITS, MODEL, PREPARE_INPUTS, SAMPLE, WAIT, phase

if TYPE_CHECKING:
    from deepinfer.engine.token_buffer import DeviceTokenBuffer
    from deepinfer.structured.batch import StructuredOutputBatch


@dataclass
class LaunchedStep:
    """A step between ``ModelRunner.launch`` and ``collect``: ``picks`` index the
    scheduled requests that sample, ``logits`` their rows (device) until sampled."""

    so: SchedulerOutput
    picks: list[int]
    logits: torch.Tensor | None = None
    result: HostResult | None = None  # sampled tokens / logprobs on their way to the host
    output: ModelRunnerOutput | None = None  # set directly by the speculative path
    spec: Any = None  # a speculative step still landing (deepinfer.spec.runner.LaneInFlight)
    reduced: Any = None  # a graphed decode step's per-row argmax / log-sum-exp (FastPath.reduced)
    packed: bool = False  # result is one [R, 2] tensor of (token, log-prob bits): the greedy lane


class ModelRunner:
    """Owns the model replica and its KV cache; stateless across steps apart from the
    cache (the scheduler sends full block tables every step)."""

    def __init__(self, model: DeepseekV4Model, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        self.device = cache.swa[0].device
        self.sampler = Sampler()
        #: all-greedy graphed decode steps sample inside their graph (_greedy_lane); tools that
        #: record every step's logits through ``sampler.sample`` turn it off
        self.greedy_lane = True
        self.greedy_lane_steps = 0
        self._batch_invariant = False
        self.replay = None  # V4.1 SWA bounded replay (models.bounded_replay.ReplayConfig), set by the engine
        self.spec = None  # speculative decoding (deepinfer.spec.runner.SpecDecoder), set by deepinfer.spec.setup
        #: GPU fast path (deepinfer/models/fast): batched pure-decode steps + CUDA graphs; None = reference
        family = family_of(model.cfg)  # the family's compiled executors, chosen once
        self.fast = family.decode_executor(model, cache) if family.decode_executor else None
        #: GPU fast path of prefill / mixed steps (the family's prefill_executor: V4's
        #: models/v4/fast/prefill.py, V4.1's models/v41/fast/prefill.py); None = reference
        self.fast_prefill = family.prefill_executor(model, cache) if family.prefill_executor else None
        #: async scheduling (deepinfer/engine/token_buffer.py): placeholder inputs gathered on the device
        self.token_buffer: DeviceTokenBuffer | None = None
        self.copier = ResultCopier(self.device)

    @property
    def batch_invariant(self) -> bool:
        """Run every step in batch-invariant mode (the engine sets it from
        EngineConfig.batch_invariant, before the warm-up). The compiled executors then run
        the mode's op namespaces (deepinfer/models/fast/invariant.py)."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, flag: bool) -> None:
        from deepinfer.models.fast.invariant import invariant_ops

        self._batch_invariant = bool(flag)
        for executor in (e for e in (self.fast, self.fast_prefill) if e is not None):
            default = executor.__dict__.setdefault("default_ops", executor.ops)
            executor.ops = invariant_ops(default) if flag else default

    def _invariant_decode(self, so: SchedulerOutput) -> bool:
        """In the mode the decode graphs take steps of one generated token per request
        (their compressors pool a closing window from the ring after the step's writes)."""
        return all(r.num_tokens == 1 for r in so.scheduled)

    def build_batch(self, so: SchedulerOutput, deferred: bool = False) -> ForwardBatch:
        """The step's batch. ``deferred``: its device ids and positions are made only when a
        path asks (`ForwardBatch.materialize`): a verify graph that gathers its placeholders
        itself reads the host lists (spec/mtp_verify_tail.py), with no copy or gather here."""
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqMeta] = []
        for req in so.scheduled:
            seqs.append(SeqMeta(req.start_pos, req.num_tokens, len(ids), req.block_table, req.state_slot, req.is_new,
                                req.num_prompt_tokens))
            ids.extend(req.token_ids)
            positions.extend(range(req.start_pos, req.start_pos + req.num_tokens))
        # one host -> device copy: ids, positions and (async) the placeholder rows / slots
        rows, slots = self.token_buffer.placeholder_index(so) if self.token_buffer is not None else ([], [])
        batch = ForwardBatch(None, None, seqs, self.replay, host_ids=ids, placeholders=(rows, slots))
        if deferred:  # (the graph's gather reads no debug sentinel: `materialize` paths keep them)
            batch._materialize = lambda b: self._to_device(so, b, ids, positions, rows, slots)
            return batch
        return self._to_device(so, batch, ids, positions, rows, slots)

    def _to_device(self, so: SchedulerOutput, batch: ForwardBatch, ids: list[int], positions: list[int],
                   rows: list[int], slots: list[int]) -> ForwardBatch:
        # one copy, each part 16-byte aligned (aligned_starts: the warm-up's own tensors are,
        # so an odd-sized step would otherwise compile kernel variants the warm-up never ran)
        parts = (ids, positions, rows, slots)
        starts, _ = aligned_starts([len(x) for x in parts])
        values: list[int] = []
        for part, at in zip(parts, starts):
            values.extend([0] * (at - len(values)))
            values.extend(part)
        flat = to_device(values, torch.long, self.device)  # no padding after the last part
        ids_d, pos_d, rows_d, slots_d = (flat[at:at + len(x)] for x, at in zip(parts, starts))
        batch.input_ids, batch.positions = ids_d, pos_d
        if self.token_buffer is not None:
            self.token_buffer.fill(so, batch, (rows_d, slots_d))
        return batch

    def execute(self, so: SchedulerOutput, grammar: StructuredOutputBatch | None = None) -> ModelRunnerOutput:
        """Run one step and wait for its results. ``grammar`` (structured output) masks its
        requests' logits rows in place before sampling. Every request whose chunk reaches
        its last known token samples one token from the logits of its last row."""
        return self.collect(self.sample(self.launch(so), grammar))

    @torch.no_grad()
    @bi.scoped  # model, logits and (in sample) the sampler in the runner's mode
    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        """Issue the step's inputs, forward and sampled rows' logits."""
        step = LaunchedStep(so, [i for i, r in enumerate(so.scheduled) if r.needs_sample])
        if self.spec is not None or not so.scheduled:  # speculative: verify + draft run in sample()
            return step
        with phase(PREPARE_INPUTS):
            batch = self.build_batch(so)
            fast = self.fast
            invariant = bi.enabled()
            if (fast is not None and replay_free(so, self.replay, self.model.cfg)
                    and (not invariant or self._invariant_decode(so))):
                batch.decode = fast.prepare(so, batch)  # None unless a pure-decode step
            prefill = None
            if batch.decode is None and self.fast_prefill is not None and (
                    self.replay is None or getattr(self.fast_prefill, "bounded_replay", False)):
                prefill = self.fast_prefill.prepare(batch)  # prefill / mixed steps
        seqs = batch.seqs
        last = [seqs[i].offset + seqs[i].length - 1 for i in step.picks]  # the rows that sample
        with phase(MODEL):
            fast_logits = fast.run(so, batch) if batch.decode is not None else None  # every row
            picked = None  # final streams of the rows that sample
            if fast_logits is None:
                rows = (to_device(last, torch.long, self.device) if last
                        else torch.empty(0, dtype=torch.long, device=self.device))
                if prefill is not None and invariant:  # the decode step's head for those rows
                    step.logits = self.fast_prefill.invariant_logits(batch, prefill, rows)
                elif prefill is not None:  # the last hc_post only for those rows
                    picked = self.fast_prefill.forward(batch, prefill, rows)
                else:
                    picked = self.model(batch, self.cache)[rows]
        if step.picks:
            with phase(LOGITS):
                if step.logits is not None:  # computed with the layers (invariant prefill)
                    pass
                elif fast_logits is None:
                    step.logits = self.model.compute_logits(picked)
                elif last == list(range(fast_logits.shape[0])):
                    step.logits = fast_logits  # a plain decode step: every row samples, in order
                    # (the mode's sampler reduces with the same kernel on CUDA only: elsewhere
                    # the graph's reduction would give other bits than a prefill step's)
                    step.reduced = fast.reduced if not invariant or fast_logits.is_cuda else None
                else:
                    step.logits = fast_logits[to_device(last, torch.long, self.device)]
        return step

    @torch.no_grad()
    @bi.scoped
    def sample(self, step: LaunchedStep, grammar: StructuredOutputBatch | None = None) -> LaunchedStep:
        """Mask (``grammar``), sample and start copying the results to the host."""
        so = step.so
        if self.spec is not None:  # verify drafts + draft the next ones (deepinfer/spec/runner.py)
            out = self.spec.launch(self, so, grammar)
            if isinstance(out, ModelRunnerOutput):
                step.output = out
            else:
                step.spec = out
            return step
        if not step.picks:
            return step
        reqs = [so.scheduled[i] for i in step.picks]
        logits, step.logits = step.logits, None
        if grammar is not None:  # host fill overlaps the async forward on a GPU
            grammar.apply(logits, [r.req_id for r in reqs])
            step.reduced = None  # computed from the unmasked logits
        buffer = self.token_buffer
        if self.greedy_lane and step.reduced is not None and all(
                r.sampling_params.is_greedy and not r.sampling_params.top_logprobs for r in reqs):
            return self._greedy_lane(step, reqs)
        params = SamplingTensors.from_params([r.sampling_params for r in reqs],
                                             [r.start_pos + r.num_tokens for r in reqs], self.device,
                                             state_slots=[r.state_slot for r in reqs] if buffer is not None else None)
        with phase(SAMPLE):
            red = step.reduced
            out = self.sampler.sample(logits, params, None if red is None else (red.argmax, red.lse,
                                                                               red.argmax_logprob))
        if buffer is not None:
            buffer.record(so, reqs, out.token_ids, params.state_slots)
        tensors = [out.token_ids, out.logprobs]
        if out.top_logprobs is not None:
            tensors += list(out.top_logprobs)
        step.result = self.copier.start(tensors)
        return step

    def _greedy_lane(self, step: LaunchedStep, reqs: list) -> LaunchedStep:
        """An all-greedy plain decode step without top log-probs samples inside its CUDA
        graph: the tokens and log-probs are the graph's argmax / log-sum-exp (no sampling
        tensors, no sampler launch, one device -> host copy)."""
        red = step.reduced
        packed = red.packed.clone()  # the next replay rewrites the graph's outputs
        if self.token_buffer is not None:
            self.token_buffer.record(step.so, reqs, packed[:, 0], red.slots)
        self.greedy_lane_steps += 1
        step.result, step.packed, step.reduced = self.copier.start([packed]), True, None
        return step

    def warmup(self, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
        """Capture the fast path's decode CUDA graphs for these limits up front, largest
        first (compiles its kernels too); returns how many shapes ran (0 off the fast path)."""
        if self.fast is None:
            return 0
        reserve_staging(self.copier)  # no pinned allocation in the first steps served
        with torch.no_grad(), bi.batch_invariant_mode(self.batch_invariant):  # the graphs' mode
            if self.spec is not None:  # speculative steps: the verify graphs instead
                return self.spec.warmup(self, max_num_seqs, max_model_len, block_size)
            return self.fast.warmup(max_num_seqs, max_model_len, block_size)

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """The step's ModelRunnerOutput; waits only for its own results' copy."""
        if step.output is not None:
            return step.output
        if step.spec is not None:
            with phase(WAIT):
                step.output = self.spec.collect(step.spec)
            return step.output
        so = step.so
        req_ids = [r.req_id for r in so.scheduled]
        sampled: list[list[int]] = [[] for _ in so.scheduled]
        if step.result is None:
            return ModelRunnerOutput(req_ids, sampled)
        with phase(WAIT):  # where the host waits for the device
            host = step.result.wait()
        if step.packed:
            tokens, lps = unpack_greedy(host[0])
            top_ids = top_vals = None
        else:
            tokens, lps = host[0].tolist(), host[1].tolist()
            top_ids, top_vals = (host[2].tolist(), host[3].tolist()) if len(host) > 2 else (None, None)
        logprobs: list[list[float]] = [[] for _ in so.scheduled]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in so.scheduled]
        any_top = any(so.scheduled[i].sampling_params.top_logprobs for i in step.picks)
        for j, i in enumerate(step.picks):
            sampled[i] = [tokens[j]]
            logprobs[i] = [lps[j]]
            k = so.scheduled[i].sampling_params.top_logprobs
            tops[i] = [list(zip(top_ids[j][:k], top_vals[j][:k])) if k and top_ids is not None else []]
        return ModelRunnerOutput(req_ids, sampled, logprobs, tops if any_top else None)
