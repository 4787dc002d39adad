"""Admission without the engine: what the API process of `deepinfer serve` checks itself.

With the process engine client (deepinfer/engine/process_client.py) every request used to
cross to the engine process and back to be admitted, then cross again to be added: three
pipe hops before its prefill could start, and the checks (tokenizing a text prompt,
validating its ids) ran on the engine process's GIL beside the step loop that keeps the GPU
fed. A burst of requests (a new wave under load) paid that once per request there.

`AdmissionView` holds what `admit_generate` reads of an engine, as a picklable snapshot
the engine process sends once at start-up: its config, the model config and its KV cache's
geometry (`KVFit`); the API process adds its own tokenizer. Requests with structured
output still go to the engine (it compiles the grammar and keeps the compiled result for
its own matcher), and so does anything the view refuses, so that its error reads exactly as
the engine's does. The checks themselves are `admit_generate`'s: one code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.admission import admit_generate
from deepinfer.engine.kv_cache_manager import KVFit
from deepinfer.errors import InvalidRequestError
from deepinfer.sampling_params import SamplingParams

__all__ = ["AdmissionView", "admit_locally"]


@dataclass
class AdmissionView:
    """What admission reads of an engine (``admit_generate(view, ...)`` runs unchanged on it)."""

    config: Any  # EngineConfig
    model_config: Any
    kv_fit: KVFit
    tokenizer: Any = field(default=None, repr=False)  # the receiving side's own (not pickled with it)
    structured: None = None  # grammars: the engine's admission

    @classmethod
    def of(cls, core: Any) -> "AdmissionView":
        """The view of an EngineCore now (after start-up: speculation widens windows then)."""
        return cls(core.config, core.model_config, core.scheduler.kv.fit)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "tokenizer": None}


def admit_locally(view: AdmissionView, prompt: str | None, ids: list[int] | None,
                  params: list[SamplingParams]) -> tuple[list[int], list[SamplingParams]] | None:
    """``admit_generate`` of ``len(params)`` choices of one prompt against ``view``: (prompt
    ids, resolved params); None when the engine has to decide (structured output, or a
    request the view refuses: the engine's admission then gives the error)."""
    if view.tokenizer is None or any(sp.structured_output is not None for sp in params):
        return None
    kwargs = ({"prompts": [prompt] * len(params), "prompt_token_ids": None} if prompt is not None
              else {"prompts": None, "prompt_token_ids": [ids] * len(params)})
    try:
        items, checked = admit_generate(view, sampling_params=params, **kwargs)
    except InvalidRequestError:
        return None
    return items[0][1], checked
