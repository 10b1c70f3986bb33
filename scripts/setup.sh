#!/usr/bin/env bash
# Create the virtual environment (.venv, or $TIANXIA_VENV) and install tianxia into it.
#   scripts/setup.sh          runtime dependencies
#   scripts/setup.sh test     also the test dependencies (and, as root, Debian's chromium)
# torch is installed first and on its own: $TIANXIA_TORCH (default torch==2.13.0) lets a machine
# pick its own build, e.g. TIANXIA_TORCH="torch --index-url https://download.pytorch.org/whl/cpu".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TIANXIA_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    "$PY" -m pip install -q ${TIANXIA_TORCH:-torch==2.13.0}
fi
if [ "${1:-}" = "test" ]; then
    "$PY" -m pip install -q -e ".[test]"
    # SGLang's frontend (sgl.RuntimeEndpoint, its test programs) runs against tianxia serve in
    # the tests; its server's dependencies (a CUDA torch among them) are not wanted here
    if ! "$PY" -c "import sglang" >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-deps "sglang>=0.5"
    fi
    # tests/test_webui.py drives Debian's Chromium through Playwright (not Playwright's own
    # browser download); as root, install it when it is missing
    if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    fi
else
    "$PY" -m pip install -q -e .
fi
