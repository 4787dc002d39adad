"""deepinfer.profiling.compiles: the kernels compiled inside a block are named, the hook in
place before is chained and restored (CPU: the hook is called as Triton's JIT calls it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepinfer.profiling.compiles import TritonCompiles

knobs = pytest.importorskip("triton").knobs


def test_compiles_inside_the_block_are_named_and_the_previous_hook_chained():
    seen = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        with TritonCompiles() as compiles:
            assert compiles.available
            for name in ("decode_attention", "rms_norm", "decode_attention"):
                knobs.runtime.jit_post_compile_hook(key=None, repr=f"{name}[num_warps=4](n: i32)",
                                                    fn=SimpleNamespace(name=name), compile={},
                                                    is_manual_warmup=False, already_compiled=False)
        knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="after"))  # outside: not counted
        assert compiles.names == ["decode_attention", "rms_norm", "decode_attention"]
        assert compiles.summary(top=2) == {"compiles": 3, "compiled": {"decode_attention": 2, "rms_norm": 1},
                                           "signatures": ["decode_attention[num_warps=4](n: i32)",
                                                          "rms_norm[num_warps=4](n: i32)"]}
        assert seen == ["decode_attention", "rms_norm", "decode_attention", "after"]
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_no_hook_before_means_none_after():
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = None
    try:
        with TritonCompiles() as compiles:
            assert knobs.runtime.jit_post_compile_hook is not None
        assert knobs.runtime.jit_post_compile_hook is None and compiles.summary()["compiles"] == 0
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_a_signature_names_argument_types_constants_and_specialisations():
    """What tells two variants of one kernel apart: the launch's types, constexpr values and
    the attributes Triton specialised on (its hook's compile record)."""
    with TritonCompiles() as compiles:
        knobs.runtime.jit_post_compile_hook(
            key=None, repr="k[...](x_ptr: ()", fn=SimpleNamespace(name="_prefill_index_kernel"),
            compile={"signature": {"q_ptr": "*bf16", "n_cols": "i32", "BLOCK_T": "constexpr"},
                     "constants": {"BLOCK_T": 64}, "configs": [{(1,): [["tt.divisibility", 16]]}]},
            is_manual_warmup=False, already_compiled=False)
    assert compiles.signatures == ["_prefill_index_kernel(q_ptr: *bf16, n_cols: i32) constants={'BLOCK_T': 64} "
                                   "attrs={(1,): [['tt.divisibility', 16]]}"]
