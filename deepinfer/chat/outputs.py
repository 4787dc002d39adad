"""What `LLM.chat` returns: the recipe-parsed assistant turn beside the raw engine output."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from deepinfer.outputs import RequestOutput

__all__ = ["ChatToolCall", "ChatOutput"]


@dataclass
class ChatToolCall:
    """One tool call the model made, in OpenAI Chat Completions terms.

    Attributes:
        id: the call id deepseek-recipe assigned (pass it back as ``tool_call_id``).
        name: the function name.
        arguments: the arguments as a JSON object string, exactly as the recipe built it.
    """

    id: str
    name: str
    arguments: str

    @property
    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments decoded from JSON (raises ``json.JSONDecodeError`` when malformed)."""
        return json.loads(self.arguments) if self.arguments else {}

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of an OpenAI assistant message."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ChatOutput:
    """The parsed result of one conversation.

    Attributes:
        content: the answer text (after ``</think>``, without tool-call markup).
        reasoning_content: the thinking text, or None when thinking mode was off.
        tool_calls: parsed tool calls (empty when the model called none).
        finish_reason: the protocol finish reason: ``"stop"``, ``"length"`` or ``"tool_calls"``.
        prompt: the prompt deepseek-recipe rendered for this conversation.
        output: the raw engine :class:`~deepinfer.outputs.RequestOutput` (None when the
            text was parsed without running the engine).
        message: the full assistant message dict the recipe produced (OpenAI shape).
    """

    content: str
    reasoning_content: str | None
    tool_calls: list[ChatToolCall]
    finish_reason: str | None
    prompt: str = field(default="", repr=False)
    output: RequestOutput | None = field(default=None, repr=False)
    message: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_choice(cls, choice: dict[str, Any], prompt: str = "",
                    output: RequestOutput | None = None) -> ChatOutput:
        """Build from one ``choices[i]`` entry of a recipe Chat Completions response."""
        msg = dict(choice.get("message") or {})
        calls = [ChatToolCall(c.get("id", ""), c["function"]["name"], c["function"].get("arguments", ""))
                 for c in msg.get("tool_calls") or []]
        return cls(content=msg.get("content") or "", reasoning_content=msg.get("reasoning_content"),
                   tool_calls=calls, finish_reason=choice.get("finish_reason"), prompt=prompt,
                   output=output, message=msg)

    def to_message(self) -> dict[str, Any]:
        """This turn as an assistant message to append to the history for the next turn.

        Reasoning content is kept: V4 renders it back for the latest tool-using turn.
        """
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg

    @property
    def text(self) -> str:
        """The raw generated text (before parsing); empty when no engine output is attached."""
        return self.output.text if self.output is not None else ""
