#!/usr/bin/env python
"""The API process's CPU per streamed token at concurrency 1, with the engine core in its own
process: sequential streamed completions (128 random prompt tokens, ``--tokens`` each,
``ignore_eos``), TPOT per request, and the CPU time (user + system, from ``/proc``) of the API
process and of the engine core over them, per token.

The server runs the ``tianxia`` importable from ``PYTHONPATH``, so two trees can be compared by
alternating runs:

    for t in OLD NEW; do PYTHONPATH=$t/src python benchmarks/api_cpu_per_token.py; done
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx
import psutil

from tianxia.server.testing import ServerProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    srv = ServerProcess([args.model, "--threads", str(args.threads), "--engine-core", "process",
                         "--max-model-len", "1024", "--max-num-seqs", "16", "--kv-cache-memory",
                         "256MiB", "--disable-log-stats", "--disable-access-log"])
    rng = random.Random(0)

    def one(client: httpx.Client, n: int) -> tuple[float, int]:
        body = {"model": args.model, "prompt": [rng.randrange(1, 5000) for _ in range(128)],
                "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
        stamps = []
        with client.stream("POST", srv.url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1), len(stamps)

    def cpu(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    with srv:
        api = psutil.Process(srv.proc.pid)
        cores = api.children(recursive=True)
        with httpx.Client(timeout=300) as client:
            one(client, 16)  # warm-up
            api0, cores0 = cpu(api), [cpu(c) for c in cores]
            tpots, tokens = [], 0
            for _ in range(args.requests):
                tpot, n = one(client, args.tokens)
                tpots.append(tpot)
                tokens += n
            api1, cores1 = cpu(api), [cpu(c) for c in cores]
    print(json.dumps({
        "tpot_ms": [round(1000 * t, 2) for t in tpots],
        "tpot_median_ms": round(1000 * statistics.median(tpots), 2),
        "api_cpu_us_per_token": round(1e6 * (api1 - api0) / tokens),
        "core_cpu_us_per_token": round(1e6 * (sum(cores1) - sum(cores0)) / tokens),
    }))


if __name__ == "__main__":
    main()
