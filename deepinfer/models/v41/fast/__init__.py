"""DeepSeek-V4.1's pieces of the GPU fast path (the shared executor is models/fast/): the
decode step (decode.py, forward.py), the prefill / mixed step with bounded replay
(prefill.py, prefill_attention.py) and the DSpark stages' draft pass (draft.py)."""
