"""Per-request records and the summary metrics computed from them.

Definitions (the same as vLLM's ``vllm bench serve``):

- TTFT: from sending the request to the first streamed chunk that carries generated text.
- ITL: the gaps between successive text-carrying chunks of a request (one per chunk, so a chunk
  with several tokens counts as one gap).
- TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``; requests with one output token have none.
- E2E latency: from sending the request to the end of its stream.
- Throughputs divide totals over successful requests by the benchmark duration (first send to
  last completion).
- Peak concurrency: the most requests in flight at once, from the send/finish times.
- Goodput (when SLOs are given): successful requests per second whose own TTFT, TPOT, ITL and E2E
  all meet the thresholds.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    success: bool = False
    error: str | None = None
    http_status: int | None = None
    start_s: float = 0.0  # send time, seconds after the benchmark started
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0  # text-carrying chunks received
    expected_input_tokens: int | None = None  # by our tokenizer
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    input_tokens: int = 0  # usage if reported, else expected
    expected_output_tokens: int = 0  # max_tokens asked for
    usage_completion_tokens: int | None = None
    counted_output_tokens: int | None = None  # generated text re-tokenized by our tokenizer
    output_tokens: int = 0  # usage, else counted, else chunks
    output_tokens_source: str = "none"  # "usage" | "tokenizer" | "chunks"
    finish_reason: str | None = None
    dropped_fields: list[str] = field(default_factory=list)  # retried without these
    text: str | None = None  # only with --save-text

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        if self.text is None:
            d.pop("text")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean / std / median / p90 / p99 / min / max in milliseconds (None when empty)."""
    keys = ["mean", "std", "median", "p90", "p99", "min", "max", "count"]
    if not values_s:
        return {k: (0 if k == "count" else None) for k in keys}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(a, PERCENTILES)
    return {
        "mean": float(a.mean()), "std": float(a.std()), "median": float(p50),
        "p90": float(p90), "p99": float(p99), "min": float(a.min()), "max": float(a.max()),
        "count": int(a.size),
    }


def peak_concurrency(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at once; an interval ending exactly when another starts does not overlap."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals],
                    key=lambda x: (x[0], x[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """Per-request SLO check; ``slo`` maps "ttft"/"tpot"/"itl"/"e2el" to seconds."""
    if not rec.success:
        return False
    checks = {
        "ttft": rec.ttft_s, "tpot": rec.tpot_s, "e2el": rec.e2e_s,
        "itl": max(rec.itl_s) if rec.itl_s else None,
    }
    for k, limit in slo.items():
        v = checks.get(k)
        if v is not None and v > limit:
            return False
    return True


def summarize(records: list[RequestRecord], duration_s: float,
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    dur = duration_s if duration_s > 0 else float("nan")
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itl_s]
    errors = Counter((r.error or "unknown error") for r in failed)
    intervals = [(r.start_s, r.start_s + r.e2e_s) for r in records if r.e2e_s is not None]
    sources = Counter(r.output_tokens_source for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_expected_output_tokens": sum(r.expected_output_tokens for r in ok),
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "peak_concurrency": peak_concurrency(intervals),
        "mean_concurrency": sum(r.e2e_s for r in records if r.e2e_s is not None) / dur,
        "ttft_ms": stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": stats_ms(itls),
        "e2el_ms": stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "output_tokens_source": dict(sources),
        **_cache_hits(ok),
        "errors": dict(errors.most_common()),
    }
    if slo:
        good = sum(1 for r in ok if meets_slo(r, slo))
        summary["slo_s"] = dict(slo)
        summary["good_requests"] = good
        summary["goodput"] = good / dur
    for k, v in list(summary.items()):
        if isinstance(v, float) and math.isnan(v):
            summary[k] = None
    return summary


def _cache_hits(ok: list[RequestRecord]) -> dict[str, Any]:
    """Prompt tokens the server reported as served from its prefix cache, and their share of the
    prompt tokens of the same requests (None where the server reports no cached tokens)."""
    told = [r for r in ok if r.usage_cached_tokens is not None]
    cached = sum(r.usage_cached_tokens or 0 for r in told)
    prompt = sum(r.input_tokens for r in told)
    return {"total_cached_tokens": cached if told else None,
            "cache_hit_rate": cached / prompt if told and prompt else None}


def slo_report(summary: dict[str, Any], slo_p99: dict[str, float],
               max_failed: int = 0) -> tuple[bool, list[str]]:
    """Aggregate SLO check on a summary: each metric's p99 (ms) under its limit (s), few failures."""
    reasons = []
    if summary["completed"] == 0:
        return False, ["no successful requests"]
    if summary["failed"] > max_failed:
        reasons.append(f"{summary['failed']} failed requests")
    for key, limit in slo_p99.items():
        p99 = (summary.get(f"{key}_ms") or {}).get("p99")
        if p99 is not None and p99 > limit * 1000:
            reasons.append(f"p99 {key.upper()} {p99:.0f} ms > {limit * 1000:.0f} ms")
    return not reasons, reasons


def tokens_over_time(records: list[RequestRecord], bin_s: float | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s per time bin, each chunk credited with its request's tokens / chunks."""
    times, weights = [], []
    for r in records:
        if not r.success or r.ttft_s is None or not r.num_chunks:
            continue
        per = r.output_tokens / r.num_chunks
        t = r.start_s + r.ttft_s
        times.append(t)
        weights.append(per)
        for gap in r.itl_s:
            t += gap
            times.append(t)
            weights.append(per)
    if not times:
        return np.zeros(0), np.zeros(0)
    end = max(times)
    if bin_s is None:
        bin_s = max(0.25, end / 60)
    nb = max(1, math.ceil(end / bin_s))
    bin_s = end / nb if end > 0 else bin_s
    hist, edges = np.histogram(times, bins=nb, range=(0, nb * bin_s), weights=weights)
    return edges[:-1] + bin_s / 2, hist / bin_s


def inflight_over_time(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    ev = sorted([(r.start_s, 1) for r in records if r.e2e_s is not None]
                + [(r.start_s + r.e2e_s, -1) for r in records if r.e2e_s is not None],
                key=lambda x: (x[0], x[1]))
    xs, ys, cur = [0.0], [0], 0
    for t, d in ev:
        xs.append(t)
        ys.append(cur)
        cur += d
        xs.append(t)
        ys.append(cur)
    return np.asarray(xs), np.asarray(ys)
