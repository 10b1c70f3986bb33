"""Send a workload to an OpenAI-compatible server and time every streamed chunk.

One ``aiohttp.ClientSession``; each request is a streamed POST to ``/v1/completions`` or
``/v1/chat/completions`` with ``stream_options.include_usage``. Requests start on a Poisson /
gamma / constant arrival schedule (``request_rate``, ``burstiness``) and/or behind a semaphore of
``max_concurrency``. To get exact output lengths the payload carries ``ignore_eos`` and
``min_tokens``; a server that rejects a field (HTTP 400/422 naming it) is retried once without it,
later requests leave it out, and the result notes it. A request whose kept-alive connection the
server had already closed (llama-server's HTTP library closes one after a response that outlived
its keep-alive timeout, while the response still said ``keep-alive``) is sent again on a new
connection, once, and the result notes how many were. The turns of a multi-turn conversation go
one after the other, each carrying the earlier turns and the replies the server gave;
conversations arrive on the schedule. Failures (connection errors, HTTP errors, error events in
the stream, empty streams) are recorded per request, never raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from tianxia.bench.metrics import RequestRecord
from tianxia.bench.workloads import BenchRequest

EXTRA_FIELDS = ("ignore_eos", "min_tokens")


@dataclass
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    request_rate: float = math.inf
    burstiness: float = 1.0  # gamma shape; 1 = Poisson, inf = constant intervals
    max_concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    api_key: str | None = None
    seed: int = 0
    save_text: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return endpoint_url(self.base_url, self.endpoint)


def endpoint_url(base_url: str, endpoint: str) -> str:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    return base + ("/chat/completions" if endpoint == "chat" else "/completions")


class _Shared:
    """State shared by the requests of one run: which extra fields the server accepts."""

    def __init__(self, cfg: ClientConfig) -> None:
        self.extras_ok = {k: cfg.ignore_eos for k in EXTRA_FIELDS}
        self.notes: list[str] = []
        self.inflight = 0
        self.failed = 0
        self.resent = 0  # requests sent again after their pooled connection turned out closed
        self.fresh: aiohttp.ClientSession | None = None  # a new connection for each of those


# A pooled connection the server closed fails the next request before any status arrives: the
# write of its body fails, or the server's close (a reset) is all that comes back. Nothing of that
# request was answered, so it goes once more, on a connection of its own (the pool may hold more
# connections the server closed at the same moment). A refused connection (ClientConnectorError,
# itself a ClientOSError) or a read timeout (none of these) is an answer about the server, and is
# not retried.
_STALE_ERRORS = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError,
                 aiohttp.ClientConnectionResetError)


def _closed_keep_alive(e: BaseException) -> bool:
    return isinstance(e, _STALE_ERRORS) and not isinstance(e, aiohttp.ClientConnectorError)


async def _post(client: aiohttp.ClientSession, url: str, body: dict, headers: dict,
                shared: _Shared) -> aiohttp.ClientResponse:
    try:
        return await client.post(url, json=body, headers=headers)
    except Exception as e:
        if shared.fresh is None or not _closed_keep_alive(e):
            raise
    shared.resent += 1
    return await shared.fresh.post(url, json=body, headers=headers)


def build_payload(cfg: ClientConfig, req: BenchRequest, shared: _Shared) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = req.chat_messages()
    else:
        body["prompt"] = req.completion_prompt()
    if shared.extras_ok.get("ignore_eos"):
        body["ignore_eos"] = True
    if shared.extras_ok.get("min_tokens"):
        body["min_tokens"] = req.output_len
    body.update(cfg.extra_body)
    return body


def _rejected_fields(status: int, text: str, body: dict[str, Any]) -> list[str]:
    """Extra fields to drop after a 400/422 that looks like 'unknown field' (empty: not that)."""
    if status not in (400, 422):
        return []
    sent = [k for k in EXTRA_FIELDS if k in body]
    if not sent:
        return []
    low = text.lower()
    named = [k for k in sent if k in low]
    if named:
        return named
    if any(w in low for w in ("extra", "unknown", "unrecognized", "unexpected", "not permitted",
                              "not allowed", "unsupported")):
        return sent
    return []


def _chunk_text(obj: dict[str, Any], chat: bool) -> tuple[str, str | None]:
    choices = obj.get("choices") or []
    if not choices:
        return "", None
    c = choices[0] or {}
    if chat:
        delta = c.get("delta") or {}
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    else:
        text = c.get("text") or ""
    return text, c.get("finish_reason")


async def send_request(client: aiohttp.ClientSession, cfg: ClientConfig, req: BenchRequest,
                       shared: _Shared, t0: float) -> RequestRecord:
    rec = RequestRecord(index=req.index, expected_input_tokens=req.input_len,
                        expected_output_tokens=req.output_len)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    chat = cfg.endpoint == "chat"
    body = build_payload(cfg, req, shared)
    st = time.perf_counter()
    rec.start_s = st - t0
    texts: list[str] = []
    try:
        for _attempt in range(len(EXTRA_FIELDS) + 1):
            resp = await _post(client, cfg.url, body, headers, shared)
            async with resp:
                rec.http_status = resp.status
                if resp.status != 200:
                    raw = (await resp.read()).decode("utf-8", "replace")
                    drop = _rejected_fields(resp.status, raw, body)
                    if drop:
                        for k in drop:
                            body.pop(k, None)
                            if shared.extras_ok.get(k):
                                shared.extras_ok[k] = False
                                shared.notes.append(
                                    f"server rejected '{k}' (HTTP {resp.status}); "
                                    "retried and sent without it")
                        rec.dropped_fields.extend(drop)
                        st = time.perf_counter()  # time the retry, not the rejection
                        rec.start_s = st - t0
                        continue
                    rec.error = f"HTTP {resp.status}: {_error_message(raw)}"
                    break
                last = st
                async for now, data in sse_data(resp):
                    if data == b"[DONE]":
                        break
                    try:
                        obj = _decode_json(data)
                    except msgspec.DecodeError:
                        rec.error = f"bad SSE data: {data[:120].decode('utf-8', 'replace')}"
                        break
                    if obj.get("error"):
                        rec.error = f"stream error: {_error_message(json.dumps(obj))}"
                        break
                    text, finish = _chunk_text(obj, chat)
                    if finish:
                        rec.finish_reason = finish
                    if text:
                        if rec.ttft_s is None:
                            rec.ttft_s = now - st
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        rec.num_chunks += 1
                        texts.append(text)
                    usage = obj.get("usage")
                    if usage:
                        if usage.get("prompt_tokens") is not None:
                            rec.usage_prompt_tokens = int(usage["prompt_tokens"])
                        if usage.get("completion_tokens") is not None:
                            rec.usage_completion_tokens = int(usage["completion_tokens"])
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                        if cached is not None:
                            rec.usage_cached_tokens = int(cached)
                break
        rec.e2e_s = time.perf_counter() - st
        if rec.error is None and rec.num_chunks == 0:
            rec.error = "no generated text in the response stream"
        rec.success = rec.error is None
    except (aiohttp.ClientError, OSError) as e:  # (TimeoutError is an OSError)
        rec.e2e_s = time.perf_counter() - st
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a benchmark never dies on one bad response
        rec.e2e_s = time.perf_counter() - st
        rec.error = f"{type(e).__name__}: {e}"
    rec.text = "".join(texts)
    return rec


_decode_json = msgspec.json.Decoder().decode


async def sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, bytes]]:
    """The non-empty ``data:`` fields of a server-sent event stream, each with the time the read
    that completed it arrived, split from the raw bytes of each read.

    A load generator parses one event per token of every stream it runs, so its cost per event
    caps what it can measure: aiohttp (whose HTTP parser is in C, as vLLM's benchmark client
    uses) took about 20 us of CPU per event where httpx took 100-115 (its pure-Python chunked
    reader and the layers above it), enough for one httpx process to fall behind a fast server."""
    pending = b""
    async for piece in resp.content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data:
                    yield now, data
    if pending.startswith(b"data:") and pending[5:].strip():
        yield time.perf_counter(), pending[5:].strip()


def _error_message(raw: str) -> str:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return raw.strip()[:200] or "(empty body)"
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        msg = err.get("message") or err.get("detail") or json.dumps(err)
    else:
        msg = str(err)
    if isinstance(msg, (list, dict)):
        msg = json.dumps(msg)
    return str(msg)[:200]


def _warmup_request(first: BenchRequest, w: int) -> BenchRequest:
    """Like the first request, but with its words reversed, so that it leaves nothing in a
    prefix cache that a measured request could hit."""

    def flip(text: str) -> str:
        return " ".join(reversed(text.split(" ")))

    msgs = None
    if first.messages is not None:
        msgs = [dict(m, content=flip(m["content"])) if isinstance(m.get("content"), str) else m
                for m in first.messages]
    return BenchRequest(-1 - w, flip(first.prompt), min(first.output_len, 4),
                        system=flip(first.system) if first.system else None, messages=msgs)


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: 0 for an infinite rate; gamma(shape=b, scale=1/(rate*b)) else."""
    if n <= 0:
        return []
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    if math.isinf(burstiness):
        return [0.0] + [1.0 / rate] * (n - 1)
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(n - 1)]


async def run_async(cfg: ClientConfig, requests: list[BenchRequest], *, progress: bool = True,
                    desc: str = "bench", warmup: int = 1
                    ) -> tuple[list[RequestRecord], float, list[str], float]:
    """Run the workload; returns (records in request order, duration_s, notes, the start on the
    host's monotonic clock: what a server on the same host logs its times on)."""
    from tqdm.auto import tqdm

    shared = _Shared(cfg)
    limit = cfg.max_concurrency
    # the timeout is per read (a stream may run longer), as a client's read timeout is
    timeout = aiohttp.ClientTimeout(total=None, sock_read=cfg.timeout_s,
                                    sock_connect=min(30.0, cfg.timeout_s))
    connector = aiohttp.TCPConnector(limit=limit or 0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                  timeout=timeout) as shared.fresh:
        # warm-up: not counted; finds out early whether the extra fields are accepted
        for w in range(warmup if requests else 0):
            wreq = _warmup_request(requests[0], w)
            wrec = await send_request(client, cfg, wreq, shared, time.perf_counter())
            if not wrec.success:
                shared.notes.append(f"warm-up request failed: {wrec.error}")
                break
        sem = asyncio.Semaphore(limit) if limit else None
        bar = tqdm(total=len(requests), desc=desc, disable=not progress, unit="req",
                   dynamic_ncols=True, leave=True)
        records: list[RequestRecord | None] = [None] * len(requests)

        async def one(i: int, req: BenchRequest, t0: float) -> RequestRecord:
            if sem is not None:
                await sem.acquire()
            shared.inflight += 1
            bar.set_postfix_str(f"in flight {shared.inflight}, failed {shared.failed}", refresh=False)
            try:
                rec = await send_request(client, cfg, req, shared, t0)
            finally:
                shared.inflight -= 1
                if sem is not None:
                    sem.release()
            records[i] = rec
            if not rec.success:
                shared.failed += 1
            bar.set_postfix_str(f"in flight {shared.inflight}, failed {shared.failed}", refresh=False)
            bar.update(1)
            return rec

        async def conversation(turns: list[tuple[int, BenchRequest]], t0: float) -> None:
            """A conversation's turns, each sent when the last one's reply is in."""
            history: list[tuple[str, str]] = []
            for k, (i, req) in enumerate(turns):
                rec = await one(i, dataclasses.replace(req, history=list(history)), t0)
                if not rec.success:
                    for j, rest in turns[k + 1:]:
                        records[j] = RequestRecord(
                            index=rest.index, expected_output_tokens=rest.output_len,
                            error="not sent: an earlier turn of its conversation failed")
                    bar.update(len(turns) - k - 1)
                    return
                history.append((req.prompt, rec.text or ""))

        # what arrives on the schedule: a request, or a conversation (its first turn)
        units: dict[object, list[tuple[int, BenchRequest]]] = {}
        for i, req in enumerate(requests):
            key = ("c", req.conversation) if req.conversation is not None else ("r", i)
            units.setdefault(key, []).append((i, req))
        delays = arrival_delays(len(units), cfg.request_rate, cfg.burstiness, cfg.seed)
        tasks = []
        t0, t0_monotonic = time.perf_counter(), time.monotonic()
        next_t = t0
        for (kind, _), turns, d in zip(units, units.values(), delays):
            next_t += d
            wait = next_t - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            run_one = conversation(turns, t0) if kind == "c" else one(*turns[0], t0)
            tasks.append(asyncio.create_task(run_one))
            if wait <= 0:
                # let it connect and send before the next one is built: at rate inf, building all
                # N requests first (aiohttp, ~0.5 ms each) kept the first from the server for
                # N x 0.5 ms, time inside the measured window when no client sent anything
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        duration = max((r.start_s + (r.e2e_s or 0.0) for r in records if r), default=0.0)
        bar.close()
    if shared.resent:
        shared.notes.append(f"{shared.resent} request(s) sent again on a new connection: the server "
                            "had closed the kept-alive connection they were first sent on")
    return [r for r in records if r is not None], duration, shared.notes, t0_monotonic


def run(cfg: ClientConfig, requests: list[BenchRequest], **kw):
    return asyncio.run(run_async(cfg, requests, **kw))


def count_output_tokens(records: list[RequestRecord], tokenizer, keep_text: bool) -> None:
    """Fill input/output token counts: usage first, else our tokenizer, else chunk counts."""
    for r in records:
        if tokenizer is not None and r.text:
            r.counted_output_tokens = len(tokenizer(r.text, add_special_tokens=False)["input_ids"])
        if r.usage_completion_tokens is not None:
            r.output_tokens, r.output_tokens_source = r.usage_completion_tokens, "usage"
        elif r.counted_output_tokens is not None:
            r.output_tokens, r.output_tokens_source = r.counted_output_tokens, "tokenizer"
        else:
            r.output_tokens, r.output_tokens_source = r.num_chunks, "chunks"
        if r.usage_prompt_tokens is not None:
            r.input_tokens = r.usage_prompt_tokens
        else:
            r.input_tokens = r.expected_input_tokens or 0
        if not keep_text:
            r.text = None
