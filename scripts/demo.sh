#!/usr/bin/env bash
# Run the offline-inference example in the project venv (bootstrapping it first).
#
#   bash scripts/demo.sh [args for examples/offline_inference.py]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${VENV_DIR:-$ROOT/.venv}"
case "$VENV_DIR" in /*) ;; *) VENV_DIR="$PWD/$VENV_DIR" ;; esac
export VENV_DIR
cd "$ROOT"

bash scripts/bootstrap.sh

EXAMPLE=examples/offline_inference.py
if [[ ! -f "$EXAMPLE" ]]; then
    echo "demo.sh: error: $ROOT/$EXAMPLE not found" >&2
    exit 1
fi
exec "$VENV_DIR/bin/python" "$EXAMPLE" "$@"
