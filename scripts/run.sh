#!/usr/bin/env bash
# Set up, pull the default model (smollm2-135m) and serve it: an OpenAI-compatible API on
# http://127.0.0.1:8000 (Ctrl-C stops it). Extra arguments go to `tianxia serve`, e.g.
#   scripts/run.sh --port 9000 --api-key secret
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${TIANXIA_VENV:-.venv}"
exec "$VENV/bin/tianxia" serve smollm2-135m "$@"
