"""The engine's structured-output front: admission, compilation, masks, matchers.

How a constrained request flows through ``LLM.generate`` / ``LLM.step``:

1. ``check(params)`` at admission, before anything is queued: the spec is checked
   and parsed (``compiler.py``); a bad one raises ``InvalidRequestError`` naming
   the request index and the problem.
2. ``add(req)``: compilation is submitted to the worker pool; the request waits
   *here*, outside the scheduler, so the scheduler never sees a request it
   cannot run.
3. ``admit_ready(scheduler)`` at the top of every step moves requests whose
   grammar is compiled into the scheduler. It blocks only when there is nothing
   else to run (then waiting is all the engine can do), so a slow grammar never
   stalls other requests.
4. ``batch(sched_out)`` gives the runner the constrained rows of the step
   (requests that sample and whose grammar is active); the runner applies the
   bitmask before sampling.
5. ``advance(req)`` after ``Scheduler.update`` feeds the new tokens to the
   matcher; it returns True when the grammar terminated (EOS accepted), which
   the engine reports as finish_reason "stop". A request that hits max_tokens
   first finishes "length" in the scheduler: incomplete output is never "stop".
6. Speculative decoding: ``valid_draft_prefix(req, drafts)`` truncates drafts at
   the first token the grammar rejects (``deepinfer/spec/runner.py`` attach), and
   the batch masks every verify row with the grammar state after the drafts
   before it (``StructuredOutputBatch.apply_verify``). Drafts never move a
   matcher: only the accepted tokens do, through ``advance``.

Async scheduling (deepinfer/engine/async_engine.py): ``advance`` only ever sees real
sampled tokens (it reads ``req.output_token_ids`` after ``update``). A constrained
request's step N+1 mask depends on step N's token, so the async loop launches N+1's
forward, then applies N (``advance``) and only then calls ``batch`` for N+1's
sampling: the bitmask is never filled from a placeholder.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.errors import InvalidRequestError
from deepinfer.structured.batch import BitmaskBuffers, MaskStats, StructuredOutputBatch
from deepinfer.structured.compiler import GrammarCompilerPool, clean_xgrammar_error
from deepinfer.structured.matcher import RequestGrammar
from deepinfer.structured.spec import StructuredOutputSpec

if TYPE_CHECKING:
    from deepinfer.engine.outputs import SchedulerOutput
    from deepinfer.engine.request import Request
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.tokenizer import Tokenizer

__all__ = ["StructuredOutputManager"]


class StructuredOutputManager:
    """Owns the compiler pool, the pending requests and every live matcher."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int, device: torch.device | str,
                 max_rows: int = 64, max_workers: int = 2) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self.device, self.max_rows, self.max_workers = torch.device(device), max_rows, max_workers
        self._pool: GrammarCompilerPool | None = None  # built on first use: xgrammar + vocab table ~1-2 s
        self._buffers: BitmaskBuffers | None = None
        self.pending: dict[str, tuple[Request, Future]] = {}
        self.grammars: dict[str, RequestGrammar] = {}
        self.stats = MaskStats()

    @property
    def pool(self) -> GrammarCompilerPool:
        if self._pool is None:
            from deepinfer.structured.llg_backend import build_llg_tokenizer
            from deepinfer.structured.vocab import build_tokenizer_info, token_bytes

            table = token_bytes(self.tokenizer, self.vocab_size)
            info = build_tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_id, table)

            def llg_tokenizer() -> Any:  # built only when a schema needs llguidance
                return build_llg_tokenizer(table, self.eos_token_id,
                                           lambda text: self.tokenizer.encode(text, add_bos=False))

            self._pool = GrammarCompilerPool(info, max_workers=self.max_workers, llg_tokenizer=llg_tokenizer)
            self._buffers = BitmaskBuffers(self.vocab_size, self.device, self.max_rows)
        return self._pool

    def shutdown(self) -> None:
        """Stop the grammar workers (their queued compilations are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown()

    # ----------------------------------------------------------- admission
    def trigger_ids(self, spec: StructuredOutputSpec) -> tuple[int, ...] | None:
        """The trigger as token ids (a text trigger is tokenized without BOS)."""
        if spec.trigger is None or isinstance(spec.trigger, tuple):
            return spec.trigger  # type: ignore[return-value]
        return tuple(self.tokenizer.encode(spec.trigger, add_bos=False))

    def check(self, params: Sequence[Any]) -> None:
        """Raise InvalidRequestError for the first request whose spec is unusable."""
        for i, sp in enumerate(params):
            spec = sp.structured_output
            if spec is None:
                continue
            try:
                self.pool.check(spec)
                ids = self.trigger_ids(spec)
                if ids is not None and (not ids or any(not 0 <= t < self.vocab_size for t in ids)):
                    raise InvalidRequestError(f"SamplingParams.structured_output: trigger {spec.trigger!r} "
                                              f"gives token ids {ids}, not a sequence of ids in "
                                              f"[0, {self.vocab_size})", field="structured_output")
            except InvalidRequestError as e:
                raise InvalidRequestError(f"sampling_params[{i}]: {e}", field=e.field) from None

    def add(self, req: Request) -> None:
        """Start compiling ``req``'s grammar; the request joins the scheduler when it is done."""
        self.pending[req.req_id] = (req, self.pool.submit(req.sampling_params.structured_output))

    def has_pending(self) -> bool:
        return bool(self.pending)

    def admit_ready(self, scheduler: Scheduler) -> None:
        """Move requests with a compiled grammar into the scheduler (FIFO among them)."""
        if not self.pending:
            return
        if not scheduler.has_unfinished():  # nothing else to run: waiting is all we can do
            wait([f for _, f in self.pending.values()], return_when=FIRST_COMPLETED)
        for req_id, (req, fut) in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[req_id]
            error = fut.exception()
            if error is not None:
                raise InvalidRequestError(f"request {req_id}: SamplingParams.structured_output: grammar "
                                          f"compilation failed: {clean_xgrammar_error(error)}",
                                          field="structured_output")
            spec = req.sampling_params.structured_output
            self.grammars[req_id] = RequestGrammar(fut.result(), self.trigger_ids(spec))
            scheduler.add_request(req)

    # ------------------------------------------------------------ stepping
    def batch(self, sched_out: SchedulerOutput) -> StructuredOutputBatch | None:
        """Constrained rows of this step, or None when no sampled row is constrained."""
        active = {}
        for r in sched_out.scheduled:
            g = self.grammars.get(r.req_id)
            # drafts may complete a trigger: such a request's later verify rows are masked
            if r.needs_sample and g is not None and (g.active or r.num_draft_tokens):
                active[r.req_id] = g
        if not active:
            return None
        assert self._buffers is not None
        return StructuredOutputBatch(active, self._buffers, self.stats)

    def advance(self, req: Request) -> bool:
        """Feed ``req``'s new output tokens to its matcher; True if the grammar terminated."""
        g = self.grammars.get(req.req_id)
        if g is None:
            return False
        g.advance(req.output_token_ids)
        terminated = g.is_terminated
        if terminated or req.is_finished:
            del self.grammars[req.req_id]
        return terminated

    def valid_draft_prefix(self, req: Request, drafts: Sequence[int]) -> int | None:
        """How many leading speculative ``drafts`` of ``req`` its grammar accepts after its
        output so far (None: the request is unconstrained). The matcher first consumes any
        output tokens it has not seen; the drafts leave it unchanged."""
        g = self.grammars.get(req.req_id)
        if g is None:  # a constrained request without a live grammar gets no drafts
            return None if req.sampling_params.structured_output is None else 0
        g.advance(req.output_token_ids)
        return g.valid_prefix(drafts)

    def rollback(self, req: Request, num_tokens: int) -> None:
        """Undo the matcher's last ``num_tokens`` tokens."""
        self.grammars[req.req_id].rollback(num_tokens)

    def release(self, req_ids: Sequence[str]) -> None:
        """Drop pending requests and matchers of these ids (abort / end of generate)."""
        for rid in req_ids:
            # the future is not cancelled: other requests with an equal spec may share it
            self.pending.pop(rid, None)
            self.grammars.pop(rid, None)
