"""Factories of DeepSeek-V4's compiled pieces (v4/fast/) that its family hands the engine
(`ModelFamily.prefill_executor` / `decode_program` / `dspark_stages_hidden`); the batched
decode executor itself is the shared one (models/compiled.py). Imports are lazy: the
registry loads a family before any executor is built, and the compiled modules pull in
the kernels' Python side, which a reference-only run never needs."""

from __future__ import annotations

from typing import Any


def prefill_executor(model: Any, cache: Any) -> Any:
    """V4's prefill / mixed steps (v4/fast/prefill.py), or None."""
    from .fast.prefill import PrefillPath

    return PrefillPath.create(model, cache)


def decode_program() -> Any:
    """V4's decode forward (v4/fast/forward.py): logits, and the final streams verify steps use."""
    from ..fast.runner import DecodeProgram
    from .fast.forward import decode_logits, decode_streams, decode_verify

    return DecodeProgram(decode_logits, decode_streams, decode_verify)


def dspark_stages_hidden() -> Any:
    """V4's DSpark stages over draft blocks on the fused mHC / MoE kernels (v4/fast/draft.py)."""
    from .fast.draft import stages_hidden_v4

    return stages_hidden_v4


def mtp_stage_attention() -> Any:
    """The MTP stage's window attention over decode-like rows: V4's decode attention
    (v4/fast/decode.py) on the stage's own window cache (spec/mtp_graphs.py)."""
    from .fast.decode import attention_decode

    return attention_decode
