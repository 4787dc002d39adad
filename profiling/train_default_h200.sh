#!/usr/bin/env bash
# Train the embedded default model on one lent H200 (issue 14), in one device call.
#
#   carry: build/tokens build/tokenizer   (python -m deepinfer.train.{corpus,bpe,data}; ~5 MB)
#   bash profiling/train_default_h200.sh [BUDGET_SECONDS]
#
# Writes under $OUT: train.log, train_result.json and the exported checkpoint as a tar split
# into <= 15 MB parts (the device returns at most 8 files of 16 MiB):
#   cat ckpt.tar.part_* | tar xf - -C datasets/models
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
DEEPINFER_COMMIT="${DEEPINFER_COMMIT:-unknown}" python3 -m deepinfer.train.run --tokens build/tokens --tokenizer build/tokenizer --out /tmp/deepinfer-tiny \
    --time-budget "${1:-450}" 2>&1 | tee "$OUT/train.log"
rc=${PIPESTATUS[0]}
if [[ -f /tmp/deepinfer-tiny/train_result.json ]]; then
    cp /tmp/deepinfer-tiny/train_result.json "$OUT/"
    tar cf - -C /tmp deepinfer-tiny | split -b 15M - "$OUT/ckpt.tar.part_"
fi
ls -la "$OUT"
exit "$rc"
