"""Render converted conversations to prompt text and token ids with deepseek-recipe.

Token ids come from the recipe's own prompt encoding when it can use the engine's
tokenizer.json: it encodes the text between template tokens *without* the added
vocabulary, so a user who types ``<｜User｜>`` in a message cannot forge a turn. When the
recipe cannot encode (e.g. the V4.1 template uses ``<｜System｜>``, which the V4 vocabulary
lacks) the rendered text goes through the engine tokenizer instead; that path never
doubles BOS because ``Tokenizer.encode`` skips its BOS when the text already starts with it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr

from deepinfer.tokenizer import Tokenizer

__all__ = ["ChatPrompt", "render_prompt", "encoding_for", "recipe_tokenizer"]

logger = logging.getLogger(__name__)


@dataclass
class ChatPrompt:
    """A rendered conversation.

    Attributes:
        prompt: the template text (starts with the BOS token spelling).
        token_ids: the ids to feed the engine (exactly one BOS, first).
        encoded_by: ``"recipe"`` or ``"tokenizer"`` (the fallback described above).
    """

    prompt: str
    token_ids: list[int]
    encoded_by: str


def encoding_for(converted: Any) -> Any:
    """The recipe prompt encoding matching a converted request's model version."""
    if converted.model_version == dr.ModelVersion.DeepseekV41Flash:
        return dr.DeepseekV41Encoding()
    return dr.DeepseekV4Encoding()


@functools.lru_cache(maxsize=4)
def recipe_tokenizer(path: str) -> Any:
    """The recipe's tokenizer for a tokenizer.json path (cached: loading takes ~0.3 s)."""
    return dr.Tokenizer.from_file(path)


def render_prompt(converted: Any, tokenizer: Tokenizer | None) -> ChatPrompt:
    """Render one converted request; encode it when a tokenizer is given.

    Args:
        converted: a recipe ``ConversationRequest``.
        tokenizer: the engine tokenizer (its ``source`` tokenizer.json is shared with the
            recipe); None returns the prompt text only (``token_ids`` empty).
    """
    encoding = encoding_for(converted)
    rendered = encoding.render_conversation(converted.conversation)
    if tokenizer is None:
        return ChatPrompt(rendered.prompt, [], "none")
    if tokenizer.source is not None:
        try:
            ids = encoding.with_tokenizer(recipe_tokenizer(str(tokenizer.source))).encode(converted.conversation)
            return ChatPrompt(rendered.prompt, list(ids), "recipe")
        except RuntimeError as err:  # a template token outside this vocabulary
            logger.warning("deepseek-recipe could not encode the prompt (%s); encoding the rendered "
                           "text with the engine tokenizer instead", err)
    return ChatPrompt(rendered.prompt, tokenizer.encode(rendered.prompt, add_bos=True), "tokenizer")
