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
