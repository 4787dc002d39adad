"""GPU fast path of DeepSeek-V4 (issue 5): batched pure-decode steps over the Triton
kernels of ``deepinfer_kernels`` (or their torch references), plus CUDA graphs of whole
decode steps.

:class:`runner.FastPath` picks pure-decode steps (every request feeds exactly one token
and none is newly admitted), attaches a :class:`decode.DecodeMeta` to the batch
(``ForwardBatch.decode``) and runs :func:`forward.decode_logits`: the whole model with
fused mHC, batched attention/compressors/indexer (:mod:`decode`) and fused MoE
(:mod:`moe`). The reference modules own the parameters; this package only reads them.
The batched decode executor (:class:`runner.FastPath`) serves V4.1 too, with V4.1's decode
program; V4.1's own pieces (its decode layers, prefill / mixed executor and DSpark draft
pass) are in ``deepinfer.models.v41.fast``.
"""
