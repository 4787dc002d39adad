"""Factories of the compiled executors (models/fast/) that a family hands the engine
(`ModelFamily.decode_executor` / `prefill_executor`): each returns the executor for a
model replica and its cache, or None when the step kinds run on the reference path.
The batched decode executor serves every family; the prefill executor and the decode
program here are V4's (V4.1's: v41/compiled.py)."""

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


def v4_decode_program() -> Any:
    """V4's decode forward (fast/forward.py): logits, and the final streams verify steps use."""
    from .fast.forward import decode_logits, decode_streams
    from .fast.runner import DecodeProgram

    return DecodeProgram(decode_logits, decode_streams)
