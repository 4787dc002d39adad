#!/usr/bin/env bash
# Create/refresh the project's virtual environment. Idempotent and cheap when
# nothing changed (a stamp file records what was installed).
#
#   bash scripts/bootstrap.sh
#
# Environment:
#   VENV_DIR              venv location (default: <repo>/.venv)
#   PYTHON                interpreter used to create the venv (default: python3.11, else python3)
#   DEEPINFER_ACCELERATOR nvidia|ascend|cpu: which torch to install. Default: detected
#                         (`nvidia-smi -L` works: nvidia; `npu-smi` present: ascend; else cpu).
#                         cpu pins torch==2.13.0 (CPU wheel); nvidia/ascend ask for torch>=2.11
#                         and keep an installed torch that satisfies it.
#   DEEPINFER_TORCH_SPEC  pip requirement for torch, overriding the above
#   BOOTSTRAP_FORCE=1     reinstall even if the stamp matches
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${VENV_DIR:-$ROOT/.venv}"
case "$VENV_DIR" in /*) ;; *) VENV_DIR="$PWD/$VENV_DIR" ;; esac
cd "$ROOT"

log() { echo "bootstrap: $*"; }
die() { echo "bootstrap: error: $*" >&2; exit 1; }

# pip's own chatter (build-backend warnings, "Location ... is ignored" notes about
# configured-but-absent package locations) goes to a log, shown only on failure.
PIP_LOG="$VENV_DIR/.bootstrap-pip.log"
quiet_pip() {
    local rc=0
    echo "+ pip $*" >> "$PIP_LOG"
    "$VENV_DIR/bin/python" -m pip "$@" >> "$PIP_LOG" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "bootstrap: 'pip $*' failed (exit $rc); last lines of $PIP_LOG:" >&2
        grep -v -E "^(WARNING: )?Location '.*' is ignored" "$PIP_LOG" | tail -n 40 >&2 || true
    fi
    return "$rc"
}

# ---------------------------------------------------------------- torch choice
have_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if [[ -n "${DEEPINFER_TORCH_SPEC:-}" ]]; then
    TORCH_SPEC="$DEEPINFER_TORCH_SPEC"; TORCH_WHY="DEEPINFER_TORCH_SPEC"
else
    case "${DEEPINFER_ACCELERATOR:-}" in
        nvidia) TORCH_SPEC="torch>=2.11"; TORCH_WHY="DEEPINFER_ACCELERATOR=nvidia" ;;
        # torch_npu must match torch's version: keep whatever torch is already there.
        ascend) TORCH_SPEC="torch>=2.11"; TORCH_WHY="DEEPINFER_ACCELERATOR=ascend" ;;
        cpu) TORCH_SPEC="torch==2.13.0"; TORCH_WHY="DEEPINFER_ACCELERATOR=cpu" ;;
        "")
            if have_nvidia_gpu; then
                TORCH_SPEC="torch>=2.11"; TORCH_WHY="NVIDIA GPU found"
            elif command -v npu-smi >/dev/null 2>&1; then
                TORCH_SPEC="torch>=2.11"; TORCH_WHY="Ascend NPU tools found"
            else
                TORCH_SPEC="torch==2.13.0"; TORCH_WHY="no NVIDIA GPU: CPU build"
            fi ;;
        *) die "DEEPINFER_ACCELERATOR must be nvidia, ascend or cpu (got '${DEEPINFER_ACCELERATOR}')" ;;
    esac
fi

# ------------------------------------------------------------------ interpreter
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif command -v python3.11 >/dev/null 2>&1 && python3.11 -c '' >/dev/null 2>&1; then
    PY=python3.11
else
    PY=python3
fi

# ------------------------------------------------------------------------ stamp
hash_of() {
    if command -v sha256sum >/dev/null 2>&1; then sha256sum "$@"; else shasum -a 256 "$@"; fi
}
STAMP_FILE="$VENV_DIR/.deepinfer-bootstrap.stamp"
STAMP="$( { hash_of pyproject.toml scripts/bootstrap.sh | awk '{print $1}'; echo "torch=$TORCH_SPEC"; } )"

mkdir -p "$VENV_DIR"
# Serialise concurrent bootstraps of the same venv (e.g. `make test` and `make lab`).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV_DIR/.bootstrap.lock"
    flock 9
fi

if [[ -z "${BOOTSTRAP_FORCE:-}" && -x "$VENV_DIR/bin/python" && -f "$STAMP_FILE" ]] \
    && [[ "$(cat "$STAMP_FILE")" == "$STAMP" ]]; then
    log "up to date ($VENV_DIR)"
    exit 0
fi

START=$SECONDS
: > "$PIP_LOG"

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    command -v "$PY" >/dev/null 2>&1 || die "no '$PY' interpreter found (set PYTHON=/path/to/python3.10+)"
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "$PY is $("$PY" -V 2>&1); deepinfer needs Python >= 3.10 (set PYTHON=...)"
    log "creating venv $VENV_DIR with $PY ($("$PY" -V 2>&1))"
    "$PY" -m venv "$VENV_DIR"
fi

log "upgrading pip"
quiet_pip install -q --upgrade pip || log "warning: could not upgrade pip; continuing with $("$VENV_DIR/bin/python" -m pip -V | cut -d' ' -f1-2)"

log "installing $TORCH_SPEC ($TORCH_WHY)"
quiet_pip install -q "$TORCH_SPEC"

log "installing deepinfer[test,workbench] (editable)"
quiet_pip install -q -e ".[test,workbench]"

TORCH_VER="$("$VENV_DIR/bin/python" -c 'import torch; print(torch.__version__)')"
printf '%s\n' "$STAMP" > "$STAMP_FILE"
log "done in $((SECONDS - START))s (python $("$VENV_DIR/bin/python" -c 'import platform; print(platform.python_version())'), torch $TORCH_VER, venv $VENV_DIR; pip log $PIP_LOG)"
