#!/usr/bin/env python
"""How a server takes in a burst: N requests sent at once, and when each stage reaches them.

A served point at rate ``inf`` (every request sent at once) measures the API process's admission
of the burst as well as the serving loop. This script times that admission on one host, on the
host's monotonic clock, from three sources that share it:

- ``tianxia bench serve`` (``--request-rate inf``): the moment it starts sending
  (``start_monotonic_s`` in its result) and each request's time to first token;
- the server's log at ``--log-level debug``: each tokenizer batch (when its texts were queued,
  i.e. parsed and validated; when the batch went to the worker thread; when it came back), each
  request handed to the engine core, and each engine step;
- ``/proc``: the CPU seconds of the API process and of the engine core over the burst.

It prints, in seconds after the bench's start, when the first, 10%, 50%, 90% and last request
reached each stage, the first step, and the first step that ran as many sequences as any did
(``gpu_serving.py``'s ``steps_after``, which its GPU points print too).

The model is SmolLM2-135M cut to its first ``--layers`` blocks (``benchmarks/gpu_test_model.py``):
the full output head and tokenizer of the real model, so the API process does real work per
token, with steps cheap enough that a 2-core machine can take a burst of a thousand requests.

    python benchmarks/burst_admission.py --requests 1024 --out benchmarks/results/burst/cpu.json
    python benchmarks/burst_admission.py --requests 1024 --max-concurrency 256   # a closed loop
    python benchmarks/burst_admission.py --server-args "--api-server-count 2"
    python benchmarks/burst_admission.py --py-spy DIR   # the API process's stacks over the burst
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(REPO / "src"))
    os.environ["PYTHONPATH"] = str(REPO / "src")
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_core_cpu import cpu_split
from gpu_serving import log_since, steps_after
from gpu_test_model import truncate_layers

from tianxia.server.testing import ServerProcess

_BATCH = re.compile(r"encoded (\d+) texts: queued at ([\d.]+)-([\d.]+), submitted at ([\d.]+), "
                    r"delivered at ([\d.]+)")
_ADD = re.compile(r"request \S+ to core \d+ at ([\d.]+)")


def small_model(layers: int, out: Path) -> Path:
    from tianxia.loader.hub import pull
    from tianxia.quant.quantize import quantize_gguf

    path = out / f"smollm2-{layers}l.gguf"
    if not path.exists():
        cut = out / "cut.gguf"
        truncate_layers(pull("smollm2-135m", quiet=True), cut, layers)
        quantize_gguf(cut, path, "Q4_0", pure=True, progress=False)
        cut.unlink()
    return path


def quantiles(times: list[float]) -> list[float | None]:
    """First, 10%, 50%, 90% and last of ``times`` (seconds)."""
    if not times:
        return [None] * 5
    t = sorted(times)
    n = len(t)
    return [round(t[i], 3) for i in (0, n // 10, n // 2, min(n - 1, 9 * n // 10), n - 1)]


def timeline(log: str, start: float) -> dict:
    """The stages of the burst in ``log`` (the server's, from the bench's warm-up on), in seconds
    after ``start``; events before it (the warm-up request) are left out."""
    parsed, submitted, delivered, waits = [], [], [], []
    for n, q0, q1, sub, dlv in _BATCH.findall(log):
        n, q0, q1, sub, dlv = int(n), float(q0), float(q1), float(sub), float(dlv)
        if q1 < start:
            continue
        # the batch's texts were queued between q0 and q1: spread them evenly for the quantiles
        parsed += [q0 - start + (q1 - q0) * i / max(n - 1, 1) for i in range(n)]
        submitted.append(sub - start)
        delivered += [dlv - start] * n
        waits.append(dlv - sub)
    added = [float(t) - start for t in _ADD.findall(log) if float(t) >= start]
    return {
        "parsed_s": quantiles(parsed),
        "tokenized_s": quantiles(delivered),
        "to_core_s": quantiles(added),
        "first_step_s": None, "largest_step_seqs": 0, "largest_step_s": None, "steps": 0,
        **steps_after(log, start),  # those four, when a step came after the start
        "tokenizer_batches": len(submitted),
        "tokenizer_batch_s_median": round(sorted(waits)[len(waits) // 2], 4) if waits else None,
    }


def stack_shares(raw: Path) -> dict:
    """Where the API process's main thread was, from py-spy's raw (collapsed) stacks: the share of
    its samples inside uvicorn's ASGI call, inside the endpoint function (tianxia's handler) and
    elsewhere (the event loop itself: HTTP parsing, the core's messages, streaming)."""
    total = asgi = handler = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "Thread._bootstrap" in stack.split(";", 1)[0] or not n.isdigit():
            continue  # the tokenizer's worker thread
        total += int(n)
        asgi += int(n) * ("RequestResponseCycle.run_asgi" in stack)
        handler += int(n) * ("run_endpoint_function" in stack)
    return {"samples": total, "asgi_share": round(asgi / max(total, 1), 3),
            "endpoint_share": round(handler / max(total, 1), 3)}


def one_run(model: Path, args, out: Path, tag: str) -> dict:
    serve = [str(model), "--served-model-name", "m", "--threads", str(args.threads), "--log-level", "debug",
             "--disable-access-log", "--disable-log-stats", "--max-num-seqs", str(args.max_num_seqs),
             *args.server_args.split()]
    result_path = out / f"bench_{tag}.json"
    with ServerProcess(serve) as srv:
        offset = srv.log_path.stat().st_size
        api0, core0 = cpu_split(srv.proc.pid)
        bench = [sys.executable, "-m", "tianxia.cli", "bench", "serve", "--base-url", srv.url, "--model", "m",
                 "--tokenizer", str(model), "--input-len", str(args.input_len), "--output-len",
                 str(args.output_len), "--num-prompts", str(args.requests), "--request-rate", "inf",
                 "--no-progress", "--save-result", str(result_path)]
        if args.max_concurrency:
            bench += ["--max-concurrency", str(args.max_concurrency)]
        spy = None
        if args.py_spy:
            args.py_spy.mkdir(parents=True, exist_ok=True)
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(srv.proc.pid), "--rate", "200",
                                    "--format", "raw", "--nonblocking", "-o", str(args.py_spy / f"api_{tag}.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = subprocess.run(bench, capture_output=True, text=True, check=False)
        api1, core1 = cpu_split(srv.proc.pid)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        if r.returncode != 0:
            raise RuntimeError(f"bench failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        log = log_since(srv.log_path, offset)
    result = json.loads(result_path.read_text())
    s = result["summary"]
    row = {"tag": tag, "requests": args.requests, "max_concurrency": args.max_concurrency,
           "server_args": args.server_args, "duration_s": s["duration_s"],
           "output_tok_s": round(s["output_throughput"], 1), "failed": s["failed"],
           "ttft_ms": {k: s["ttft_ms"][k] for k in ("min", "median", "p99") if k in s["ttft_ms"]},
           "api_cpu_s": round(api1 - api0, 2), "core_cpu_s": round(core1 - core0, 2)}
    row["api_cpu_ms_per_request"] = round(1000 * row["api_cpu_s"] / args.requests, 3)
    row.update(timeline(log, result["start_monotonic_s"]))
    if args.py_spy and (args.py_spy / f"api_{tag}.txt").exists():
        row["api_stacks"] = stack_shares(args.py_spy / f"api_{tag}.txt")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1, help="SmolLM2 blocks kept")
    ap.add_argument("--threads", type=int, default=1, help="the engine core's compute threads")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="at most this many requests in flight (a closed loop) instead of all at once")
    ap.add_argument("--server-args", default="", help="more `tianxia serve` arguments")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                    help="record the API process's stacks over each burst (py-spy) into DIR")
    ap.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tx-burst-"))
    model = small_model(args.layers, work)
    rows = []
    for k in range(args.rounds):
        row = one_run(model, args, work, f"round{k + 1}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{args.requests} requests at once, {args.input_len} in / {args.output_len} out"
          + (f", at most {args.max_concurrency} in flight" if args.max_concurrency else "")
          + (f", {args.server_args}" if args.server_args else "")
          + "; seconds after the bench's start (first / 10% / 50% / 90% / last)")
    print("| round | parsed | tokenized | to the core | first step | largest step (seqs) | "
          "output tok/s | TTFT min / p50 ms | API CPU ms a request |")
    print("|---|---|---|---|---:|---:|---:|---|---:|")
    for i, r in enumerate(rows, 1):
        q = lambda v: " / ".join("-" if x is None else f"{x:.2f}" for x in v)
        print(f"| {i} | {q(r['parsed_s'])} | {q(r['tokenized_s'])} | {q(r['to_core_s'])} | "
              f"{r['first_step_s']} | {r['largest_step_s']} ({r['largest_step_seqs']}) | {r['output_tok_s']} | "
              f"{r['ttft_ms'].get('min', 0):.0f} / {r['ttft_ms'].get('median', 0):.0f} | "
              f"{r['api_cpu_ms_per_request']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
