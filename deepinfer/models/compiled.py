"""Factories of the compiled executors (models/fast/) that a family hands the engine
(`ModelFamily.decode_executor` / `prefill_executor`): each returns the executor for a
model replica and its cache, or None when the step kinds run on the reference path."""

from __future__ import annotations

from typing import Any


def decode_executor(model: Any, cache: Any) -> Any:
    """Batched decode steps + CUDA graphs (fast/runner.py), or None."""
    from .fast.runner import FastPath

    return FastPath.create(model, cache)


def prefill_executor(model: Any, cache: Any) -> Any:
    """Prefill / mixed steps (fast/prefill.py), or None."""
    from .fast.prefill import PrefillPath

    return PrefillPath.create(model, cache)


def v41_prefill_executor(model: Any, cache: Any) -> Any:
    """V4.1's prefill / mixed steps, bounded replay included (fast/v41_prefill.py), or None."""
    from .fast.v41_prefill import PrefillPathV41

    return PrefillPathV41.create(model, cache)


def v4_decode_program() -> Any:
    """V4's decode forward (fast/forward.py): logits, and the final streams verify steps use."""
    from .fast.forward import decode_logits, decode_streams
    from .fast.runner import DecodeProgram

    return DecodeProgram(decode_logits, decode_streams)


def v41_decode_program() -> Any:
    """V4.1's decode forward (fast/v41_forward.py): logits, and the collapsed hidden verify
    steps use (V4.1's forward returns it where V4's returns streams)."""
    from .fast.runner import DecodeProgram
    from .fast.v41_forward import decode_hidden_v41, decode_logits_v41

    return DecodeProgram(decode_logits_v41, decode_hidden_v41)
