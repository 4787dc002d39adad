"""The shared compiled decode executor (models/fast/runner.py) that every family hands the
engine (`ModelFamily.decode_executor`): it returns the executor for a model replica and its
cache, or None when decode steps run on the reference path. Each family's own compiled
pieces (prefill executor, decode program, DSpark stages) are in its package: v4/compiled.py,
v41/compiled.py."""

from __future__ import annotations

from typing import Any


def decode_executor(model: Any, cache: Any) -> Any:
    """Batched decode steps + CUDA graphs (fast/runner.py), or None."""
    from .fast.runner import FastPath

    return FastPath.create(model, cache)
