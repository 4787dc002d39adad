"""User-facing per-request sampling parameters (mirrors DeepInfer / vLLM).

``SamplingParams`` validates every field at construction time and raises
:class:`~deepinfer.errors.InvalidRequestError` whose message names the field and
the allowed range, e.g. ``SamplingParams.top_p must be in (0, 1], got 1.5``.

Determinism: when ``seq_seed`` is omitted a random 64-bit seed is drawn with
``secrets.randbits(64)`` *at construction time* and stored on the object, so
outputs can report it and a run can be replayed by passing it back explicitly.
"""

from __future__ import annotations

import math
import numbers
import copy
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer.errors import InvalidRequestError, range_message
from deepinfer.structured.spec import spec_from_params

__all__ = [
    "SamplingParams",
    "GREEDY_TEMPERATURE_EPS",
    "MAX_TOP_LOGPROBS",
    "FLOAT32_MAX",
    "MAX_TOP_K",
    "SO_SCHEMA_TYPES",
    "SO_ARGS_KEYS",
    "SO_ARGS_REQUIRED_KEYS",
]

#: Temperatures strictly below this value mean greedy (argmax) decoding.
GREEDY_TEMPERATURE_EPS: float = 1e-5
#: Largest accepted ``top_logprobs``.
MAX_TOP_LOGPROBS: int = 20
#: Largest accepted ``seq_seed`` (seeds are unsigned 64-bit integers).
MAX_SEQ_SEED: int = 2**64 - 1
#: Largest finite float32: the sampler divides logits by the temperature in float32, so a
#: larger temperature (finite as a Python float, e.g. 1e39) would become inf there.
FLOAT32_MAX: float = 3.4028234663852886e38
#: Largest accepted ``top_k``: the sampler holds it in an int64 tensor (values above the
#: vocabulary size keep every token).
MAX_TOP_K: int = 2**63 - 1
#: Allowed ``so_args["schema_type"]`` values.
SO_SCHEMA_TYPES: tuple[str, ...] = ("json", "regex", "ebnf")
#: Keys accepted in ``so_args`` (extend here when structured output grows);
#: ``trigger`` (text or token ids) switches the grammar on mid-generation.
SO_ARGS_KEYS: tuple[str, ...] = ("schema_type", "schema", "trigger")
#: Keys ``so_args`` must have.
SO_ARGS_REQUIRED_KEYS: tuple[str, ...] = ("schema_type", "schema")

_P = "SamplingParams."


def _is_int(value: Any) -> bool:
    """True for real integers (``bool`` is deliberately not an integer here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int_field(name: str, value: Any, lo: int, hi: int | None, allowed: str) -> int:
    """Validate an integer field in ``[lo, hi]`` (``hi=None``: unbounded)."""
    if not _is_int(value):
        raise InvalidRequestError(
            f"{_P}{name} must be an int {allowed}, got {value!r} ({type(value).__name__})",
            field=name,
        )
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise InvalidRequestError(range_message(_P + name, allowed, value), field=name)
    return value


def _float_field(name: str, value: Any, allowed: str) -> float:
    """Check ``value`` is a finite real number (not bool) and return it as float."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise InvalidRequestError(
            f"{_P}{name} must be a number {allowed}, got {value!r} ({type(value).__name__})",
            field=name,
        )
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRequestError(range_message(_P + name, f"finite and {allowed}", value),
                                  field=name)
    return value


def _bool_field(name: str, value: Any) -> bool:
    """Check ``value`` is a real ``bool`` (ints such as 0/1 are rejected)."""
    if not isinstance(value, bool):
        raise InvalidRequestError(range_message(_P + name, "True or False", value), field=name)
    return value


@dataclass
class SamplingParams:
    """Per-request sampling settings; validated and normalised on construction.

    Attributes:
        temperature: >= 0; values < ``GREEDY_TEMPERATURE_EPS`` (1e-5) mean greedy.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: -1 disables it, otherwise >= 1.
        min_p: in [0, 1]; drop tokens with p < min_p * p_max; 0 disables it.
        max_tokens: maximum number of generated tokens, >= 1.
        min_tokens: EOS/stop are suppressed before this many tokens, 0..max_tokens.
        stop: stop strings; normalised to a (possibly empty) list.
        stop_token_ids: extra stop token ids (>= 0); normalised to a list.
        ignore_eos: keep generating after EOS.
        top_logprobs: number of top log-probs returned per token, 0..20.
        seq_seed: uint64 seed of the request's counter-based RNG; drawn with
            ``secrets.randbits(64)`` when omitted and stored.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens when detokenising.
        so_args: structured-output spec ``{"schema_type": "json"|"regex"|"ebnf",
            "schema": ..., "trigger": optional text or token ids}``; only its shape
            is validated here.
        structured_output: a :class:`~deepinfer.structured.StructuredOutputSpec` or a
            dict ``{"json": schema}`` / ``{"regex": ...}`` / ``{"ebnf": ...}`` /
            ``{"json_object": True}`` (+ optional ``"trigger"``, ``"any_whitespace"``);
            normalised to a spec, also when given through ``so_args``. Support
            of the schema itself is checked at ``LLM.generate`` admission.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0
    seq_seed: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    so_args: dict[str, Any] | None = None
    structured_output: object | None = None

    def __post_init__(self) -> None:
        """Validate every field and normalise ``stop``/``stop_token_ids``/``seq_seed``."""
        self.temperature = _float_field("temperature", self.temperature, ">= 0")
        if not 0 <= self.temperature <= FLOAT32_MAX:
            raise InvalidRequestError(range_message(_P + "temperature", f">= 0 and <= {FLOAT32_MAX:.7g} (finite "
                                                    "in float32, the sampler's dtype)", self.temperature),
                                      field="temperature")
        self.top_p = _float_field("top_p", self.top_p, "in (0, 1]")
        if not 0.0 < self.top_p <= 1.0 or float(np.float32(self.top_p)) == 0.0:  # 0 in float32: no token
            raise InvalidRequestError(range_message(_P + "top_p", "in (0, 1]", self.top_p),
                                      field="top_p")
        top_k_allowed = "-1 (disabled) or >= 1 and <= 2**63 - 1 (int64)"
        self.top_k = _int_field("top_k", self.top_k, -1, MAX_TOP_K, top_k_allowed)
        if self.top_k == 0:
            raise InvalidRequestError(range_message(_P + "top_k", top_k_allowed, 0), field="top_k")
        self.min_p = _float_field("min_p", self.min_p, "in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(range_message(_P + "min_p", "in [0, 1]", self.min_p),
                                      field="min_p")
        self.max_tokens = _int_field("max_tokens", self.max_tokens, 1, None, ">= 1")
        self.min_tokens = _int_field("min_tokens", self.min_tokens, 0, self.max_tokens,
                                     f"in [0, max_tokens={self.max_tokens}]")
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _bool_field("ignore_eos", self.ignore_eos)
        self.top_logprobs = _int_field("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS,
                                       f"in [0, {MAX_TOP_LOGPROBS}]")
        # Remember whether the seed was drawn here: an engine gives each request that shares
        # such a params object its own draw (else n copies of a prompt would sample alike).
        self._seed_drawn = self.seq_seed is None
        if self.seq_seed is None:
            self.seq_seed = secrets.randbits(64)
        self.seq_seed = _int_field("seq_seed", self.seq_seed, 0, MAX_SEQ_SEED,
                                   "in [0, 2**64 - 1] (uint64)")
        self.include_stop_str_in_output = _bool_field("include_stop_str_in_output",
                                                      self.include_stop_str_in_output)
        self.skip_special_tokens = _bool_field("skip_special_tokens", self.skip_special_tokens)
        self._validate_so_args(self.so_args)
        self.structured_output = spec_from_params(self)

    def for_request(self) -> "SamplingParams":
        """The params one request uses: itself when the seed was given, else a copy with a
        fresh seed (reported back in the request's output so the run can be replayed)."""
        if not getattr(self, "_seed_drawn", False):
            return self
        clone = copy.copy(self)
        clone.seq_seed = secrets.randbits(64)
        return clone

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        """``None`` -> ``[]``, ``str`` -> ``[str]``; lists/tuples of non-empty str kept."""
        allowed = "None, a non-empty str or a list of non-empty str"
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise InvalidRequestError(range_message(_P + "stop", allowed, stop), field="stop")
        for item in items:
            if not isinstance(item, str) or not item:
                raise InvalidRequestError(range_message(_P + "stop", allowed, stop), field="stop")
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        """``None`` -> ``[]``; otherwise a list/tuple of ints >= 0."""
        allowed = "None or a list of ints >= 0"
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise InvalidRequestError(range_message(_P + "stop_token_ids", allowed, ids),
                                      field="stop_token_ids")
        return [int(i) for i in ids]

    @staticmethod
    def _validate_so_args(so_args: Any) -> None:
        """Check the shape of DeepInfer's structured output spec (not its content)."""
        name = _P + "so_args"
        shape = ('None or a dict {"schema_type": "json"|"regex"|"ebnf", "schema": ...} '
                 "(json: dict or str, regex/ebnf: non-empty str)")
        if so_args is None:
            return
        if not isinstance(so_args, dict):
            raise InvalidRequestError(range_message(name, shape, so_args), field="so_args")
        unknown = sorted(set(so_args) - set(SO_ARGS_KEYS), key=str)
        missing = [k for k in SO_ARGS_REQUIRED_KEYS if k not in so_args]
        if unknown or missing:
            raise InvalidRequestError(
                f"{name} must be {shape}; unknown keys {unknown}, missing keys {missing}",
                field="so_args")
        schema_type, schema = so_args["schema_type"], so_args["schema"]
        if schema_type not in SO_SCHEMA_TYPES:
            raise InvalidRequestError(
                range_message(name + "['schema_type']", f"one of {list(SO_SCHEMA_TYPES)}",
                              schema_type), field="so_args")
        ok = (isinstance(schema, (dict, str)) if schema_type == "json"
              else isinstance(schema, str)) and schema != ""
        if not ok:
            kind = "a dict or JSON str" if schema_type == "json" else "a non-empty str"
            raise InvalidRequestError(
                range_message(name + "['schema']", f"{kind} for schema_type={schema_type!r}",
                              schema), field="so_args")
