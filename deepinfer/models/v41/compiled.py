"""Factories of DeepSeek-V4.1's compiled pieces (v41/fast/) that its family hands the engine
(`ModelFamily.prefill_executor` / `decode_program` / `dspark_stages_hidden`); the batched
decode executor itself is
the shared one (models/compiled.py). Imports are lazy: the registry loads a family before
any executor is built."""

from __future__ import annotations

from typing import Any


def prefill_executor(model: Any, cache: Any) -> Any:
    """V4.1's prefill / mixed steps, bounded replay included (v41/fast/prefill.py), or None."""
    from .fast.prefill import PrefillPathV41

    return PrefillPathV41.create(model, cache)


def decode_program() -> Any:
    """V4.1's decode forward (v41/fast/forward.py): logits, and the collapsed hidden verify
    steps use (V4.1's forward returns it where V4's returns streams)."""
    from ..fast.runner import DecodeProgram
    from .fast.forward import decode_hidden_v41, decode_logits_v41, decode_verify_v41

    return DecodeProgram(decode_logits_v41, decode_hidden_v41, decode_verify_v41)


def dspark_stages_hidden() -> Any:
    """V4.1's DSpark stages over draft blocks, shifted hyper-connections (v41/fast/draft.py)."""
    from .fast.draft import stages_hidden_v41

    return stages_hidden_v41
