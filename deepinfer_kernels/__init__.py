"""deepinfer_kernels: Triton kernels of the GPU fast path (issue 5), each module holding
the kernel, its Python wrapper and a plain-torch ``*_ref`` of the same signature that
reproduces deepinfer's model math (``deepinfer/models``).

=====================  ===============================================================
module                 wrapper(s)
=====================  ===============================================================
``rms_norm``           ``rms_norm(x, weight|None, eps, residual=None)``
``rotary``             ``rotary(x, cos, sin | positions=, inv_freq=, inverse, inplace)``
``router``             ``router(logits, bias, top_k, route_scale, normalize, func,
                       tid2eid=None, input_ids=None) -> (weights, ids int32)``
``moe_align``          ``moe_align(topk_ids, n_experts, block_m) -> MoEAlignment``
``fused_moe``          ``fused_moe(x, w1, w3, w2, topk_weights, topk_ids, limit)``
``fused_moe_quant``    ``fused_moe_fp8(...)``, ``fused_moe_fp4(...)`` (weight-only, decode)
``fused_moe_w8a8``     ``fused_moe_w8a8(x, w1, w3, w2, s1, s3, s2, block, ...)`` (FP8
                       experts x FP8 activations, prefill)
``decode_attention``   ``decode_attention(q, positions, swa_pool, swa_table, window, sink,
                       comp_pool, comp_table, ratio, topk_idx, kv_chunk, max_keys)``
``indexer_topk``       ``indexer_scores(...)``, ``indexer_topk(...) -> ids int32 (-1 = none)``
``fp8_act_quant``      ``act_quant(x, group, col_major_scales, pad_rows) -> (e4m3 [M, K],
                       float32 pow2 scales [M, K/group])``
``fp8_gemm``           ``fp8_gemm(a_q, a_scale, w_q, w_scale, block, out_dtype, groups)``,
                       ``fp8_linear(x, w_q, w_scale, block, groups)`` (w8a8, block-scaled;
                       cuBLAS's block-scaled GEMM at prefill sizes)
``mhc``                ``hc_pre``, ``hc_post_pre``, ``hc_head`` (fused mHC + sublayer norm)
``compressor_decode``  ``compressor_decode(kv, score, ape, positions, slots, ring, entries,
                       table, tail, norm_weight, eps, inv_freq, ratio, overlap, block_size)``
``norm_rope``          ``norm_rope(x, positions, inv_freq, norm, weight, eps, inverse,
                       out_dtype, pool=None, table=None)`` (head norm + RoPE [+ KV write])
``batch_invariant_*``  batch-invariant mode's ops: ``deepinfer.batch_invariant.BUILTIN_KERNELS``
=====================  ===============================================================

Kernels take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` is set before
the modules are imported (the CPU tests do this). Importing this package imports
neither triton nor torch; the submodules do.
"""

__all__ = ["compressor_decode", "decode_attention", "fp8_act_quant", "fp8_gemm", "fused_moe", "fused_moe_quant",
           "fused_moe_w8a8", "indexer_topk", "mhc", "moe_align", "norm_rope", "rms_norm", "rotary", "router"]
