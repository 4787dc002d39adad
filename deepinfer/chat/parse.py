"""Parse generated text into a chat turn with deepseek-recipe's stream processor.

The recipe's processor is built for streaming; offline we feed the whole text as one
chunk and accumulate its Chat Completions chunks into a response. It splits thinking
from the answer, turns DSML tool-call markup into OpenAI ``tool_calls``, and applies the
request's stop sequences to the answer (not to the thinking, which is the API's rule).
"""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe as dr

from deepinfer.chat.outputs import ChatOutput
from deepinfer.outputs import RequestOutput

__all__ = ["parse_completion"]

# engine finish reason -> the recipe's backend finish reason; an abort has no protocol
# equivalent, so it parses like a stop and keeps "abort" on the raw RequestOutput.
_FINISH = {"length": dr.InferenceFinishReason.Length, "stop": dr.InferenceFinishReason.Stop,
           "abort": dr.InferenceFinishReason.Stop, None: dr.InferenceFinishReason.Stop}


def parse_completion(converted: Any, text: str, finish_reason: str | None = "stop",
                     num_output_tokens: int = 0, num_prompt_tokens: int = 0, prompt: str = "",
                     output: RequestOutput | None = None) -> ChatOutput:
    """Parse one completion of ``converted`` (a recipe ``ConversationRequest``).

    Args:
        text: the detokenized output (special tokens such as EOS already dropped).
        finish_reason: the engine's ``"stop"`` | ``"length"`` | ``"abort"``.
        num_output_tokens / num_prompt_tokens: usage numbers for the recipe's accounting.
        prompt / output: attached unchanged to the returned ChatOutput.
    """
    if finish_reason not in _FINISH:
        raise ValueError(f"finish_reason must be one of {sorted(k for k in _FINISH if k)} or None, "
                         f"got {finish_reason!r}")
    rid = output.request_id if output is not None else "chat"
    generator = dr.ChatCompletionRequest.chunk_generator(converted, rid, "deepinfer")
    processor = dr.StreamProcessor(generator, converted.parsing_options, None)
    response = dr.ChatCompletionResponse(rid, "deepinfer", 0, num_prompt_tokens, 0)
    chunks = processor.push(dr.InferenceChunk.ready(
        prompt_usage=dr.PromptUsage(prompt_tokens=num_prompt_tokens)))
    if text:
        chunks += processor.push(dr.InferenceChunk.text(text, num_output_tokens))
    # a stop sequence in the answer finishes the processor early; pushing more would raise
    if not processor.finished:
        chunks += processor.push(dr.InferenceChunk.finish(_FINISH[finish_reason]))
    chunks += processor.finish()
    for chunk in chunks:
        response.accumulate(chunk)
    choice = json.loads(response.to_json())["choices"][0]
    return ChatOutput.from_choice(choice, prompt=prompt, output=output)
