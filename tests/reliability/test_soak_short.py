"""A short soak (the long one is ``benchmarks/soak.py``, figures in RELIABILITY.md): 120 mixed
requests, 32 at a time, a fifth of the clients hanging up mid-stream. Every request completes or
is aborted, the engine counts each once, KV usage returns to 0, /health stays 200 and the
server's memory does not grow past a bound."""

from __future__ import annotations

import asyncio

from reliability_helpers import API_KEY, MODEL

from tianxia.bench.soak import process_rss, run_soak

REQUESTS = 120
RSS_GROWTH_BOUND = 200 * 2**20  # after a warm-up: caches (grammars, token strings) are filled


def test_short_soak(guarded):
    rss = process_rss(guarded.proc.pid)
    warm = asyncio.run(run_soak(guarded.url, model=MODEL, api_key=API_KEY, num_requests=32,
                                concurrency=16, seed=1, max_tokens=12))
    assert warm.outcomes["error"] == 0, warm.errors
    report = asyncio.run(run_soak(guarded.url, model=MODEL, api_key=API_KEY,
                                  num_requests=REQUESTS, concurrency=32, seed=2, max_tokens=12,
                                  rss=rss))
    print(report.as_dict())
    assert report.outcomes["error"] == 0, report.errors
    assert report.outcomes["completed"] + report.outcomes["disconnected"] == REQUESTS
    assert report.outcomes["disconnected"] >= REQUESTS // 10
    for feature in ("chat", "completion", "stream", "n>1", "logprobs", "stop", "seed",
                    "structured", "disconnect"):
        assert report.features[feature] > 0, feature
    # every request was counted once by the engine: finished (stop / length) or aborted
    assert sum(report.finished_delta.values()) == REQUESTS, report.finished_delta
    assert report.finished_delta["abort"] <= report.outcomes["disconnected"]
    assert (report.running_after, report.waiting_after, report.kv_usage_after) == (0, 0, 0)
    assert report.health_after == 200
    assert report.rss_after - report.rss_before < RSS_GROWTH_BOUND, report.as_dict()
