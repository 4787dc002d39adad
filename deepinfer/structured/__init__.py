"""Structured output: JSON Schema, regex and EBNF constraints through xgrammar.

Only the spec is imported eagerly (``SamplingParams`` validates it); everything
that needs xgrammar is imported on first use, so ``import deepinfer`` stays light.

Modules: ``spec`` (what is asked), ``checks`` (what xgrammar would silently weaken,
rejected), ``vocab`` (TokenizerInfo from the V4 tokenizer), ``compiler`` (thread
pool + cache), ``matcher`` (per-request state, trigger, rollback), ``batch``
(bitmask fill/apply), ``manager`` (the engine's entry points).
"""

from deepinfer.structured.spec import SPEC_KINDS, StructuredOutputSpec, spec_from_params

__all__ = ["SPEC_KINDS", "StructuredOutputSpec", "spec_from_params"]
