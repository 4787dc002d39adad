"""The GPU fast path's machinery shared by the model families (issue 5, split by family in
issue 23): batched pure-decode steps over the Triton kernels of ``deepinfer_kernels`` (or
their torch references), plus CUDA graphs of whole decode steps.

:class:`runner.FastPath` picks pure-decode steps (every request feeds its token, or a token
and its drafts), attaches a :class:`decode.DecodeMeta` to the batch (``ForwardBatch.decode``)
and runs the family's decode program (``ModelFamily.decode_program``). Shared here: the op
namespaces (decode.py, prefill.py's op selection, invariant.py), the decode / verify / draft
graph sets (decode_graphs.py, verify_graphs.py, draft_graphs.py), the fused-mHC blocks and
LM head (forward.py), the fused MoE (moe.py), fused weights, prefill metadata and compressor
plans, the DSpark block inputs and sampling (draft_dspark.py) and launch counting. The
reference modules own the parameters; this package only reads them. Each family's own
pieces (decode attention and forward, prefill / mixed executor, DSpark stages' pass) are in
``deepinfer.models.v4.fast`` and ``deepinfer.models.v41.fast``.
"""
