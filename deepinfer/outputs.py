"""What `LLM.generate` returns: one RequestOutput per prompt, in prompt order."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Per-request timings (time.monotonic seconds) and token counts."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    """The finished result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    seq_seed: int  # the seed actually used (drawn when the request gave none)
    logprobs: list[float] | None = None  # logprob of each output token
    top_logprobs: list[list[tuple[int, float]]] | None = None
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
