#!/usr/bin/env bash
# `tianxia bench serve` driven with `vllm bench serve`'s flags, against `tianxia serve` and then
# llama.cpp's llama-server on the same GGUF file with the same threads, one server at a time;
# then `tianxia bench compare` of the two runs.
#
#   benchmarks/build_llama_server.sh                  # once
#   benchmarks/bench_serve_vllm_flags.sh              # -> benchmarks/results/vllm_flags/<date>/
#   THREADS=2 NUM_PROMPTS=32 CONCURRENCY=4 benchmarks/bench_serve_vllm_flags.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${TIANXIA_VENV:-.venv}/bin/python"
LLAMA="${LLAMA_SERVER:-/work/llama.cpp-build/bin/llama-server}"
MODEL="${MODEL:-smollm2-135m}"
THREADS="${THREADS:-2}"
NUM_PROMPTS="${NUM_PROMPTS:-32}"
CONCURRENCY="${CONCURRENCY:-4}"
PORT="${PORT:-18431}"
OUT="benchmarks/results/vllm_flags/$(date -u +%Y-%m-%d)"
mkdir -p "$OUT"
GGUF="$("$PY" -c "from tianxia.loader.hub import pull; print(pull('$MODEL', quiet=True))")"

wait_healthy() {
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
        sleep 1
    done
    echo "server on $PORT not healthy" >&2
    return 1
}

bench() {  # label: the flags of `vllm bench serve`, nothing tianxia-specific
    "$PY" -m tianxia.cli bench serve --backend openai --base-url "http://127.0.0.1:$PORT" \
        --model "$MODEL" --dataset-name random --random-input-len 128 --random-output-len 32 \
        --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" --ignore-eos \
        --disable-tqdm --label "$1" --save-result --result-dir "$OUT" --result-filename "$1.json" \
        | tee "$OUT/$1.txt"
}

run_server() {  # label command...
    local label="$1"
    shift
    "$@" >"$OUT/$label.server.log" 2>&1 &
    local pid=$!
    wait_healthy
    bench "$label"
    kill "$pid"
    wait "$pid" || true
}

run_server tianxia "$PY" -m tianxia.cli serve "$GGUF" --served-model-name "$MODEL" \
    --host 127.0.0.1 --port "$PORT" --threads "$THREADS" --max-num-seqs "$CONCURRENCY" \
    --disable-log-stats
run_server llama.cpp "$LLAMA" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -t "$THREADS" \
    -tb "$THREADS" -np "$CONCURRENCY" -cb -c $((CONCURRENCY * 1024)) --alias "$MODEL"
"$PY" -m tianxia.cli bench compare "$OUT/tianxia.json" "$OUT/llama.cpp.json" \
    --baseline llama.cpp -o "$OUT/compare.md"
