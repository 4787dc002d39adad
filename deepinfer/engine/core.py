"""EngineCore: one engine instance (model, KV cache, scheduler, runner) behind four verbs.

    core = EngineCore(model_dir, dtype="float32")
    core.add_request("a", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=8))
    while core.has_unfinished():
        for delta in core.step():          # StreamDelta per request the step touched
            ...
    out = core.output("a")                 # the finished RequestOutput
    core.abort("b")                        # frees b's KV blocks now

Clients: `deepinfer.llm.LLM` (offline, a closed batch) and the server's engine clients
(requests arrive over time, deltas streamed): `deepinfer.engine.process_client.ProcessEngineClient`
(this core in its own process) and `deepinfer.engine.async_client.AsyncEngineClient` (on a
thread). Nothing here knows about any of them. Output processing (detokenization,
stop strings, deltas) is `deepinfer.engine.output_processor`.
"""

from __future__ import annotations

import atexit
import gc
import time

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.kv_cache_manager import HybridKVCacheManager, KVCacheGroupSpec
from deepinfer.engine.kv_sizing import num_kv_blocks
from deepinfer.engine.memory_profile import keep_step_memory, profile_memory
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.output_processor import OutputProcessor, StreamDelta
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer.engine.start_warmup import warm_engine_loop
from deepinfer.metrics import MetricsCollector
from deepinfer.models.bounded_replay import ReplayConfig
from deepinfer.models.default_model import resolve_model
from deepinfer.models.loader import load_model, materialize_dense_weights
from deepinfer.models.registry import family_of
from deepinfer.outputs import RequestOutput
from deepinfer.platform import get_platform
from deepinfer.profiling.markers import SCHEDULE, UPDATE, phase
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.manager import StructuredOutputManager
from deepinfer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["EngineCore"]


class EngineCore:
    """Model, KV cache, scheduler, runner, grammars and output processing of one engine."""

    #: set by engines that must keep the synchronous loop: the reason, reported as ``async_fallback``
    async_scheduling_unsupported: str | None = None

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **kwargs: object) -> None:
        # V4.1 SWA bounded replay: kwargs swa_replay_mode / swa_replay_keep or DEEPINFER_YOCO_PREFILL_*
        self.replay = ReplayConfig.resolve(kwargs)
        self.config = EngineConfig.from_kwargs(model=model, tokenizer=tokenizer, **kwargs)
        self.init_model()
        self.init_tokenizer()
        self.init_cache_and_scheduler()
        self.outputs = OutputProcessor(self.tokenizer)
        #: how many throwaway requests the start served (deepinfer/engine/start_warmup.py)
        self.warmup_requests_served = self.warm_up()

    # ---- construction ----------------------------------------------------------------
    def init_model(self) -> None:
        cfg = self.config
        self.platform = get_platform(cfg.accelerator)  # fails fast: ConfigError names what is missing
        self.device = self.platform.device()
        self.model_dir = resolve_model(cfg.model)  # None -> DEEPINFER_HF_MODEL_DIR, else the trained default
        torch.manual_seed(cfg.seed)
        self.model = load_model(self.model_dir, dtype=cfg.dtype, device=str(self.device))
        self.model_config = self.model.cfg
        if cfg.num_speculative_tokens > 0:  # no draft stage: fail before the KV cache is sized
            from deepinfer.spec import require_draft_stages
            require_draft_stages(self.model, cfg.num_speculative_tokens)
        if self.device.type == "cpu":
            small = self.model_config.hidden_size <= 1024
            threads = cfg.cpu_threads or (1 if small else None)
            if threads is not None:
                torch.set_num_threads(threads)
            # dequantizing FP8/FP4 bytes at every call costs more than the memory it saves
            if cfg.cpu_dense_weights if cfg.cpu_dense_weights is not None else small:
                materialize_dense_weights(self.model)
        self.config = cfg.resolve_max_model_len(self.model_config.max_position_embeddings)
        self.replay.validate_for(self.model_config)  # keep >= window + backtracking, V4.1 only

    def init_tokenizer(self) -> None:
        self.tokenizer: Tokenizer = load_tokenizer(self.config.tokenizer or self.model_dir)
        self.eos_token_id = self.model_config.eos_token_id

    def init_cache_and_scheduler(self) -> None:
        cfg, mcfg = self.config, self.model_config
        #: the start-up memory profile (None off a device or with num_kv_blocks given); its
        #: ``graph_bytes`` is what the decode graphs were accounted before sizing the cache
        self.memory_profile = profile_memory(self.model, cfg, self.device) if cfg.num_kv_blocks is None else None
        #: the profiled activation peak of a worst-case step (bytes; None off a device): what
        #: the KV budget keeps free besides the weights (deepinfer/engine/memory_profile.py)
        self.step_peak_bytes = self.memory_profile.total if self.memory_profile is not None else None
        blocks = num_kv_blocks(cfg, mcfg, self.model.dtype, self.device, cfg.max_model_len,
                               step_peak_bytes=self.step_peak_bytes)
        family = family_of(mcfg)
        self.kv_cache = family.new_kv_cache(mcfg, blocks, cfg.block_size, cfg.max_num_seqs, self.model.dtype,
                                            self.device)
        groups = [KVCacheGroupSpec(g, window) for g, window in family.kv_group_windows(mcfg)]
        replay = self.replay if self.replay.active else None
        self.kv_manager = HybridKVCacheManager(groups, blocks, cfg.block_size, cfg.max_num_seqs,
                                               cfg.enable_prefix_caching,
                                               hit_limit=replay.hit_limit if replay else None)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.block_size,
                            cfg.chunked_prefill, cfg.enable_prefix_caching),
            self.kv_manager)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.runner.batch_invariant = cfg.batch_invariant  # deepinfer/batch_invariant.py
        self.runner.replay = replay
        if cfg.num_speculative_tokens > 0:  # DEEPINFER_USE_NEXTN_DECODE: MTP / DSpark drafts, lossless verify
            from deepinfer.spec import setup as setup_speculative
            setup_speculative(self)
        #: decode CUDA graph shapes captured at start, largest first (0 off the fast path)
        self.graphs_warmed = self.runner.warmup(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size)
        if cfg.num_speculative_tokens > 0:
            from deepinfer.spec import measure_step_curve
            measure_step_curve(self)  # times the verify steps just warmed (graphs included)
        keep_step_memory(self.memory_profile, self.device)  # the first generate's activations, cached
        # grammars compile in worker threads; xgrammar itself loads on the first constrained request
        self.structured = StructuredOutputManager(self.tokenizer, mcfg.vocab_size, self.eos_token_id,
                                                  self.device, cfg.max_num_seqs)
        self.metrics = MetricsCollector(self.scheduler)  # host clocks only; see deepinfer/metrics.py
        # async scheduling (deepinfer/engine/async_engine.py), the default loop
        self.async_loop = None
        #: why the synchronous loop runs although async scheduling is configured (None otherwise)
        self.async_fallback: str | None = None
        if cfg.async_scheduling and self.async_scheduling_unsupported is not None:
            self.async_fallback = self.async_scheduling_unsupported
        elif cfg.async_scheduling:
            from deepinfer.engine.async_engine import AsyncStepLoop
            self.async_loop = AsyncStepLoop(self)

    def warm_up(self) -> int:
        """The last start-up step, where ``warmup_requests`` (default: on a GPU) asks for it:
        throwaway requests through the whole loop, then the start-up heap (model, cache,
        graphs, imported modules) frozen out of the cyclic garbage collector's passes, which
        otherwise walk it again in every full collection while serving (``gc.freeze``, as
        vLLM does after start-up; :meth:`shutdown` unfreezes). Returns the requests served."""
        on = self.config.warmup_requests
        if not (self.device.type == "cuda" if on is None else on):
            return 0
        served = warm_engine_loop(self)
        gc.collect()
        gc.freeze()
        # at exit too: frozen objects are never finalized, and extension modules (Triton's
        # nanobind bindings) then report them as leaked
        atexit.unregister(gc.unfreeze)
        atexit.register(gc.unfreeze)
        return served

    #: set by :meth:`shutdown`: the engine has released its device memory and serves nothing
    closed: bool = False

    def shutdown(self) -> None:
        """Release what the engine holds on its device (model, KV cache, CUDA graphs, the token
        and grammar buffers) and stop its grammar workers, so that another engine can be built
        in this process (``with LLM(...) as llm:`` calls this on exit). Idempotent; the engine
        takes no request afterwards."""
        if self.closed:
            return
        self.closed = True
        self.structured.shutdown()
        for name in ("async_loop", "runner", "kv_cache", "model", "structured"):
            setattr(self, name, None)
        gc.unfreeze()  # what warm_up froze (this engine's and others'): collectable again
        gc.collect()  # the runner, graphs and cache refer to each other
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver: the next engine sizes its KV cache from what is free

    def check_open(self) -> None:
        """Raise a clear error once the engine was shut down (before a call queues anything)."""
        if self.closed:
            raise RuntimeError("this engine was shut down (LLM.shutdown / the end of its `with` block): "
                               "build a new LLM to generate again")

    # ---- the four verbs ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    prompt: str | None = None, stream: bool = False, stream_text: bool = True) -> Request:
        """Queue one request whose inputs were checked (`deepinfer.engine.admission.admit_generate`);
        ``sampling_params`` already resolved with ``for_request()`` (a concrete seed). ``stream``:
        a delta every step; ``stream_text=False``: deltas without text (the client decodes them)."""
        self.check_open()
        req = Request(request_id, prompt_token_ids, sampling_params, eos_token_id=self.eos_token_id)
        self.outputs.add(req, prompt, stream, stream_text)
        try:
            if sampling_params.structured_output is not None:
                self.structured.add(req)  # joins the scheduler once its grammar is compiled
            else:
                self.scheduler.add_request(req)
        except BaseException:
            self.outputs.drop(request_id)
            raise
        return req

    def step(self) -> list[StreamDelta]:
        """One engine step: schedule -> execute -> update -> grammars / detokenize / stop strings.
        Returns a delta per streamed request the step touched and per finished request."""
        self.check_open()
        if self.async_loop is not None:  # schedules step N+1 before step N's update
            return self.async_loop.step()
        t_start = time.perf_counter()
        self.structured.admit_ready(self.scheduler)
        with phase(SCHEDULE):
            sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out, grammar=self.structured.batch(sched_out))
        with phase(UPDATE):
            touched = self.scheduler.update(sched_out, runner_out)
            if self.runner.spec is not None:  # drafts for the next step go to running requests
                self.runner.spec.attach(self.scheduler, self.structured)  # drafts checked against grammars
        deltas = self.process_outputs(touched)
        self.metrics.record_step(sched_out, touched, t_start)
        return deltas

    def process_outputs(self, touched: list[Request]) -> list[StreamDelta]:
        """Grammar advance, then detokenization and stop strings, for the requests an update
        touched (both loops call it after ``Scheduler.update``)."""
        for req in touched:
            if self.structured.advance(req) and not req.is_finished:  # grammar done (EOS accepted)
                self.scheduler.finish_request(req.req_id, "stop")
        return self.outputs.process(touched, self.scheduler.finish_request)

    def abort(self, request_id: str) -> StreamDelta | None:
        """End ``request_id`` now: its KV blocks go back to the pool before this returns.
        Returns its last delta (finish_reason "abort"), None if it was not running here."""
        req = self.scheduler.requests.get(request_id)
        pending = self.structured.pending.get(request_id)
        if req is None and pending is not None:
            req = pending[0]
            req.status = RequestStatus.FINISHED_ABORTED
            req.finished_time = time.monotonic()
        self.structured.release([request_id])
        if req is None:
            self.outputs.drop(request_id)
            return None
        self.scheduler.abort(request_id)
        return self.outputs.aborted(req)

    def has_unfinished(self) -> bool:
        """Whether another step has work (data-parallel ranks also ask their peers)."""
        return (self.scheduler.has_unfinished() or self.structured.has_pending()
                or (self.async_loop is not None and self.async_loop.busy))

    def output(self, request_id: str) -> RequestOutput:
        """The finished RequestOutput of a request that was not streamed."""
        return self.outputs.output(request_id)

    def discard_in_flight(self) -> None:
        """Drop the async step in flight (error path); its device work is allowed to finish."""
        if self.async_loop is not None:
            self.async_loop.discard()
