#!/usr/bin/env bash
# Set up, pull the default model (smollm2-135m) and run a demo generation.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${TIANXIA_VENV:-.venv}"
exec "$VENV/bin/tianxia" run -m smollm2-135m -cnv --temp 0 -n 128 \
    -p "${1:-Explain in three sentences what a KV cache is.}"
