"""Token-level stop checks, run once per appended token in ``Scheduler.update``.

Stop *strings* need detokenized text and are handled by the caller through
``Scheduler.finish_request(req_id, reason="stop")``.
"""

from __future__ import annotations

from deepinfer.engine.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> tuple[RequestStatus, int | None] | None:
    """Decide whether ``request`` must stop after its last appended token.

    Returns ``(terminal_status, stop_reason)`` or ``None`` to keep going.
    ``stop_reason`` is the matched stop token id (``None`` for EOS and for
    length caps, as in vLLM).

    Order of checks (why): EOS / stop tokens first, so a request whose very
    last allowed token happens to be a stop token reports "stop", which is the
    more informative answer; both are gated by ``min_tokens``. The length caps
    are never gated: ``max_tokens`` and ``max_model_len`` are hard limits.
    The stop token itself stays in ``output_token_ids`` (the detokenizer
    decides whether to show it).
    """
    params = request.sampling_params
    last = request.all_token_ids[-1]
    num_out = request.num_output_tokens
    if num_out >= getattr(params, "min_tokens", 0):
        if (
            request.eos_token_id is not None
            and last == request.eos_token_id
            and not params.ignore_eos
        ):
            return RequestStatus.FINISHED_STOPPED, None
        if params.stop_token_ids and last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, last
    if num_out >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
