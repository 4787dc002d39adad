"""Exception types raised by deepinfer for bad user input.

Every error raised for a bad value names the offending field (or environment
variable) and the allowed values or range, so that a user can fix the call
without reading the source. ``DeepInferError`` derives from ``ValueError`` so
callers that already catch ``ValueError`` keep working.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DeepInferError",
    "InvalidRequestError",
    "ConfigError",
    "range_message",
]


class DeepInferError(ValueError):
    """Base class of all deepinfer input errors.

    Attributes:
        field: Name of the offending field or environment variable, when the
            error is about a single value (``None`` otherwise).
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidRequestError(DeepInferError):
    """A request (prompt, ``SamplingParams``...) is malformed or out of range."""


class ConfigError(DeepInferError):
    """The engine configuration (kwargs or ``DEEPINFER_*`` env vars) is invalid."""


def range_message(field: str, allowed: str, got: Any) -> str:
    """Build the canonical ``"<field> must be <allowed>, got <got!r>"`` text.

    Args:
        field: Fully qualified field name, e.g. ``"SamplingParams.top_p"``.
        allowed: Human readable description of the allowed values, e.g.
            ``"in (0, 1]"`` or ``"one of 'auto', 'float32'"``.
        got: The rejected value (rendered with ``repr``).
    """
    return f"{field} must be {allowed}, got {got!r}"
