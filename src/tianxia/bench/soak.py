"""Soak load against a running server: many mixed requests at high concurrency, a share of the
streaming clients hanging up mid-stream, then a check that nothing leaked.

The mix (drawn from a seeded RNG, so a run can be repeated): completions and chat, streamed or
not, ``n`` of 1 to 3, logprobs, stop strings, seeds, structured output (JSON schema, choice,
``json_object``). Every request must end as *completed* (a 200 with a well-formed body or stream)
or *disconnected* (the client hung up on purpose); anything else counts as an error. Afterwards
the server must be idle: no request running or waiting, KV cache usage 0, ``/health`` 200, and
each admitted request counted once as finished (stop or length) or aborted.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tianxia.server.testing import metric

_WORDS = ("river", "stone", "garden", "planet", "music", "winter", "engine", "market", "forest")
_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
_FINISHED = ("stop", "length", "abort")


@dataclass
class SoakReport:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)  # completed / disconnected / rejected / error
    features: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    finished_delta: dict[str, float] = field(default_factory=dict)  # engine's count, by reason
    idle_after_s: float = 0.0
    kv_usage_after: float | None = None
    running_after: float | None = None
    waiting_after: float | None = None
    health_after: int = 0
    rss_before: int | None = None
    rss_after: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "outcomes": dict(self.outcomes),
            "features": dict(self.features),
            "errors": self.errors[:20],
            "duration_s": round(self.duration_s, 1),
            "finished_delta": self.finished_delta,
            "idle_after_s": round(self.idle_after_s, 2),
            "kv_usage_after": self.kv_usage_after,
            "running_after": self.running_after,
            "waiting_after": self.waiting_after,
            "health_after": self.health_after,
            "rss_before_mib": None if self.rss_before is None else round(self.rss_before / 2**20, 1),
            "rss_after_mib": None if self.rss_after is None else round(self.rss_after / 2**20, 1),
        }


def make_request(rng: random.Random, model: str, max_tokens: int) -> tuple[str, dict, set[str]]:
    """One request of the mix: (path, body, features it uses)."""
    chat = rng.random() < 0.5
    feats = {"chat" if chat else "completion"}
    topic = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 6)))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(2, max_tokens)}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Say something about {topic}."}]
    else:
        body["prompt"] = f"A short note about {topic}:"
    if rng.random() < 0.5:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        feats.add("stream")
    if rng.random() < 0.25:
        body["n"] = rng.randint(2, 3)
        feats.add("n>1")
    if rng.random() < 0.25:
        if chat:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        else:
            body["logprobs"] = rng.randint(0, 3)
        feats.add("logprobs")
    if rng.random() < 0.25:
        body["stop"] = rng.sample(_WORDS, rng.randint(1, 3)) + ["\n\n"]
        feats.add("stop")
    if rng.random() < 0.5:
        body["seed"] = rng.randint(0, 2**31)
        body["temperature"] = 0.8
        feats.add("seed")
    else:
        body["temperature"] = rng.choice([0.0, 0.7, 1.0])
    r = rng.random()
    if r < 0.06:
        body["guided_json"] = _SCHEMA
        feats.add("structured")
    elif r < 0.12:
        body["guided_choice"] = ["yes", "no", "maybe"]
        feats.add("structured")
    elif r < 0.15 and chat:
        body["response_format"] = {"type": "json_object"}
        feats.add("structured")
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, feats


def _check_json(body: dict, n: int) -> str | None:
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        return f"expected {n} choices: {str(body)[:200]}"
    if any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        return f"unfinished choice: {str(body)[:200]}"
    return None


def _check_stream(events: list[str], n: int) -> str | None:
    if not events or events[-1] != "[DONE]":
        return f"stream without [DONE]: {events[-3:]}"
    finished: set[int] = set()
    for e in events[:-1]:
        chunk = json.loads(e)
        if "error" in chunk:
            return f"error event: {e[:200]}"
        for c in chunk.get("choices", []):
            if c.get("finish_reason"):
                finished.add(c["index"])
    if len(finished) != n:
        return f"{len(finished)} of {n} choices finished"
    return None


async def _one(
    client: httpx.AsyncClient, path: str, body: dict, hang_up_after: int | None
) -> tuple[str, str | None]:
    n = body.get("n", 1)
    if not body.get("stream"):
        r = await client.post(path, json=body)
        if r.status_code == 503:
            return "rejected", None
        if r.status_code != 200:
            return "error", f"{r.status_code} {r.text[:200]}"
        err = _check_json(r.json(), n)
        return ("error", err) if err else ("completed", None)
    async with client.stream("POST", path, json=body) as r:
        if r.status_code == 503:
            return "rejected", None
        if r.status_code != 200:
            await r.aread()
            return "error", f"{r.status_code} {r.text[:200]}"
        events: list[str] = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if hang_up_after is not None and len(events) >= hang_up_after:
                    return "disconnected", None  # leaving the block closes the connection
    err = _check_stream(events, n)
    return ("error", err) if err else ("completed", None)


async def _scrape(client: httpx.AsyncClient, model: str) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    out = {
        name: metric(text, f"vllm:{name}", model_name=model) or 0.0
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    }
    for reason in _FINISHED:
        out[reason] = (
            metric(text, "vllm:request_success_total", model_name=model, finished_reason=reason)
            or 0.0
        )
    return out


async def run_soak(
    url: str,
    *,
    model: str,
    num_requests: int,
    concurrency: int,
    api_key: str | None = None,
    disconnect_fraction: float = 0.2,
    max_tokens: int = 24,
    seed: int = 0,
    rss: Callable[[], int] | None = None,
    idle_timeout_s: float = 120.0,
) -> SoakReport:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    report = SoakReport(requests=num_requests)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as c:
        before = await _scrape(c, model)
        report.rss_before = rss() if rss else None
        jobs = []
        for _ in range(num_requests):
            path, body, feats = make_request(rng, model, max_tokens)
            hang_up = None
            if rng.random() < disconnect_fraction:
                # a fifth of the clients go away mid-stream, after one to three events
                body["stream"] = True
                body.pop("stream_options", None)
                body["max_tokens"] = max(body["max_tokens"], 8)
                body["ignore_eos"] = True
                hang_up = rng.randint(1, 3)
                feats = feats | {"stream", "disconnect"}
            report.features.update(feats)
            jobs.append((path, body, hang_up))
        sem = asyncio.Semaphore(concurrency)

        async def guarded(job):
            async with sem:
                try:
                    return await _one(c, *job)
                except httpx.HTTPError as e:
                    return "error", f"{type(e).__name__}: {e}"

        t0 = time.monotonic()
        results = await asyncio.gather(*(guarded(j) for j in jobs))
        report.duration_s = time.monotonic() - t0
        for outcome, err in results:
            report.outcomes[outcome] += 1
            if err:
                report.errors.append(err)
        t1 = time.monotonic()
        while True:
            after = await _scrape(c, model)
            idle = (after["num_requests_running"], after["num_requests_waiting"],
                    after["kv_cache_usage_perc"]) == (0.0, 0.0, 0.0)
            if idle or time.monotonic() - t1 > idle_timeout_s:
                break
            await asyncio.sleep(0.2)
        report.idle_after_s = time.monotonic() - t1
        report.running_after = after["num_requests_running"]
        report.waiting_after = after["num_requests_waiting"]
        report.kv_usage_after = after["kv_cache_usage_perc"]
        report.finished_delta = {r: after[r] - before[r] for r in _FINISHED}
        report.health_after = (await c.get("/health")).status_code
        report.rss_after = rss() if rss else None
    return report


def process_rss(pid: int) -> Callable[[], int]:
    """Resident memory of process ``pid`` in bytes, read from ``/proc``."""

    def read() -> int:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for process {pid}")

    return read
