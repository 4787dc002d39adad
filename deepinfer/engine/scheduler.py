"""Continuous-batching scheduler (vLLM v1 style, pure Python).

There is no prefill phase and no decode phase: each request only has
``num_computed_tokens`` catching up with ``len(all_token_ids)`` under a
per-step token budget. Chunked prefill, prefix caching and preemption by
recompute all fall out of that rule.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from deepinfer.engine.kv_cache_manager import HybridKVCacheManager
from deepinfer.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from deepinfer.engine.request import PLACEHOLDER_TOKEN_ID, STATUS_FOR_REASON, Request, RequestStatus
from deepinfer.engine.stop import check_stop


@dataclass
class SchedulerConfig:
    """Limits of one engine step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    #: positions past the last draft a drafter writes (MTP drafts 2..k); reserved with every sampling chunk
    num_lookahead_tokens: int = 0


class Scheduler:
    """Decides, every step, which tokens of which requests run next."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: HybridKVCacheManager) -> None:
        if kv_cache_manager.max_num_seqs < config.max_num_seqs:
            raise ValueError("the KV cache manager has fewer state slots than max_num_seqs")
        if kv_cache_manager.block_size != config.block_size:
            raise ValueError("SchedulerConfig.block_size differs from the KV cache manager's")
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        # Invariant: ``running`` is in arrival (add_request) order, so its last
        # entry is always the most recently arrived one (the preemption victim).
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # finished since the last schedule()

    # ------------------------------------------------------------ admission
    def add_request(self, request: Request) -> None:
        """Queue a request; reject one that could never run (no deadlock later)."""
        cfg, n_prompt = self.config, request.num_prompt_tokens
        if request.req_id in self.requests:
            raise ValueError(f"request {request.req_id!r} is already in the scheduler")
        if n_prompt == 0:
            raise ValueError(f"request {request.req_id!r} has an empty prompt")
        if n_prompt >= cfg.max_model_len:
            raise ValueError(
                f"request {request.req_id!r}: prompt of {n_prompt} tokens leaves no room to "
                f"generate within max_model_len={cfg.max_model_len}"
            )
        # Largest length it can reach (recompute after preemption feeds all of it).
        total = min(n_prompt + request.sampling_params.max_tokens, cfg.max_model_len)
        if not cfg.chunked_prefill and total > cfg.max_num_batched_tokens:
            raise ValueError(
                f"request {request.req_id!r} may reach {total} tokens but chunked prefill is off "
                f"and max_num_batched_tokens={cfg.max_num_batched_tokens}"
            )
        need = self.kv.max_blocks_needed(total, cfg.max_num_batched_tokens)
        for group, n in need.items():
            have = self.kv.pools[group].num_blocks
            if n > have:
                raise ValueError(
                    f"request {request.req_id!r} ({n_prompt} prompt + up to "
                    f"{total - n_prompt} new tokens) needs {n} blocks of {cfg.block_size} tokens in "
                    f"KV group {group!r}, but the whole pool has only {have}"
                )
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def finish_request(self, req_id: str, reason: str = "stop", stop_reason: int | str | None = None) -> None:
        """End a request from outside (stop string, abort). No-op if unknown/finished."""
        req = self.requests.get(req_id)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.stop_reason = stop_reason
        self._finish(req, STATUS_FOR_REASON[reason])

    def abort(self, req_id: str) -> None:
        """Cancel a request; its blocks are freed (cached ones stay hittable)."""
        self.finish_request(req_id, reason="abort")

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.monotonic()
        self.kv.free(req)
        del self.requests[req.req_id]
        self._finished_ids.append(req.req_id)

    def _preempt(self, req: Request) -> None:
        """Drop all KV of ``req``; it will recompute prompt + outputs later."""
        self.kv.free(req)
        req.draft_token_ids, req.draft_confidences = [], []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)  # first in line: it arrived before every waiter

    def _num_drafts(self, req: Request, n: int, remaining: int, budget: int) -> int:
        """Drafts to verify with this chunk: only a chunk that reaches the last known token,
        capped by the token budget, max_tokens (accepted + 1 new tokens <= what is left) and
        max_model_len (every position written stays below it)."""
        if not req.draft_token_ids or n < remaining:
            return 0
        # (async scheduling: in-flight samples count, at their optimistic number)
        left = getattr(req.sampling_params, "max_tokens", None)
        cap = min(len(req.draft_token_ids), budget - n, self.config.max_model_len - req.num_tokens_with_placeholders - 1)
        if left is not None:
            cap = min(cap, left - req.num_output_tokens - req.num_output_placeholders - 1)
        return max(0, cap)

    def _length_capped(self, req: Request) -> bool:
        """Async scheduling: in-flight samples already reach max_tokens / max_model_len, so the
        request finishes when they land; more work for it would be discarded."""
        if not req.num_output_placeholders:
            return False
        return (req.num_output_tokens + req.num_output_placeholders >= req.sampling_params.max_tokens
                or req.num_tokens_with_placeholders >= self.config.max_model_len)

    def _lookahead(self, req: Request, n: int, remaining: int, k: int) -> int:
        """Extra block room for the drafter's speculative rows, below max_model_len."""
        if not self.config.num_lookahead_tokens or n < remaining:
            return 0
        return max(0, min(self.config.num_lookahead_tokens,
                          self.config.max_model_len - req.num_tokens_with_placeholders - k))

    def _scheduled(self, req: Request, n: int, is_new: bool, num_drafts: int = 0) -> ScheduledRequest:
        start = req.num_computed_tokens
        known = req.all_token_ids[start : start + n]  # async scheduling: unknown tokens are placeholders
        return ScheduledRequest(
            req_id=req.req_id,
            token_ids=known.tolist() + [PLACEHOLDER_TOKEN_ID] * (n - len(known)) + req.draft_token_ids[:num_drafts],
            num_draft_tokens=num_drafts,
            start_pos=start,
            block_table=dict(req.block_table),  # the lists are shared: allocate_slots replaces, never mutates them
            state_slot=req.state_slot,  # type: ignore[arg-type]
            is_new=is_new,
            needs_sample=start + n == req.num_tokens_with_placeholders,  # n counts real tokens only
            sampling_params=req.sampling_params,
            output_len=req.num_output_tokens + req.num_output_placeholders,  # async: in-flight samples count
            num_prompt_tokens=req.num_prompt_tokens,
        )

    # ------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        # Invariant on return: sum of scheduled tokens <= max_num_batched_tokens;
        # len(running) <= max_num_seqs; every scheduled request's block tables
        # cover start_pos + len(token_ids) tokens in every group and it holds a
        # state slot; running keeps arrival order; a request is in exactly one
        # of running / waiting; nothing preempted in this step is scheduled in
        # it, and no waiting request is admitted in a step that preempted.
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []

        # 1. RUNNING requests first, in FCFS order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens_with_placeholders - req.num_computed_tokens
            n = min(remaining, budget)
            if remaining <= 0 or (n < remaining and not cfg.chunked_prefill) or self._length_capped(req):
                i += 1
                continue
            k = self._num_drafts(req, n, remaining, budget)  # speculative decoding: verify k drafts
            while not self.kv.allocate_slots(req, n + k + self._lookahead(req, n, remaining, k)):
                victim = self.running.pop()  # most recently arrived
                self._preempt(victim)
                out.preempted_req_ids.append(victim.req_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._scheduled(req, n, is_new=False, num_drafts=k))
                req.draft_token_ids, req.draft_confidences = [], []  # consumed: new ones come after verify
                budget -= n + k
                i += 1

        # 2. WAITING requests in FCFS order while budget, seats and blocks allow.
        while self.waiting and budget > 0 and not out.preempted_req_ids:
            if len(self.running) >= cfg.max_num_seqs:
                break
            req = self.waiting[0]
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_hit
            n = min(remaining, budget)
            if n < remaining and not cfg.chunked_prefill:
                break  # keep FCFS: it gets a fuller budget in a later step
            if not self.kv.allocate_slots(req, n + self._lookahead(req, n, remaining, 0), hit_blocks, num_hit):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n, is_new=True))
            budget -= n

        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return out

    # --------------------------------------------------------------- update
    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Apply one step's results; return requests with new tokens or that finished."""
        index = {rid: k for k, rid in enumerate(runner_output.req_ids)}
        touched: list[Request] = []
        for sched in scheduler_output.scheduled:
            req = self.requests.get(sched.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted / preempted between schedule() and update()
            k = index.get(sched.req_id)
            tokens = runner_output.sampled_token_ids[k] if k is not None else []
            # KV is valid for the fed real tokens and the ACCEPTED drafts only (vLLM v1's
            # rule: the last returned token is new, its KV comes next step). Blocks of the
            # accepted drafts are registered once their tokens are appended (below).
            accepted = min(max(0, len(tokens) - 1), sched.num_draft_tokens)
            req.num_computed_tokens += sched.num_tokens - sched.num_draft_tokens + accepted
            self.kv.cache_blocks(req)
            if bool(tokens) != sched.needs_sample:
                raise ValueError(
                    f"runner returned {len(tokens)} tokens for {sched.req_id!r} "
                    f"but needs_sample={sched.needs_sample}"
                )
            if not tokens:
                continue
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            lps = runner_output.logprobs[k] if runner_output.logprobs is not None else None
            tops = runner_output.top_logprobs[k] if runner_output.top_logprobs is not None else None
            for j, tok in enumerate(tokens):
                req.append_output_token(
                    tok, lps[j] if lps is not None else None, tops[j] if tops is not None else None
                )
                stop = check_stop(req, self.config.max_model_len)
                if stop is not None:  # tokens after a stop (speculative) are dropped
                    if accepted:
                        self.kv.cache_blocks(req)
                    req.stop_reason = stop[1]
                    self.running.remove(req)
                    self._finish(req, stop[0])
                    break
            else:
                if accepted:
                    self.kv.cache_blocks(req)
            touched.append(req)
        return touched

    # ---------------------------------------------------------------- stats
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
