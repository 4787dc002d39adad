"""One generation request as the scheduler sees it (pure Python, no torch).

The single piece of progress state is ``num_computed_tokens``: how many of
``all_token_ids`` already have their KV in the cache. The scheduler only ever
tries to make it catch up with ``len(all_token_ids)``; prefill, chunked
prefill, decode and recompute-after-preemption are all that one rule.

Prompt and all token ids are int64 ``array``s, not lists: the garbage collector walks
every element of a live list in each full collection, and a batch of long prompts held as
lists (256 x 16k ids) made every such collection cost tens of milliseconds while serving.
"""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Sequence
from typing import Any


class RequestStatus(enum.Enum):
    """Lifecycle of a request inside the scheduler."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        """True for the three terminal states."""
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason of a terminal state, else None."""
        return _FINISH_REASON.get(self)


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
#: Token id the scheduler feeds for a token an in-flight step has not returned yet (async
#: scheduling); the runner replaces it on the device, and a leftover one fails loudly.
PLACEHOLDER_TOKEN_ID = -1
#: Inverse of ``finish_reason``, used by ``Scheduler.finish_request``.
STATUS_FOR_REASON = {reason: status for status, reason in _FINISH_REASON.items()}


class Request:
    """A prompt plus everything generated for it so far.

    ``sampling_params`` is treated as opaque except for ``max_tokens``,
    ``ignore_eos``, ``stop_token_ids`` and ``min_tokens`` (read by ``stop.py``).
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Any,
        arrival_time: float | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids: array = array("q", prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time: float = time.monotonic() if arrival_time is None else arrival_time
        self.eos_token_id = eos_token_id

        self.output_token_ids: list[int] = []
        # Kept as its own list (not a property) so slicing the tokens fed to
        # a step is O(chunk), not O(prompt + outputs) per step.
        self.all_token_ids: array = array("q", self.prompt_token_ids)
        # Per sampled token, filled only when the runner returns logprobs.
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission
        self.num_preemptions = 0

        # Owned by HybridKVCacheManager: per-group physical block ids (-1 for
        # window blocks that are not held), the compressor state slot, and the
        # chained hashes of full blocks (kept across preemption: tokens never
        # change, so the hashes never do).
        self.block_table: dict[str, list[int]] = {}
        self.state_slot: int | None = None
        self.block_hashes: list[bytes] = []
        # Speculative decoding (deepinfer/spec): draft tokens proposed after the last step,
        # verified in the next one; never outputs until accepted. Confidences, when the
        # drafter has them, are survival probabilities per draft (confidence scheduling).
        self.draft_token_ids: list[int] = []
        self.draft_confidences: list[float] = []
        # Async scheduling (deepinfer/engine/async_engine.py): tokens sampled by steps still
        # in flight. They are never in all_token_ids / output_token_ids; the scheduler
        # feeds PLACEHOLDER_TOKEN_ID for them and the runner gathers the real id on the device.
        self.num_output_placeholders = 0

        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # ------------------------------------------------------------------ views
    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those still being sampled by in-flight steps (async scheduling)."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort" once finished, else None."""
        return self.status.finish_reason

    # --------------------------------------------------------------- mutation
    def append_output_token(
        self,
        token_id: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> None:
        """Record one sampled token (and its logprobs when the runner sent them)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
