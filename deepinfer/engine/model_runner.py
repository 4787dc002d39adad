"""The device side of a step: SchedulerOutput -> flattened inputs -> model -> sampler
-> ModelRunnerOutput.

This is the reference (eager) runner used on CPU; the GPU fast path plugs in behind the
same `execute` contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer import batch_invariant
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.sampler import Sampler, SamplingTensors
from deepinfer.models.deepseek_v4 import DeepseekV4Model
from deepinfer.models.fast.prefill import PrefillPath
from deepinfer.models.fast.runner import FastPath
from deepinfer.models.kv_cache import ForwardBatch, KVCache, SeqMeta
from deepinfer.profiling.markers import LOGITS, MODEL, PREPARE_INPUTS, SAMPLE, phase

if TYPE_CHECKING:
    from deepinfer.structured.batch import StructuredOutputBatch


class ModelRunner:
    """Owns the model replica and its KV cache; stateless across steps apart from the
    cache (the scheduler sends full block tables every step)."""

    def __init__(self, model: DeepseekV4Model, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        self.device = cache.swa[0].device
        self.sampler = Sampler()
        #: Run every step in batch-invariant mode (LLM sets it from EngineConfig.batch_invariant).
        self.batch_invariant = False
        self.replay = None  # V4.1 SWA bounded replay (models.bounded_replay.ReplayConfig), set by the engine
        self.spec = None  # speculative decoding (deepinfer.spec.runner.SpecDecoder), set by deepinfer.spec.setup
        #: GPU fast path (deepinfer/models/fast): batched pure-decode steps + CUDA graphs; None = reference
        self.fast = FastPath.create(model, cache)
        #: GPU fast path of prefill / mixed steps (deepinfer/models/fast/prefill.py); None = reference
        self.fast_prefill = PrefillPath.create(model, cache)

    def build_batch(self, so: SchedulerOutput) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqMeta] = []
        for req in so.scheduled:
            seqs.append(SeqMeta(req.start_pos, req.num_tokens, len(ids), req.block_table, req.state_slot, req.is_new,
                                req.num_prompt_tokens))
            ids.extend(req.token_ids)
            positions.extend(range(req.start_pos, req.start_pos + req.num_tokens))
        return ForwardBatch(torch.tensor(ids, dtype=torch.long, device=self.device),
                            torch.tensor(positions, dtype=torch.long, device=self.device), seqs, self.replay)

    @torch.no_grad()
    @batch_invariant.scoped  # the whole step (model, logits, sampler) in the runner's mode
    def execute(self, so: SchedulerOutput, grammar: StructuredOutputBatch | None = None) -> ModelRunnerOutput:
        """Run one step. ``grammar`` (structured output) masks its requests' logits
        rows in place before sampling. Every request whose chunk reaches its last known token samples
        one token from the logits of its last row."""
        if self.spec is not None:  # verify drafts + draft the next ones (deepinfer/spec/runner.py)
            return self.spec.execute(self, so, grammar)
        req_ids = [r.req_id for r in so.scheduled]
        sampled: list[list[int]] = [[] for _ in so.scheduled]
        if not so.scheduled:
            return ModelRunnerOutput(req_ids, sampled)
        with phase(PREPARE_INPUTS):
            batch = self.build_batch(so)
            fast = self.fast
            if fast is not None and self.replay is None and not batch_invariant.enabled():
                batch.decode = fast.prepare(so, batch)  # None unless a pure-decode step
            prefill = None
            if (batch.decode is None and self.fast_prefill is not None and self.replay is None
                    and not batch_invariant.enabled()):
                prefill = self.fast_prefill.prepare(batch)  # prefill / mixed steps
        with phase(MODEL):
            fast_logits = fast.run(so, batch) if batch.decode is not None else None  # every row
            streams = None
            if fast_logits is None:
                streams = self.model(batch, self.cache) if prefill is None else self.fast_prefill.forward(batch, prefill)
        picks = [i for i, r in enumerate(so.scheduled) if r.needs_sample]
        logprobs: list[list[float]] = [[] for _ in so.scheduled]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in so.scheduled]
        any_top = any(so.scheduled[i].sampling_params.top_logprobs for i in picks)
        if picks:
            rows = torch.tensor([batch.seqs[i].offset + batch.seqs[i].length - 1 for i in picks], device=self.device)
            with phase(LOGITS):
                logits = self.model.compute_logits(streams[rows]) if fast_logits is None else fast_logits[rows]
            if grammar is not None:  # host fill overlaps the async forward on a GPU
                grammar.apply(logits, [so.scheduled[i].req_id for i in picks])
            reqs = [so.scheduled[i] for i in picks]
            params = SamplingTensors.from_params([r.sampling_params for r in reqs],
                                                 [r.start_pos + r.num_tokens for r in reqs], self.device)
            with phase(SAMPLE):  # .tolist() is where the host waits for the device
                out = self.sampler.sample(logits, params)
                tokens, lps = out.token_ids.tolist(), out.logprobs.tolist()
            top_ids = top_vals = None
            if out.top_logprobs is not None:
                top_ids, top_vals = out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist()
            for j, i in enumerate(picks):
                sampled[i] = [tokens[j]]
                logprobs[i] = [lps[j]]
                k = so.scheduled[i].sampling_params.top_logprobs
                tops[i] = [list(zip(top_ids[j][:k], top_vals[j][:k])) if k and top_ids is not None else []]
        return ModelRunnerOutput(req_ids, sampled, logprobs, tops if any_top else None)
