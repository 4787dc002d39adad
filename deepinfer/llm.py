"""`LLM`: offline inference over the engine, the interface DeepInfer users know.

    from deepinfer import LLM, SamplingParams
    llm = LLM()                                   # embedded default checkpoint
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

`LLM` is a thin client of one engine (``llm.engine``). One process: an
`deepinfer.engine.core.EngineCore`; the client checks a call's inputs, adds its requests,
steps the core until they finish and returns their outputs in prompt order. With
``data_parallel_size`` / ``expert_parallel_size`` > 1 the engine is
`deepinfer.parallel.dp_engine.DataParallelEngine`, a driver over one rank core per process
that runs each call on its ranks in lockstep (``generate`` hands the call to it). Either
way the engine's parts and verbs (``scheduler``, ``config``, ``placement``, ``rebalance``,
``shutdown`` ...) read and write through the client.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from deepinfer.engine.core import EngineCore
from deepinfer.engine.admission import admit_generate
from deepinfer.engine.output_processor import StreamDelta
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams


class LLM:
    """Offline generation over an engine core: model, KV cache, scheduler and runner in one process."""

    #: the engine ``data_parallel_size`` / ``expert_parallel_size`` > 1 builds: the driver over
    #: rank cores. Named, not imported: its ranks (`deepinfer.parallel.rank_engine.RankLLM`)
    #: are clients of this class, so an import here would be an import cycle, and it pulls in
    #: torch.distributed and the launcher, which a one-process engine never needs.
    multi_process_engine: str = "deepinfer.parallel.dp_engine:DataParallelEngine"

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **kwargs: object) -> None:
        self._ids = itertools.count()  # before the engine: __setattr__ would hand it to an engine with one
        #: the engine this client drives: an EngineCore, or the multi-rank driver
        self.engine: Any = self.make_core(model, tokenizer, **kwargs)

    def make_core(self, model: str | None, tokenizer: str | None, **kwargs: object) -> Any:
        """Build the engine: an EngineCore (engines with other construction steps return a
        subclass), or the multi-rank driver when more than one rank is asked for."""
        sizes = (kwargs.get("data_parallel_size", 1), kwargs.get("expert_parallel_size", 1))
        if any(isinstance(n, int) and not isinstance(n, bool) and n > 1 for n in sizes):
            module, name = self.multi_process_engine.split(":")
            return getattr(importlib.import_module(module), name)(model, tokenizer, **kwargs)
        return EngineCore(model, tokenizer, **kwargs)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Release the engine: its device memory (model, KV cache, graphs) in one process, its
        rank processes for the multi-rank driver. The LLM generates nothing afterwards."""
        self.engine.shutdown()

    # the core's parts are the client's: llm.scheduler, llm.runner, llm.config = ... (sweeps)
    def __getattr__(self, name: str) -> Any:
        engine = self.__dict__.get("engine")
        if engine is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        engine = self.__dict__.get("engine")
        if engine is not None and not hasattr(type(self), name) and name not in self.__dict__ \
                and hasattr(engine, name):
            setattr(engine, name, value)
        else:
            object.__setattr__(self, name, value)

    # ---- the main loop -----------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | Sequence[int] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.
        Every input is validated before any request is queued, so a bad one raises a
        clear InvalidRequestError and leaves the engine serving."""
        core = self.engine
        if getattr(core, "runs_whole_calls", False):  # the multi-rank driver: its ranks step in lockstep
            return core.generate(prompts, sampling_params, prompt_token_ids, use_tqdm=use_tqdm)
        core.check_open()
        # the whole call validated before anything is queued (deepinfer/engine/admission.py)
        items, params = admit_generate(core, prompts, sampling_params, prompt_token_ids)
        ids: list[str] = []
        bar = tqdm(total=len(items), desc="generate", disable=not use_tqdm)
        try:
            for (text, tokens), sp in zip(items, params):
                rid = f"req-{next(self._ids)}"
                core.add_request(rid, tokens, sp, prompt=text)
                ids.append(rid)
            while core.has_unfinished():
                bar.update(sum(1 for d in self.step() if d.finished))
        except BaseException:
            core.discard_in_flight()
            for rid in ids:  # never leave this call's requests behind in the engine
                core.abort(rid)
            raise
        finally:
            bar.close()
            core.structured.release(ids)
        return [core.output(rid) for rid in ids]

    def step(self) -> list[StreamDelta]:
        """One engine step (see `EngineCore.step`)."""
        return self.engine.step()

    def chat(self, messages, sampling_params=None, thinking: bool | None = None, tools=None,
             use_tqdm: bool = True) -> list:
        """Chat through deepseek-recipe: render conversations / OpenAI-style request dicts,
        generate, and return parsed `deepinfer.chat.ChatOutput`s (content, reasoning, tool calls)."""
        from deepinfer.chat import run_chat  # lazy: keeps `import deepinfer.llm` free of the recipe
        return run_chat(self, messages, sampling_params, thinking=thinking, tools=tools, use_tqdm=use_tqdm)
