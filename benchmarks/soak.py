#!/usr/bin/env python
"""The long soak behind RELIABILITY.md: thousands of mixed requests against a real ``tianxia
serve``, then an overload burst, then SIGTERM.

1. start the server (SmolLM2 by default) with ``--max-waiting-requests`` and ``--request-timeout``;
2. warm up (grammars compiled, caches filled), read the server's resident memory;
3. soak: ``--requests`` mixed requests (see ``tianxia.bench.soak``) at ``--concurrency``, a fifth of
   the clients hanging up mid-stream; then wait for idle and read KV usage, the engine's finished /
   aborted counts, /health and memory again;
4. burst: ``--burst`` requests at once, far above capacity: count 200s and 503s (+ Retry-After),
   check every admitted one finished and the server is idle again;
5. SIGTERM with streams in flight: time the drain and check the exit code.

    python benchmarks/soak.py                          # -> benchmarks/results/soak/<date>.json
    python benchmarks/soak.py --requests 500 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import signal
import threading
import time
from pathlib import Path

import httpx

from tianxia.bench.soak import process_rss, run_soak
from tianxia.server.testing import ServerProcess, metric

KEY = "soak-key"


async def burst(url: str, model: str, count: int) -> dict:
    headers = {"Authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=count + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as c:

        async def one(i: int) -> tuple[int, str | None, int]:
            r = await c.post("/v1/completions", json={
                "model": model, "prompt": f"Item {i}:", "max_tokens": 8, "ignore_eos": True})
            tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
            return r.status_code, r.headers.get("retry-after"), tokens

        t0 = time.monotonic()
        results = await asyncio.gather(*(one(i) for i in range(count)))
        elapsed = time.monotonic() - t0
        t1 = time.monotonic()
        while True:
            text = (await c.get("/metrics")).text
            if (metric(text, "vllm:kv_cache_usage_perc", model_name=model),
                    metric(text, "vllm:num_requests_running", model_name=model)) == (0.0, 0.0):
                break
            await asyncio.sleep(0.2)
    statuses: dict[str, int] = {}
    for status, _, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {
        "burst": count,
        "statuses": statuses,
        "all_503_have_retry_after": all(ra for s, ra, _ in results if s == 503),
        "admitted_finished_in_full": all(t == 8 for s, _, t in results if s == 200),
        "seconds": round(elapsed, 1),
        "idle_after_s": round(time.monotonic() - t1, 2),
    }


def sigterm_drain(srv: ServerProcess, model: str, shutdown_timeout: int) -> dict:
    """Start 4 streams, SIGTERM, and time how long the process takes to exit."""
    done: list[str] = []

    def stream(i: int) -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=600,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": model, "prompt": f"Drain {i}:", "max_tokens": 16,
                                "ignore_eos": True, "stream": True}) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        done.append("error" if any('"error"' in e for e in events) else "completed")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    srv.signal(signal.SIGTERM)
    code = srv.wait(timeout=shutdown_timeout + 60)
    exit_s = time.monotonic() - t0
    for t in threads:
        t.join(timeout=60)
    return {"exit_code": code, "exit_s": round(exit_s, 1), "streams": done}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--burst", type=int, default=400)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-waiting-requests", type=int, default=96)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    server_args = [args.model, "--api-key", KEY, "--kv-cache-memory", "128MiB",
                   "--max-model-len", "1024", "--max-num-seqs", str(args.max_num_seqs),
                   "--max-waiting-requests", str(args.max_waiting_requests),
                   "--request-timeout", "300", "--shutdown-timeout", "30",
                   "--disable-access-log"]
    result: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                    "server_args": server_args, "args": vars(args)}
    srv = ServerProcess(server_args)
    srv.start()
    try:
        rss = process_rss(srv.proc.pid)
        result["rss_start_mib"] = round(rss() / 2**20, 1)
        warm = asyncio.run(run_soak(srv.url, model=args.model, api_key=KEY, num_requests=64,
                                    concurrency=16, seed=1, max_tokens=args.max_tokens))
        result["warmup"] = warm.as_dict()
        report = asyncio.run(run_soak(srv.url, model=args.model, api_key=KEY,
                                      num_requests=args.requests, concurrency=args.concurrency,
                                      seed=2, max_tokens=args.max_tokens, rss=rss))
        result["soak"] = report.as_dict()
        print(json.dumps(result["soak"], indent=1), flush=True)
        result["burst"] = asyncio.run(burst(srv.url, args.model, args.burst))
        result["rss_after_burst_mib"] = round(rss() / 2**20, 1)
        print(json.dumps(result["burst"], indent=1), flush=True)
        result["health_after"] = httpx.get(srv.url + "/health").status_code
        result["sigterm"] = sigterm_drain(srv, args.model, 30)
        print(json.dumps(result["sigterm"]), flush=True)
    finally:
        srv.stop()
    log = srv.log()
    result["tracebacks_in_log"] = log.count("Traceback")
    out = Path(args.out or f"benchmarks/results/soak/{dt.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    s = result["soak"]
    ok = (s["outcomes"].get("error", 0) == 0 and s["kv_usage_after"] == 0
          and s["health_after"] == 200 and result["sigterm"]["exit_code"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
