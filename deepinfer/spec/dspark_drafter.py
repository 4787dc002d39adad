"""DSpark drafter (NOT IMPLEMENTED YET): see docs/dspark_assumptions.md for the planned
forward. The stage parameters load (deepinfer/models/dspark.py); `make_drafter` raises
for DSpark checkpoints until this is filled in, so nothing runs a half-built drafter."""

from __future__ import annotations

from .drafter import Drafter


class DSparkDrafter(Drafter):
    def __init__(self, model, cache, k: int) -> None:
        raise NotImplementedError(
            "DSpark drafting is not implemented yet (deepinfer/spec/dspark_drafter.py); "
            "use a checkpoint with a plain MTP stage or set num_speculative_tokens=0")
