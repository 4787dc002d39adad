#!/usr/bin/env bash
# One lent-GPU session's measurements, in one command per part (each under 10 minutes):
#   RANKS=2 bash profiling/h200_session.sh ep        # 2 / 4 GPUs: EP == single GPU, mini EP bench (b64/256, 8k)
#   RANKS=2 bash profiling/h200_session.sh ep_flash  # 2 / 4 GPUs: flash4-width EP bench, skewed + balanced
#   bash profiling/h200_session.sh single    # 1 GPU: structured mask, spec step curve, V4.1 replay, batch-invariant cost
#   bash profiling/h200_session.sh bench     # 1 GPU, ~9 min: fast path vs reference vs HF (mini, flash4), prefill + FP8
#   bash profiling/h200_session.sh kernels   # 1 GPU, ~8 min: mHC launch sweep, kernel bench sections, B=64 host profile
#   bash profiling/h200_session.sh final     # 1 GPU, ~5 min: mini fast path bench, host phases, prefill bench (FP4 experts)
#   bash profiling/h200_session.sh quant     # 1 GPU, ~6 min: FP8 tuning, flash4 8k prefill bf16 / FP8 / FP4, FP8 profile
#   bash profiling/h200_session.sh phases    # 1 GPU, ~1 min: host time per engine function per mini decode step
#   bash profiling/h200_session.sh host      # 1 GPU, ~2 min: engine host time per decode step at B=1 / 64
#   bash profiling/h200_session.sh features  # 1 GPU, ~9 min: async timeline, batch invariance, spec curve,
#                                            #   trained-model spec decode chart, V4.1 replay at 32k
#   bash profiling/h200_session.sh serving   # 1 GPU, ~7 min: compressor kernels compiled, serve_h200 (server
#                                            #   vs LLM.generate, host CPU per process), prefill host profile
#   bash profiling/h200_session.sh spec      # 1 GPU, ~8 min: spec_h200 (off / MTP / DSpark fixed / scheduled)
#   bash profiling/h200_session.sh grid      # 1 GPU, ~7 min: decode grid + first generate after start (pinned allocs),
#                                            #   offline step kinds of one wave vs several (serve_h200's offline row)
# Expects the packages the image lacks carried as .whl_site/site.tar.xz (scripts/device_wheels.sh
# builds it: engine, server, notebook runner), else as wheels in .whl/ or $WHEELS; writes under $OUT
# (bench/features: everything under $OUT/res, packed into $OUT/results.tgz; DEEPINFER_COMMIT
# names the commit the tree was sent from).
set -uo pipefail
if [ -f .whl_site/site.tar.xz ]; then mkdir -p /tmp/site && tar -xJf .whl_site/site.tar.xz -C /tmp/site
else python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${WHEELS:-.whl}"/*.whl >/dev/null 2>&1; fi
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 OUT="${OUT:-profiling/results}"
run() { local limit=$1; shift; echo "== $*"; timeout "$limit" "$@" 2>&1 | grep -v "Loading weights\|no tokenizer.json" | tail -25; }
# bench / features: full logs under $OUT/res, the last lines printed
RES="$OUT/res"
logged() { local name=$1 limit=$2; shift 2; mkdir -p "$RES"; echo "== [$name] $* (limit ${limit}s)"; local t0=$SECONDS
    timeout "$limit" "$@" > "$RES/$name.log" 2>&1; echo "-- [$name] rc=$? in $((SECONDS - t0))s"
    grep -v "Loading weights\|no tokenizer.json\|USDT\|it/s\]" "$RES/$name.log" | tail -${TAIL:-14}; }
pack() { tar czf "$OUT/results.tgz" -C "$RES" . && ls -la "$OUT"; }
case "${1:-single}" in
  ep)  # RANKS (2 or 4) GPUs: EP == single GPU on a mixed batch; mini EP decode at 64 / 256 per rank and an
       # 8k-token prefill per rank, skewed routing before / after EPLB, then balanced routing
    R=${RANKS:-2}
    run 200 python3 profiling/ep_gpu_check.py --ranks $R --size mini
    for b in 64 256; do run 280 python3 benchmarks/ep_bench.py --ranks $R --size mini --dtype bfloat16 \
        --prefill-len 8192 --decode-batch-per-rank $b --decode-tokens 16 --repeats 2 --out "$OUT"; done
    run 280 python3 benchmarks/ep_bench.py --ranks $R --size mini --dtype bfloat16 --routing balanced \
        --prefill-len 8192 --decode-batch-per-rank 64 --decode-tokens 16 --repeats 2 --out "$OUT"
    ;;
  ep_flash)  # RANKS GPUs: the same on two V4-Flash-width layers (256 experts x 2048; a 26 GB checkpoint)
    R=${RANKS:-2}
    for routing in skewed balanced; do run 550 python3 benchmarks/ep_bench.py --ranks $R --size flash4w \
        --dtype bfloat16 --routing $routing --prefill-len 8192 --decode-batch-per-rank 64 --decode-tokens 16 \
        --repeats 2 --out "$OUT"; done
    ;;
  single)
    run 90 python3 benchmarks/structured_mask_overhead.py --device cuda --out "$OUT"
    [[ -f benchmarks/spec_step_curve.py ]] && run 150 python3 benchmarks/spec_step_curve.py --out "$OUT"
    run 150 python3 benchmarks/v41_bounded_replay.py speed --config mini --device cuda --lengths 2048,8192 \
        --repeats 2 --out-dir "$OUT"
    python3 -c "
import torch; from deepinfer.parallel.skew import mini_like_config
from deepinfer.models.tiny import write_tiny_checkpoint
write_tiny_checkpoint('/tmp/mini', seed=0, cfg=mini_like_config('mini'), dtype=torch.bfloat16)"
    run 150 python3 benchmarks/batch_invariant_cost.py --model /tmp/mini --dtype bfloat16 --scale 0.25 --repeats 1 \
        --device-note h200 --out-dir "$OUT"
    ;;
  bench)
    logged fastpath 400 python3 benchmarks/fastpath_bench.py --sizes mini,flash4 --budget-s 360 --out "$RES"
    TAIL=10 logged prefill 130 python3 benchmarks/prefill_bench.py --out "$RES" --commit "${DEEPINFER_COMMIT:-unknown}"
    pack
    ;;
  kernels)
    logged mhc_tuning 300 python3 profiling/mhc_tuning.py --out "$RES"
    logged kernel_bench 200 python3 benchmarks/kernel_bench.py --only "${KERNEL_SECTIONS:-skinny,mhc}" \
        --widths mini,flash --out "$RES"
    TAIL=40 logged host_b64 150 python3 profiling/spec_host_profile.py --model deepinfer-tiny --k 0 --batch 64 \
        --tokens 64 --out "$RES"
    pack
    ;;
  final)
    logged fastpath 150 python3 benchmarks/fastpath_bench.py --sizes mini --budget-s 130 --out "$RES"
    logged host_phases 100 python3 benchmarks/host_phases.py --size mini --batches 1,64 --tokens 128 --out "$RES"
    TAIL=10 logged prefill 120 python3 benchmarks/prefill_bench.py --out "$RES" --commit "${DEEPINFER_COMMIT:-unknown}"
    ;;
  quant)  # 1 GPU, ~6 min: FP8 GEMM / MoE tuning, flash4 8k prefill bf16 / FP8 (checked, w8a8 experts forced
          # in the check) / FP4 experts, the FP8 prefill profile
    [[ -z "${NO_TUNING:-}" ]] && TAIL=60 logged fp8_tuning 150 python3 profiling/fp8_prefill_tuning.py --out "$RES"
    TRITON_INTERPRET=0 TAIL=6 logged gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemm.py \
        tests/kernels/test_fused_moe_w8a8.py
    for q in bf16 fp8 fp4; do skip=check,decode,profile,hf; [[ $q == fp8 ]] && skip=decode,profile,hf
        DEEPINFER_CUDA_GRAPH_WARMUP=0 DEEPINFER_MOE_W8A8=$([[ $q == fp8 ]] && echo 1 || echo auto) \
            logged "fastpath_flash4_$q" 150 python3 benchmarks/fastpath_bench.py --sizes flash4 \
            $([[ $q != bf16 ]] && echo --quantize $q) --skip $skip --out "$RES"; done
    TAIL=40 logged profile_fp8 120 python3 profiling/prefill_profile.py --size flash4 --quantize fp8 --out "$RES"
    pack
    ;;
  fp8check)  # 1 GPU, ~4 min: FP8 GPU tests; the flash4 FP8 check under each expert / dense FP8 numerics
    TRITON_INTERPRET=0 TAIL=6 logged gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemm.py \
        tests/kernels/test_fused_moe_w8a8.py
    for v in 0:auto 0:dequant 1:dequant; do
        DEEPINFER_MOE_W8A8=${v%%:*} DEEPINFER_FP8_GEMM=${v##*:} DEEPINFER_CUDA_GRAPH_WARMUP=0 TAIL=8 \
            logged "check_w8a8_${v%%:*}_fp8gemm_${v##*:}" 120 python3 benchmarks/fastpath_bench.py --sizes flash4 \
            --quantize fp8 --skip decode,profile,hf --out "$RES/${v/:/_}"; done
    pack
    ;;
  phases)
    logged host_phases 150 python3 benchmarks/host_phases.py --size mini --batches 1,64 --tokens 128 --out "$RES"
    ;;
  host)
    for b in 1 64; do TAIL=70 logged "host_b$b" 100 python3 profiling/spec_host_profile.py --model deepinfer-tiny --k 0 \
        --batch $b --tokens 64 --out "$RES"; done
    pack
    ;;
  features)
    logged async 120 python3 benchmarks/async_overlap.py --size mini --batch 64 --out-dir "$RES"
    logged invariant 140 python3 profiling/batch_invariant_gpu.py --budget-s 100 --out "$RES"
    logged spec_curve 110 python3 benchmarks/spec_step_curve.py --budget-s 80 --out "$RES"
    logged spec_chart 100 python3 profiling/spec_decode_chart.py --time-budget 20 --batches 1,16,64 --out-dir "$RES"
    logged v41_32k 50 python3 benchmarks/v41_bounded_replay.py speed --config mini --device cuda --lengths 32768 \
        --repeats 1 --out-dir "$RES"
    pack
    ;;
  serving)  # issue 25's targets and the fused prefill compressor's kernels, compiled on the GPU
    TRITON_INTERPRET=0 run 150 python3 -m pytest -q -p no:cacheprovider --tb=short \
        tests/kernels/test_compressor_decode.py tests/kernels/test_compressor_prefill.py
    run 330 python3 benchmarks/serve_h200.py --low-load-repeats 24 --out "$OUT"
    run 90 python3 profiling/prefill_host_profile.py --out "$OUT"
    ;;
  grid)  # issue 23: cliffs and the first generate after start (its probe counts pinned host allocations)
    run 330 python3 profiling/decode_grid.py --budget-s 240 --out "$OUT"
    run 150 python3 profiling/offline_waves.py --out "$OUT"
    ;;
  spec)  # issue 24's targets: scheduled DSpark now plans ahead like fixed
    TAIL=40 logged spec_h200 540 python3 benchmarks/spec_h200.py --out "$OUT"  # full log: $OUT/res/spec_h200.log
    ;;
esac
