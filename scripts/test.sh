#!/usr/bin/env bash
# Set up with the test dependencies, pull the real models the tests use, run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
VENV="${TIANXIA_VENV:-.venv}"
"$VENV/bin/python" -m tianxia.loader.hub smollm2-135m qwen2.5-coder-0.5b
exec "$VENV/bin/python" -m pytest -q "$@"
