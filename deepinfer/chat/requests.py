"""Turn what a user hands `LLM.chat` into deepseek-recipe `ConversationRequest` objects.

Accepted inputs (see :func:`normalise_chat_inputs`):

* one conversation: a list of message dicts ``[{"role": ..., "content": ...}, ...]``;
* many conversations: a list of such lists;
* OpenAI-style request dicts: Chat Completions (``{"messages": [...], "tools": ..., ...}``)
  or Responses (``{"input": ...}``), alone or in a list;
* the recipe's own request objects (``ChatCompletionRequest``, ``ResponsesRequest``,
  ``MessagesRequest``), which is how an Anthropic Messages body comes in unambiguously.

All protocol knowledge (validation, defaults, templates) stays in deepseek-recipe; this
module only checks the container shapes so errors can name the exact field, and points
the request at the model version the engine actually serves.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import deepseek_recipe as dr

from deepinfer.errors import InvalidRequestError

__all__ = ["ChatRequest", "normalise_chat_inputs", "model_version_for", "ROLES"]

#: Roles the recipe understands; checked here so the error names ``messages[i].role``.
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool", "latest_reminder")
#: model_type in config.json -> (recipe model version, the canonical API model name).
_VERSIONS: dict[str, tuple[Any, str]] = {
    "deepseek_v4": (dr.ModelVersion.DeepseekV4Pro, "DeepSeek-V4-Pro"),  # V4 prompt encoding
    "deepseek_v41": (dr.ModelVersion.DeepseekV41Flash, "DeepSeek-V4.1-Flash"),
}
_RECIPE_REQUESTS = (dr.ChatCompletionRequest, dr.ResponsesRequest, dr.MessagesRequest)


def model_version_for(model_type: str) -> tuple[Any, str]:
    """The recipe ``ModelVersion`` and API model name for a checkpoint's ``model_type``."""
    try:
        return _VERSIONS[model_type]
    except KeyError:
        raise InvalidRequestError(f"chat templates exist for model_type in {sorted(_VERSIONS)}, "
                                  f"got {model_type!r}", field="model_type") from None


@dataclass
class ChatRequest:
    """One conversation, converted by deepseek-recipe.

    Attributes:
        index: position in the user's input (used in error messages).
        converted: the recipe ``ConversationRequest`` (conversation, inference and parsing options).
        explicit_keys: top-level keys the user's body set (None for recipe request objects,
            whose body we cannot see); decides which request settings override SamplingParams.
    """

    index: int
    converted: Any
    explicit_keys: frozenset[str] | None

    @property
    def thinking(self) -> bool:
        return bool(self.converted.conversation.thinking_mode)


def _field_of(message: str) -> str | None:
    """Best guess at the field a recipe error message is about (for ``InvalidRequestError.field``)."""
    for pattern in (r"missing field `([^`]+)`", r"unknown field `([^`]+)`", r"[Ii]nvalid (\w+) value"):
        m = re.search(pattern, message)
        if m:
            return m.group(1)
    return None


def _recipe_error(index: int, kind: str, err: Exception) -> InvalidRequestError:
    message = str(err)
    param = None
    body = getattr(err, "body", None)
    if body:  # ConversionError carries an OpenAI error body whose "param" names the field
        try:
            param = json.loads(body).get("error", {}).get("param")
        except (ValueError, AttributeError):
            param = None
    field = param or _field_of(message)
    return InvalidRequestError(f"chat request {index} ({kind}): {message}", field=field)


def _normalise_tools(tools: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI function tools; a bare ``{"name", "parameters"}`` dict is wrapped for convenience."""
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError(f"{where} must be a list of tool dicts, got {type(tools).__name__}",
                                  field="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"{where}[{i}] must be a dict, got {type(tool).__name__}", field="tools")
        if "type" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}
        out.append(tool)
    return out


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(f"{where} must be a non-empty list of message dicts", field="messages")
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"{where}[{j}] must be a dict with 'role' and 'content', "
                                      f"got {type(msg).__name__}", field="messages")
        if msg.get("role") not in ROLES:
            raise InvalidRequestError(f"{where}[{j}].role must be one of {list(ROLES)}, "
                                      f"got {msg.get('role')!r}", field="role")


def _split_inputs(messages: Any) -> list[Any]:
    """One item per conversation: a message list, a request dict or a recipe request object."""
    if isinstance(messages, dict) or isinstance(messages, _RECIPE_REQUESTS):
        return [messages]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("chat(messages=...) must be a non-empty conversation (list of message "
                                  "dicts), a list of conversations, or request dicts; got "
                                  f"{messages!r:.80}", field="messages")
    if isinstance(messages[0], dict) and not {"messages", "input"} & messages[0].keys():
        return [list(messages)]  # a single conversation (its messages are checked later)
    return list(messages)


def normalise_chat_inputs(messages: Any, model_type: str, thinking: bool | None = None,
                          tools: Sequence[dict[str, Any]] | None = None) -> list[ChatRequest]:
    """Convert every conversation with deepseek-recipe, for the model version the engine serves.

    Args:
        messages: see the module docstring for the accepted shapes.
        model_type: the checkpoint's ``model_type``; picks the V4 or V4.1 template. The
            request's own ``model`` name is accepted as an alias of that version.
        thinking: force thinking mode on/off; None keeps the request's choice (recipe
            default: on). For non-Chat-Completions bodies it sets the default only.
        tools: tool definitions for conversations that do not declare their own.

    Raises:
        InvalidRequestError: naming the request index and the field at fault.
    """
    if thinking is not None and not isinstance(thinking, bool):
        raise InvalidRequestError(f"chat(thinking=...) must be None, True or False, got {thinking!r}",
                                  field="thinking")
    tool_list = _normalise_tools(tools, "tools") if tools is not None else None
    version, canonical = model_version_for(model_type)
    base_options = dr.ConversionOptions() if thinking is None else dr.ConversionOptions(
        default_thinking_mode=thinking)
    out = []
    for i, item in enumerate(_split_inputs(messages)):
        kind, make, explicit = _prepare(i, item, canonical, thinking, tool_list)
        try:
            request = make()  # the recipe parses the body here, so body errors surface here
            name = request.model
            options = base_options.with_model_alias(name, version) if name else base_options
            converted = request.convert(options)
        except (dr.ConversionError, ValueError, TypeError) as err:
            raise _recipe_error(i, kind, err) from None
        out.append(ChatRequest(i, converted, explicit))
    return out


def _prepare(i: int, item: Any, canonical: str, thinking: bool | None,
             tool_list: list[dict[str, Any]] | None) -> tuple[str, Callable[[], Any], frozenset[str] | None]:
    """(protocol name, a recipe-request factory, keys the user set) for one input item."""
    if isinstance(item, _RECIPE_REQUESTS):
        return type(item).__name__, lambda: item, None
    if isinstance(item, (list, tuple)):
        _check_messages(item, f"messages[{i}]")
        body: dict[str, Any] = {"messages": list(item)}
        explicit: frozenset[str] = frozenset()
        kind = "ChatCompletions"
    elif isinstance(item, dict):
        body = dict(item)  # never mutate the caller's dict
        explicit = frozenset(body)
        kind = "Responses" if "input" in body and "messages" not in body else "ChatCompletions"
        if kind == "ChatCompletions":
            _check_messages(body.get("messages"), f"requests[{i}].messages")
        if "tools" in body:
            body["tools"] = _normalise_tools(body["tools"], f"requests[{i}].tools")
    else:
        raise InvalidRequestError(f"messages[{i}] must be a list of message dicts or a request dict, "
                                  f"got {type(item).__name__}", field="messages")
    if "tools" not in body and tool_list:
        body["tools"] = tool_list
    if kind == "ChatCompletions" and thinking is not None:  # the explicit argument wins over the body
        body["thinking"] = {"type": "enabled" if thinking else "disabled"}
    body.setdefault("model", canonical)
    cls = dr.ResponsesRequest if kind == "Responses" else dr.ChatCompletionRequest
    return kind, lambda: cls(body), explicit
