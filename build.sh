#!/usr/bin/env bash
# Set up DeepInfer for one accelerator:
#
#   DEEPINFER_ACCELERATOR=nvidia ./build.sh    # CUDA GPUs (installs triton if missing)
#   DEEPINFER_ACCELERATOR=ascend ./build.sh    # Huawei Ascend NPUs (needs CANN + torch_npu)
#   DEEPINFER_ACCELERATOR=cpu    ./build.sh    # CPU only
#
# Without DEEPINFER_ACCELERATOR the accelerator is detected (nvidia-smi, then
# npu-smi, else cpu). The venv goes to $VENV_DIR (default .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV_DIR="${VENV_DIR:-$ROOT/.venv}"
case "$VENV_DIR" in /*) ;; *) VENV_DIR="$PWD/$VENV_DIR" ;; esac
export VENV_DIR
cd "$ROOT"

log() { echo "build: $*"; }
die() { echo "build: error: $*" >&2; exit 1; }

ACC="${DEEPINFER_ACCELERATOR:-}"
if [[ -z "$ACC" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        ACC=nvidia
    elif command -v npu-smi >/dev/null 2>&1; then
        ACC=ascend
    else
        ACC=cpu
    fi
    log "DEEPINFER_ACCELERATOR not set; detected '$ACC'"
fi
ACC="$(printf '%s' "$ACC" | tr '[:upper:]' '[:lower:]')"
case "$ACC" in
    nvidia|ascend|cpu) ;;
    *)
        echo "build: error: unsupported DEEPINFER_ACCELERATOR='${DEEPINFER_ACCELERATOR:-}'" >&2
        echo "build:        use one of: nvidia, ascend, cpu   (e.g. DEEPINFER_ACCELERATOR=cpu ./build.sh)" >&2
        exit 2 ;;
esac
export DEEPINFER_ACCELERATOR="$ACC"

if [[ "$ACC" == nvidia ]]; then
    command -v nvidia-smi >/dev/null 2>&1 \
        || die "DEEPINFER_ACCELERATOR=nvidia but nvidia-smi is not on PATH: install the NVIDIA driver, or use DEEPINFER_ACCELERATOR=cpu"
    nvidia-smi -L >/dev/null 2>&1 \
        || die "nvidia-smi cannot talk to the driver (try 'nvidia-smi' to see why)"
fi

log "accelerator: $ACC"
bash scripts/bootstrap.sh
PY="$VENV_DIR/bin/python"

case "$ACC" in
nvidia)
    if ! "$PY" -c 'import triton' >/dev/null 2>&1; then
        log "installing triton"
        "$PY" -m pip install -q triton 2>&1 | { grep -v -E "^(WARNING: )?Location '.*' is ignored" || true; }
    fi
    log "GPUs (nvidia-smi):"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | sed 's/^/build:   /'
    "$PY" - <<'PYEOF' || die "torch in $VENV_DIR cannot use the GPU; recreate it: rm -rf \"$VENV_DIR\" && DEEPINFER_ACCELERATOR=nvidia ./build.sh"
import sys
import torch
import triton

print(f"build: torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
if torch.version.cuda is None:
    print("build: error: this torch is a CPU-only build", file=sys.stderr)
    sys.exit(1)
if not torch.cuda.is_available():
    print("build: error: torch.cuda.is_available() is False", file=sys.stderr)
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"build:   cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
PYEOF
    ;;
ascend)
    if ! err="$("$PY" -c 'import torch, torch_npu' 2>&1)"; then
        TORCH_VER="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo '?')"
        {
            echo "build: error: torch_npu cannot be imported in $VENV_DIR:"
            printf '%s\n' "$err" | tail -n 3 | sed 's/^/build:   /'
            echo "build: Ascend support needs:"
            echo "build:   1. Huawei's CANN toolkit (NPU driver, firmware and ascend-toolkit) installed, and its"
            echo "build:      environment loaded in this shell, e.g."
            echo "build:        source /usr/local/Ascend/ascend-toolkit/set_env.sh"
            if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh && -z "${ASCEND_TOOLKIT_HOME:-}" ]]; then
                echo "build:      (set_env.sh exists here but ASCEND_TOOLKIT_HOME is unset: it has not been sourced)"
            fi
            echo "build:   2. a torch_npu release built for this torch ($TORCH_VER), matching the CANN version:"
            echo "build:        $VENV_DIR/bin/pip install \"torch_npu==$TORCH_VER.*\"   (or: pip install -e \".[ascend]\")"
            echo "build: then run this script again."
        } >&2
        exit 1
    fi
    "$PY" - <<'PYEOF'
import torch
import torch_npu  # noqa: F401

n = torch.npu.device_count() if torch.npu.is_available() else 0
print(f"build: torch {torch.__version__}, torch_npu {torch_npu.__version__}, {n} NPU(s)")
for i in range(n):
    print(f"build:   npu:{i} {torch.npu.get_device_name(i)}")
PYEOF
    ;;
cpu)
    "$PY" -c 'import torch; print(f"build: torch {torch.__version__} (CPU, {torch.get_num_threads()} threads)")'
    ;;
esac

log "ready: $ACC (venv $VENV_DIR). Try: make test | make demo | make lab"
