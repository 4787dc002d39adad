"""`LLM`: offline inference over the engine, the interface DeepInfer users know.

    from deepinfer import LLM, SamplingParams
    llm = LLM()                                   # embedded default checkpoint
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import importlib
import itertools
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from deepinfer.config import EngineConfig
from deepinfer.detokenizer import IncrementalDetokenizer
from deepinfer.engine.kv_cache_manager import HybridKVCacheManager, KVCacheGroupSpec
from deepinfer.engine.inputs import expand_sampling_params
from deepinfer.engine.kv_sizing import num_kv_blocks
from deepinfer.engine.memory_profile import profile_step_peak_bytes
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer.errors import InvalidRequestError
from deepinfer.metrics import MetricsCollector
from deepinfer.models.bounded_replay import ReplayConfig
from deepinfer.models.registry import family_of
from deepinfer.models.loader import load_model, materialize_dense_weights
from deepinfer.models.default_model import resolve_model
from deepinfer.outputs import RequestMetrics, RequestOutput
from deepinfer.platform import get_platform
from deepinfer.profiling.markers import SCHEDULE, UPDATE, phase
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.manager import StructuredOutputManager
from deepinfer.tokenizer import Tokenizer, load_tokenizer


class LLM:
    """An engine instance: model, KV cache, scheduler and runner in one process."""

    #: set by engines that must keep the synchronous loop: the reason, reported as ``async_fallback``
    async_scheduling_unsupported: str | None = None

    #: what ``data_parallel_size`` / ``expert_parallel_size`` > 1 builds instead: the multi-process
    #: driver, a subclass of this class in the layer above it. Named, not imported: the driver and
    #: its ranks import this module, so an import here would be an import cycle (the one place
    #: where the engine refers up the layers, and only when asked for more than one rank).
    multi_process_engine: str = "deepinfer.parallel.dp_engine:DPLLM"

    def __new__(cls, *args: object, **kwargs: object) -> LLM:
        """``data_parallel_size`` / ``expert_parallel_size`` > 1 builds the multi-process
        engine instead (`deepinfer.parallel.dp_engine.DPLLM`, a subclass of this one)."""
        sizes = (kwargs.get("data_parallel_size", 1), kwargs.get("expert_parallel_size", 1))
        if cls is LLM and any(isinstance(n, int) and not isinstance(n, bool) and n > 1 for n in sizes):
            module, name = cls.multi_process_engine.split(":")
            return super().__new__(getattr(importlib.import_module(module), name))
        return super().__new__(cls)

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **kwargs: object) -> None:
        # V4.1 SWA bounded replay: kwargs swa_replay_mode / swa_replay_keep or DEEPINFER_YOCO_PREFILL_*
        self.replay = ReplayConfig.resolve(kwargs)
        self.config = EngineConfig.from_kwargs(model=model, tokenizer=tokenizer, **kwargs)
        self.init_model()
        self.init_tokenizer()
        self.init_cache_and_scheduler()
        self._ids = itertools.count()

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
        #: the profiled activation peak of a worst-case step (bytes; None off a device): what
        #: the KV budget keeps free besides the weights (deepinfer/engine/memory_profile.py)
        self.step_peak_bytes = (profile_step_peak_bytes(self.model, cfg, self.device)
                                if cfg.num_kv_blocks is None else None)
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

    # ---- requests ----------------------------------------------------------------------
    def _prompts(self, prompts: str | Sequence[str] | None,
                 prompt_token_ids: Sequence[Sequence[int]] | Sequence[int] | None) -> list[tuple[str | None, list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("generate() needs exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            items = [prompts] if isinstance(prompts, str) else list(prompts)
            for i, p in enumerate(items):
                if not isinstance(p, str):
                    raise InvalidRequestError(f"prompts[{i}] must be a str, got {type(p).__name__}")
                if p == "":
                    raise InvalidRequestError(f"prompts[{i}] is empty; a prompt needs at least one character")
            encoded = [(p, self.tokenizer.encode(p)) for p in items]
            vocab = self.model_config.vocab_size
            for i, (_, ids) in enumerate(encoded):
                if max(ids) >= vocab:
                    raise InvalidRequestError(
                        f"prompts[{i}] tokenizes to ids >= the model's vocab_size {vocab}; the tokenizer "
                        f"({self.tokenizer.vocab_size} tokens) does not match this checkpoint")
            return encoded
        ids = list(prompt_token_ids)
        if ids and all(isinstance(t, int) for t in ids):
            ids = [ids]
        vocab = self.model_config.vocab_size
        out = []
        for i, seq in enumerate(ids):
            seq = list(seq)
            if not seq:
                raise InvalidRequestError(f"prompt_token_ids[{i}] is empty; a prompt needs at least one token")
            bad = [t for t in seq if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt_token_ids[{i}] has token ids outside [0, {vocab}): {bad[:5]}")
            out.append((None, seq))
        return out

    def _check_lengths(self, prompts: list[tuple[str | None, list[int]]]) -> None:
        limit = self.config.max_model_len
        for i, (_, ids) in enumerate(prompts):
            if len(ids) >= limit:
                raise InvalidRequestError(
                    f"prompt {i} has {len(ids)} tokens; the model's context (max_model_len) is {limit}, "
                    f"so prompts must have at most {limit - 1} tokens")

    # ---- the main loop -----------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | Sequence[int] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.
        Every input is validated before any request is queued, so a bad one raises a
        clear InvalidRequestError and leaves the engine serving."""
        items = self._prompts(prompts, prompt_token_ids)
        params = expand_sampling_params(sampling_params, len(items))
        params = [p.for_request() for p in params]  # unseeded params: a fresh seed per request
        self._check_lengths(items)
        self.structured.check(params)  # bad / unsupported grammars raise here, before anything is queued
        reqs, detoks = [], {}
        for (text, ids), sp in zip(items, params):
            req = Request(f"req-{next(self._ids)}", ids, sp, eos_token_id=self.eos_token_id)
            if sp.structured_output is not None:
                self.structured.add(req)  # joins the scheduler once its grammar is compiled
            else:
                self.scheduler.add_request(req)
            reqs.append(req)
            detoks[req.req_id] = IncrementalDetokenizer(self.tokenizer, ids, sp.skip_special_tokens, sp.stop,
                                                        sp.include_stop_str_in_output)
        bar = tqdm(total=len(reqs), desc="generate", disable=not use_tqdm)
        try:
            while self._keep_stepping():
                self.step(detoks, bar)
        except BaseException:
            if self.async_loop is not None:
                self.async_loop.discard()
            for req in reqs:  # never leave this call's requests behind in the engine
                if not req.is_finished:
                    self.scheduler.abort(req.req_id)
            raise
        finally:
            bar.close()
            self.structured.release([r.req_id for r in reqs])
        return [self._output(text, req, detoks[req.req_id]) for (text, _), req in zip(items, reqs)]

    def _keep_stepping(self) -> bool:
        """Whether generate() runs another step (data-parallel ranks also ask their peers)."""
        return (self.scheduler.has_unfinished() or self.structured.has_pending()
                or (self.async_loop is not None and self.async_loop.busy))

    def chat(self, messages, sampling_params=None, thinking: bool | None = None, tools=None,
             use_tqdm: bool = True) -> list:
        """Chat through deepseek-recipe: render conversations / OpenAI-style request dicts,
        generate, and return parsed `deepinfer.chat.ChatOutput`s (content, reasoning, tool calls)."""
        from deepinfer.chat import run_chat  # lazy: keeps `import deepinfer.llm` free of the recipe
        return run_chat(self, messages, sampling_params, thinking=thinking, tools=tools, use_tqdm=use_tqdm)

    def step(self, detoks: dict[str, IncrementalDetokenizer], bar: tqdm | None = None) -> None:
        """One engine step: schedule -> execute -> update -> detokenize / stop strings."""
        if self.async_loop is not None:  # schedules step N+1 before step N's update
            return self.async_loop.step(detoks, bar)
        t_start = time.perf_counter()
        self.structured.admit_ready(self.scheduler)
        with phase(SCHEDULE):
            sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out, grammar=self.structured.batch(sched_out))
        with phase(UPDATE):
            touched = self.scheduler.update(sched_out, runner_out)
            if self.runner.spec is not None:  # drafts for the next step go to running requests
                self.runner.spec.attach(self.scheduler, self.structured)  # drafts checked against grammars
        self._after_update(touched, detoks, bar)
        self.metrics.record_step(sched_out, touched, t_start)

    def _after_update(self, touched: list[Request], detoks: dict[str, IncrementalDetokenizer],
                      bar: tqdm | None) -> None:
        """Grammar advance, detokenization and stop strings for the requests an update touched."""
        for req in touched:
            if self.structured.advance(req) and not req.is_finished:  # grammar done (EOS accepted)
                self.scheduler.finish_request(req.req_id, "stop")
            detok = detoks.get(req.req_id)
            # only stop strings need the text while generating (generate() does not stream):
            # the others are detokenized once, when their output is built
            if detok is not None and not detok.finished and detok.stop:
                detok.update(req.output_token_ids[len(detok.token_ids):])
                if detok.stopped_by is not None and not req.is_finished:
                    self.scheduler.finish_request(req.req_id, "stop", stop_reason=detok.stopped_by)
            if req.is_finished and bar is not None:
                bar.update(1)

    def _output(self, prompt: str | None, req: Request, detok: IncrementalDetokenizer) -> RequestOutput:
        if not detok.finished:
            detok.update(req.output_token_ids[len(detok.token_ids):])
        detok.finish()
        sp = req.sampling_params
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 req.finished_time, req.num_prompt_tokens, req.num_cached_tokens,
                                 req.num_output_tokens, req.num_preemptions)
        return RequestOutput(
            request_id=req.req_id, prompt=prompt, prompt_token_ids=list(req.prompt_token_ids), text=detok.text,
            token_ids=list(req.output_token_ids), finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            seq_seed=sp.seq_seed, logprobs=list(req.output_logprobs) or None,
            top_logprobs=list(req.output_top_logprobs) if sp.top_logprobs else None, metrics=metrics)
