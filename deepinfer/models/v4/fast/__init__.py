"""DeepSeek-V4's pieces of the GPU fast path (the shared executor and machinery are in
models/fast/): the decode step's attention and whole-model forward (decode.py, forward.py),
the prefill / mixed step (prefill.py, prefill_attention.py), its batch-invariant rows
(invariant_prefill.py), speculative steps on the prefill path (verify_prefill.py) and the
DSpark stages' draft pass (draft.py)."""
