"""GPU fast path of DeepSeek-V4 (issue 5): batched pure-decode attention, compressors and
MoE over the Triton kernels of ``deepinfer_kernels`` (or their torch references), plus
CUDA graphs of whole decode steps.

The reference modules stay the interface: ``Attention.forward`` and ``Block.forward``
hand a step to this package when the runner attached a :class:`decode.DecodeMeta` to the
batch (``ForwardBatch.decode``), which :class:`runner.FastPath` does only for pure-decode
steps (every request feeds exactly one token and none is newly admitted).
"""
