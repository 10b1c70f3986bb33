"""``tianxia serve`` under pressure and at shutdown: a full waiting queue answers 503 with
``Retry-After``; SIGTERM refuses new work, lets the streams in flight finish until
``--shutdown-timeout``, ends the ones still running with an error event, and exits 0.

One server process for the module (two sequences at a time, one waiting slot); the last test
ends it.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
import openai
import pytest

from tianxia.server.testing import ServerProcess, metric

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
SHUTDOWN_TIMEOUT = 15


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = ServerProcess([
        MODEL, "--kv-cache-memory", "1GiB", "--max-model-len", "8192", "--max-num-seqs", "2",
        "--max-waiting-requests", "1", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
    ])
    srv.start()
    yield srv
    srv.stop()


def wait_for(http: httpx.Client, name: str, value: float, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(http.get("/metrics").text, name, model_name=MODEL) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.1)


def open_stream(stack: ExitStack, http: httpx.Client, **body) -> tuple[httpx.Response, object]:
    """Start a streamed completion and wait for its first event (so it is running)."""
    r = stack.enter_context(http.stream("POST", "/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "ignore_eos": True, "stream": True, "temperature": 0,
        **body,
    }))
    assert r.status_code == 200
    lines = r.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    return r, (line for seq in ([first], lines) for line in seq)


def test_serve_help_lists_vllm_flags():
    r = subprocess.run([sys.executable, "-m", "tianxia.cli", "serve", "--help"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    for flag in ("--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--kv-cache-memory", "--gpu-memory-utilization",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--seed", "--dtype",
                 "--device", "--threads", "--chat-template", "--api-key", "--max-waiting-requests",
                 "--log-level", "--shutdown-timeout"):
        assert flag in r.stdout, flag


def test_no_api_key_configured_means_open(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="anything", max_retries=0,
                           timeout=300)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_503_with_retry_after_when_waiting_queue_is_full(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    with httpx.Client(base_url=server.url, timeout=300) as http, ExitStack() as stack:
        # two requests run (--max-num-seqs 2) (keep their line iterators: dropping one closes
        # its connection, which aborts the request) ...
        running = [open_stream(stack, http, max_tokens=1500) for _ in range(2)]
        wait_for(http, "vllm:num_requests_running", 2.0)
        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(1))
        # ... one waits (--max-waiting-requests 1) ...
        waiting = pool.submit(client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=2,
                              temperature=0)
        wait_for(http, "vllm:num_requests_waiting", 1.0)
        # ... and the next one is turned away
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "queue_full"
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503
        text = http.get("/metrics").text
        assert metric(text, "tianxia:requests_rejected_total", model_name=MODEL) == 2
        # leaving the streams aborts them; the waiting request then runs
        for resp, _ in running:
            resp.close()
        assert waiting.result(timeout=300).usage.completion_tokens >= 1


def test_sigterm_drains_then_exits_0(server):
    """SIGTERM mid-stream: new connections are refused, a short stream finishes normally, a long
    one is ended at --shutdown-timeout with an error event, and the process exits 0."""
    short_tokens = 8
    with httpx.Client(base_url=server.url, timeout=300) as http, ExitStack() as stack:
        _, short = open_stream(stack, http, max_tokens=short_tokens,
                               stream_options={"include_usage": True})
        # longer than any CPU decodes in SHUTDOWN_TIMEOUT (2,000 tokens took 11-15 s on 2 cores)
        _, long = open_stream(stack, http, max_tokens=8000)
        t0 = time.monotonic()
        server.signal(signal.SIGTERM)
        # no new work: the listening socket closes (or, in the instant before, a 503)
        while True:
            try:
                status = httpx.get(server.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                break
            if status == 503:
                break
            assert time.monotonic() - t0 < 30, "the server kept accepting after SIGTERM"
            time.sleep(0.05)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            short_f = pool.submit(lambda: [ln[6:] for ln in short if ln.startswith("data: ")])
            long_f = pool.submit(lambda: [ln[6:] for ln in long if ln.startswith("data: ")])
            short_events, long_events = short_f.result(300), long_f.result(300)
        long_ended = time.monotonic() - t0
    # the short stream completed normally
    assert short_events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in short_events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == short_tokens
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # the long one was cut at the deadline, with an error the client can see
    assert long_events[-1] == "[DONE]"
    assert json.loads(long_events[-2])["error"]["code"] == "server_shutting_down"
    assert long_ended >= SHUTDOWN_TIMEOUT - 1
    assert server.wait(timeout=120) == 0
    log = server.log()
    assert "Application shutdown complete" in log and "Traceback" not in log
    assert "aborted 1 request(s)" in log
