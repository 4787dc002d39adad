"""`LLM.chat`: recipe-rendered prompts -> engine -> recipe-parsed turns.

Sampling settings, by precedence (highest first):

1. settings the request dict spells out (``max_tokens``, ``temperature``, ``top_p``,
   ``seed``, ``top_logprobs``, ``stop``), as deepseek-recipe resolved them (thinking
   mode pins temperature to 1.0, as DeepSeek's API does);
2. the ``sampling_params`` argument;
3. the recipe's defaults for the model version (temperature, top_p, and ``max_tokens``
   from ``resolve_max_tokens``: 8192 without thinking, 65536 with it, capped by context).

Request stop sequences apply to the answer only. Without thinking the engine stops on
them (and drops them, as the recipe would); with thinking the engine cannot tell
reasoning from answer, so generation runs on and the recipe cuts the answer when parsing.

Not enforced yet: the recipe's ``inference_options.output_constraint`` (``response_format``
JSON / regex, required tool calls). Wiring it to structured output needs the grammar to
start after ``</think>`` in thinking mode; until then the output is parsed, not constrained.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import deepseek_recipe as dr

from deepinfer.chat.outputs import ChatOutput
from deepinfer.chat.parse import parse_completion
from deepinfer.chat.render import ChatPrompt, render_prompt
from deepinfer.chat.requests import ChatRequest, normalise_chat_inputs
from deepinfer.errors import InvalidRequestError
from deepinfer.sampling_params import SamplingParams

# `llm` is a deepinfer.llm.LLM; not imported, not even for type checking: deepinfer.llm builds this module's
# objects, and an import back would close an import cycle (tests/test_import_cycles.py)

__all__ = ["run_chat", "render_chat", "parse_chat_response", "chat_sampling_params", "replace_sampling_params"]


def replace_sampling_params(params: SamplingParams, **changes: Any) -> SamplingParams:
    """``dataclasses.replace`` that re-validates, and lets a structured-output spec given
    through ``so_args`` be derived again rather than passed twice (which is rejected)."""
    if params.so_args is not None and "structured_output" not in changes:
        changes["structured_output"] = None
    return dataclasses.replace(params, **changes)


def chat_sampling_params(req: ChatRequest, base: SamplingParams | None, num_prompt_tokens: int,
                         max_model_len: int) -> SamplingParams:
    """The engine SamplingParams for one converted request (precedence in the module doc)."""
    conv, opts = req.converted, req.converted.inference_options
    # None = a recipe request object: only settings the recipe leaves unset-able count as explicit
    keys = req.explicit_keys
    said = (lambda k: keys is not None and k in keys)
    over: dict[str, Any] = {}
    if base is None or said("temperature"):
        over["temperature"] = float(opts.temperature if opts.temperature is not None else 1.0)
    if base is None or said("top_p"):
        over["top_p"] = float(opts.top_p if opts.top_p is not None else 1.0)
    if base is None or opts.max_tokens is not None:
        try:
            over["max_tokens"] = int(conv.resolve_max_tokens(num_prompt_tokens, max_model_len))
        except dr.ConversionError as err:
            raise InvalidRequestError(f"chat request {req.index}: {err}", field="max_tokens") from None
    if opts.seed is not None:
        over["seq_seed"] = int(opts.seed)
    if opts.logprobs and opts.top_logprobs:
        over["top_logprobs"] = int(opts.top_logprobs)
    stops = list(conv.parsing_options.stop_sequences)
    if stops and not req.thinking:
        current = base.stop if base is not None else []
        over["stop"] = list(dict.fromkeys([*current, *stops]))
    try:
        return replace_sampling_params(base if base is not None else SamplingParams(), **over)
    except InvalidRequestError as err:
        raise InvalidRequestError(f"chat request {req.index}: {err}", field=err.field) from None


def render_chat(messages: Any, model_type: str = "deepseek_v4", thinking: bool | None = None,
                tools: Sequence[dict[str, Any]] | None = None, tokenizer: Any = None) -> list[ChatPrompt]:
    """Render conversations to prompts without an engine (inspect what the model will see)."""
    return [render_prompt(r.converted, tokenizer)
            for r in normalise_chat_inputs(messages, model_type, thinking, tools)]


def parse_chat_response(text: str, messages: Any, model_type: str = "deepseek_v4",
                        thinking: bool | None = None, tools: Sequence[dict[str, Any]] | None = None,
                        finish_reason: str = "stop") -> ChatOutput:
    """Parse a completion ``text`` of one conversation (thinking, tool calls, stop sequences)."""
    reqs = normalise_chat_inputs(messages, model_type, thinking, tools)
    if len(reqs) != 1:
        raise InvalidRequestError(f"parse_chat_response takes one conversation, got {len(reqs)}",
                                  field="messages")
    return parse_completion(reqs[0].converted, text, finish_reason)


def run_chat(llm: Any, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             thinking: bool | None = None, tools: Sequence[dict[str, Any]] | None = None,
             use_tqdm: bool = True) -> list[ChatOutput]:
    """Render each conversation with deepseek-recipe, generate, and parse each output.

    Args:
        llm: the engine.
        messages: one conversation, a list of them, or request dicts (see ``deepinfer.chat.requests``).
        sampling_params: one for all conversations or one per conversation; None uses the
            recipe's defaults.
        thinking: force thinking on/off; None keeps each request's choice (default on).
        tools: tool definitions for conversations that declare none.
        use_tqdm: show the generate progress bar.

    Returns:
        One ChatOutput per conversation, in input order.
    """
    reqs = normalise_chat_inputs(messages, llm.model_config.model_type, thinking, tools)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        bases = [sampling_params] * len(reqs)
    else:
        bases = list(sampling_params)
        if len(bases) != len(reqs):
            raise InvalidRequestError(f"got {len(bases)} sampling_params for {len(reqs)} conversations; "
                                      "pass one or one per conversation", field="sampling_params")
    if not all(b is None or isinstance(b, SamplingParams) for b in bases):
        raise InvalidRequestError("sampling_params must be SamplingParams objects", field="sampling_params")
    prompts = [render_prompt(r.converted, llm.tokenizer) for r in reqs]
    params = [chat_sampling_params(r, b, len(p.token_ids), llm.config.max_model_len)
              for r, b, p in zip(reqs, bases, prompts)]
    outputs = llm.generate(prompt_token_ids=[p.token_ids for p in prompts], sampling_params=params,
                           use_tqdm=use_tqdm)
    results = []
    for req, prompt, out in zip(reqs, prompts, outputs):
        out.prompt = prompt.prompt  # generate() got ids; keep the text for whoever reads the output
        results.append(parse_completion(req.converted, out.text, out.finish_reason, len(out.token_ids),
                                        len(out.prompt_token_ids), prompt.prompt, out))
    return results
