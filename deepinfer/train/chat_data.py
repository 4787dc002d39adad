"""Synthetic chat samples rendered exactly as ``LLM.chat`` renders prompts, plus the reply the model learns.

A :class:`ChatSample` is a conversation that ends with a user (or tool) message and the
assistant reply it should get. The prompt part goes through the engine's own path
(:func:`deepinfer.chat.requests.normalise_chat_inputs` for ``model_type`` ``deepseek_v4``, then
deepseek-recipe's V4 encoding), so the trained model sees at training time the bytes it sees
at inference. The reply is written in the generation format the recipe's parser reads back:
``reasoning</think>answer`` after a thinking prompt (which ends with ``<think>``), ``answer``
after a non-thinking one (ends with ``</think>``), then EOS. The answer and DSML tool-call
markup are taken from the recipe's own rendering of that assistant message, and every
rendered sample is parsed back with the recipe (:func:`check_sample`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import deepseek_recipe as dr

from deepinfer.chat.parse import parse_completion
from deepinfer.chat.requests import normalise_chat_inputs

__all__ = ["ChatSample", "make_sample", "render_sample", "check_sample", "SYSTEM_PROMPTS",
           "THINK_START", "THINK_END", "EOS", "ASSISTANT"]

MODEL_TYPE = "deepseek_v4"
THINK_START = dr.SpecialToken.ThinkingStart.default_str()
THINK_END = dr.SpecialToken.ThinkingEnd.default_str()
EOS = dr.SpecialToken.Eos.default_str()
ASSISTANT = dr.SpecialToken.Assistant.default_str()

SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a concise assistant. Answer briefly.",
                  "You are deepinfer-tiny, a small demo model. Be accurate and short.",
                  "You are a friendly tutor who explains each step.")
# reasoning_effort for thinking samples: None renders the recipe's default (long) effort
# preamble, "low" renders none, "max" the strongest one; LLM.chat users send all three.
_EFFORTS = (None, None, "low", "low", "max")


@dataclass
class ChatSample:
    """One conversation and the assistant reply to learn.

    Attributes:
        task: generator name (e.g. ``"math.change"``), recorded in the document id.
        messages: Chat Completions messages, ending with a ``user`` or ``tool`` message.
        content: the reply's answer text.
        reasoning: the reply's thinking (used only when ``thinking``).
        tool_calls: ``[{"name": str, "arguments": dict}]`` the reply makes, if any.
        thinking / effort / tools / json_mode: request settings.
    """

    task: str
    messages: list[dict[str, Any]]
    content: str
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    thinking: bool = True
    effort: str | None = None
    tools: list[dict[str, Any]] | None = None
    json_mode: bool = False


def make_sample(rng: random.Random, task: str, messages: list[dict[str, Any]], reasoning: str,
                short_answer: str, worked_answer: str, system_p: float = 0.3, **kw: Any) -> ChatSample:
    """A sample in thinking mode (reasoning, then the short answer) or not (the worked answer).

    Draws the mode, the effort and an optional system prompt from ``rng`` so every task mixes
    them the same way.
    """
    thinking = rng.random() < 0.5
    if rng.random() < system_p and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + messages
    return ChatSample(task, messages, short_answer if thinking else worked_answer, reasoning,
                      thinking=thinking, effort=rng.choice(_EFFORTS) if thinking else None, **kw)


def _body(sample: ChatSample, messages: list[dict[str, Any]], thinking: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "thinking": {"type": "enabled" if thinking else "disabled"}}
    if sample.tools:
        body["tools"] = sample.tools
    if sample.effort is not None:
        body["reasoning_effort"] = sample.effort
    if sample.json_mode:
        body["response_format"] = {"type": "json_object"}
    return body


def _converted(body: dict[str, Any]) -> Any:
    return normalise_chat_inputs([body], MODEL_TYPE)[0].converted


def _openai_calls(sample: ChatSample) -> list[dict[str, Any]]:
    return [{"id": f"call_{i}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for i, c in enumerate(sample.tool_calls)]


def _answer_markup(sample: ChatSample) -> str:
    """The recipe's spelling of the reply's answer + tool calls (between the think end and EOS)."""
    reply: dict[str, Any] = {"role": "assistant", "content": sample.content}
    follow: list[dict[str, Any]] = []
    if sample.tool_calls:
        reply["tool_calls"] = _openai_calls(sample)
        follow = [{"role": "tool", "tool_call_id": c["id"], "content": "."} for c in reply["tool_calls"]]
    probe = ChatSample(sample.task, [], "", tools=sample.tools)
    text = dr.DeepseekV4Encoding().render_conversation(
        _converted(_body(probe, [{"role": "user", "content": "."}, reply] + follow, False)).conversation).prompt
    start = text.index(ASSISTANT + THINK_END) + len(ASSISTANT + THINK_END)
    return text[start:text.index(EOS, start)]


def render_sample(sample: ChatSample) -> tuple[str, str]:
    """(prompt, reply): the prompt as LLM.chat renders it and the generation that should follow."""
    converted = _converted(_body(sample, sample.messages, sample.thinking))
    prompt = dr.DeepseekV4Encoding().render_conversation(converted.conversation).prompt
    opening = ASSISTANT + (THINK_START if sample.thinking else THINK_END)
    if not prompt.endswith(opening):
        raise ValueError(f"{sample.task}: the rendered prompt ends with {prompt[-40:]!r}, expected {opening!r}")
    reasoning = sample.reasoning + THINK_END if sample.thinking else ""
    return prompt, reasoning + _answer_markup(sample) + EOS


def check_sample(sample: ChatSample, reply: str) -> None:
    """Parse ``reply`` with the recipe (as LLM.chat does) and require the intended message back."""
    converted = _converted(_body(sample, sample.messages, sample.thinking))
    out = parse_completion(converted, reply.removesuffix(EOS))
    want_calls = [(c["name"], c["arguments"]) for c in sample.tool_calls]
    got_calls = [(c.name, json.loads(c.arguments)) for c in (out.tool_calls or [])]
    want_reasoning = sample.reasoning if sample.thinking else None
    if (out.content or "") != sample.content or got_calls != want_calls or \
            (out.reasoning_content or None) != (want_reasoning or None):
        raise ValueError(f"{sample.task}: the recipe parses the reply as content={out.content!r}, "
                         f"reasoning={out.reasoning_content!r}, tool_calls={got_calls!r}; intended "
                         f"content={sample.content!r}, reasoning={want_reasoning!r}, tool_calls={want_calls!r}")
