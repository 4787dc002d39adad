"""The two narrow contracts between the CPU scheduler and the device runner.

Plain dataclasses only: nothing here knows about tensors, so the scheduler
can be tested on CPU with hand-made ``ModelRunnerOutput`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        req_id: the request id.
        token_ids: the tokens fed this step (``len`` = tokens scheduled); they
            occupy positions ``start_pos .. start_pos + len(token_ids) - 1``.
        start_pos: ``num_computed_tokens`` before this step; KV for positions
            ``< start_pos`` is already in the cache (from earlier steps or a
            prefix-cache hit).
        block_table: per-group physical block ids (a private copy). Block ``i``
            covers token positions ``[i*B, (i+1)*B)`` in every group; ``-1``
            marks window-group blocks that are not held (fell out of the
            window, or were never needed after a prefix hit).
        state_slot: the request's compressor-state slot, ``0 <= slot < max_num_seqs``.
        is_new: first chunk since (re)admission: the runner must reset the
            state slot and, if ``start_pos > 0``, restore it from the cache.
        needs_sample: this chunk ends at the last known token, so the runner
            samples one token (more with speculative decoding).
        sampling_params: the request's SamplingParams (opaque here).
        output_len: tokens generated so far (before this step).
        num_prompt_tokens: the request's prompt length (V4.1 bounded replay keeps the
            decoder layers' prefill to the last ``keep`` prompt positions).
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_table: dict[str, list[int]]
    state_slot: int
    is_new: bool
    needs_sample: bool
    sampling_params: Any
    output_len: int
    num_prompt_tokens: int = 0
    #: speculative decoding: the last ``num_draft_tokens`` of ``token_ids`` are drafts to
    #: verify (``needs_sample`` is then True); the runner returns 1..num_draft_tokens + 1 tokens.
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled for this request in this step."""
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What to run in one step.

    ``preempted_req_ids`` and ``finished_req_ids`` tell the runner which
    per-request device state (e.g. persistent batch rows) to drop; a preempted
    request comes back later as ``is_new=True``.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to run (the runner can skip the step)."""
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """What the runner produced for one step.

    ``sampled_token_ids[i]`` belongs to ``req_ids[i]``; it is ``[]`` for a
    request whose chunk did not need a sample (partial prefill) and holds one
    or more tokens otherwise (several with speculative decoding).
    ``logprobs[i][j]`` is the logprob of ``sampled_token_ids[i][j]``;
    ``top_logprobs[i][j]`` the ``(token_id, logprob)`` alternatives for it.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
