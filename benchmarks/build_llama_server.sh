#!/usr/bin/env bash
# Build llama.cpp's HTTP server (`llama-server`) from the llama.cpp sources vendored in the
# llama-cpp-python source package on PyPI, outside the repository.
#
#   benchmarks/build_llama_server.sh            # -> /work/llama.cpp-build/bin/llama-server
#   LLAMA_BUILD_DIR=/elsewhere LLAMA_CPP_PYTHON_VERSION=0.3.36 benchmarks/build_llama_server.sh
#   TARGETS="llama-server llama-perplexity" benchmarks/build_llama_server.sh   # more of its tools
#   LLAMA_NO_AMX=1 LLAMA_BUILD_DIR=/work/llama.cpp-noamx benchmarks/build_llama_server.sh
#
# Needs cmake, a C/C++ compiler and pip (for `pip download`). Native CPU flags (GGML_NATIVE=ON),
# no libcurl (models are local files). Takes ~10-20 minutes on 2 cores.
set -euo pipefail

BUILD_ROOT="${LLAMA_BUILD_DIR:-/work/llama.cpp-build}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"        # empty = latest on PyPI
JOBS="${JOBS:-$(nproc)}"
TARGETS="${TARGETS:-llama-server}"
PIP="${PIP:-pip}"
if [ -x /work/venv/bin/pip ] && [ -z "${PIP_SET:-}" ] && ! command -v "$PIP" >/dev/null 2>&1; then
    PIP=/work/venv/bin/pip
fi

missing=""
for t in $TARGETS; do [ -x "$BUILD_ROOT/bin/$t" ] || missing="$missing $t"; done
if [ -z "$missing" ] && [ -z "${FORCE:-}" ]; then
    echo "already built: $TARGETS in $BUILD_ROOT/bin (FORCE=1 to rebuild)"
    exit 0
fi

mkdir -p "$BUILD_ROOT/src"
SPEC="llama-cpp-python${VERSION:+==$VERSION}"
echo ">> downloading the $SPEC source package"
"$PIP" download --no-deps --no-binary :all: "$SPEC" -d "$BUILD_ROOT/src"
SDIST="$(ls -t "$BUILD_ROOT"/src/llama_cpp_python-*.tar.gz | head -n1)"
SRC="${SDIST%.tar.gz}"
if [ ! -d "$SRC" ]; then
    echo ">> unpacking $SDIST"
    tar -xzf "$SDIST" -C "$BUILD_ROOT/src"
fi
LLAMA_SRC="$SRC/vendor/llama.cpp"
test -f "$LLAMA_SRC/CMakeLists.txt" || { echo "no vendored llama.cpp in $SRC" >&2; exit 1; }

# LLAMA_NO_AMX=1: the CPU's own instruction sets but AMX (GGML_NATIVE=OFF, each set named from
# /proc/cpuinfo). Where the CPU reports AMX but a process cannot use its tiles (a virtual machine
# that does not pass the tile state through), the native build's AMX kernels stop with SIGILL.
ISA_ARGS=(-DGGML_NATIVE=ON)
if [ -n "${LLAMA_NO_AMX:-}" ]; then
    ISA_ARGS=(-DGGML_NATIVE=OFF)
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
                avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        case "$flags" in
            *" ${pair%%:*} "*) ISA_ARGS+=("-DGGML_${pair#*:}=ON") ;;
            *) ISA_ARGS+=("-DGGML_${pair#*:}=OFF") ;;
        esac
    done
fi

echo ">> configuring $LLAMA_SRC (${ISA_ARGS[*]})"
cmake -S "$LLAMA_SRC" -B "$BUILD_ROOT/build" \
    -DCMAKE_BUILD_TYPE=Release \
    "${ISA_ARGS[@]}" \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF

echo ">> building $TARGETS with $JOBS jobs"
# shellcheck disable=SC2086
nice -n 10 cmake --build "$BUILD_ROOT/build" --target $TARGETS -j "$JOBS"

mkdir -p "$BUILD_ROOT/bin"
for t in $TARGETS; do
    cp "$BUILD_ROOT/build/bin/$t" "$BUILD_ROOT/bin/$t"
    echo ">> built: $BUILD_ROOT/bin/$t"
done
"$BUILD_ROOT/bin/llama-server" --version 2>&1 | tail -n 2 || true
