"""Request inputs shared by the single-process and data-parallel engines."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.errors import InvalidRequestError
from deepinfer.sampling_params import SamplingParams


def expand_sampling_params(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                           n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt from None (defaults), one shared object, or a list of n."""
    if sampling_params is None:
        params = [SamplingParams() for _ in range(n)]
    elif isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * n
    else:
        params = list(sampling_params)
        if len(params) != n:
            raise InvalidRequestError(
                f"got {len(params)} sampling_params for {n} prompts; pass one or one per prompt")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidRequestError("sampling_params must be SamplingParams objects")
    return params
