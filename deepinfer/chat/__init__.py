"""Chat on top of the engine through DeepSeek's `deepseek-recipe` (adapted, not re-implemented).

    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=64), thinking=False)
    outs[0].content, outs[0].reasoning_content, outs[0].tool_calls
"""

from __future__ import annotations

from deepinfer.chat.outputs import ChatOutput, ChatToolCall
from deepinfer.chat.parse import parse_completion
from deepinfer.chat.render import ChatPrompt, render_prompt
from deepinfer.chat.requests import ChatRequest, normalise_chat_inputs
from deepinfer.chat.runner import chat_sampling_params, parse_chat_response, render_chat, run_chat

__all__ = [
    "ChatOutput",
    "ChatToolCall",
    "ChatPrompt",
    "ChatRequest",
    "normalise_chat_inputs",
    "render_prompt",
    "parse_completion",
    "chat_sampling_params",
    "render_chat",
    "parse_chat_response",
    "run_chat",
]
