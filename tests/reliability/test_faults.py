"""Faults: a fault inside one request's processing (NaN logits, the detokenizer, the grammar
matcher) fails that request alone, with a clear error, while the requests batched with it finish;
a fault in the engine loop itself makes /health 503 and the process exit 1; a truncated or
corrupt model file fails at start-up with one ``error:`` line and exit 1.

Faults are armed with ``TIANXIA_FAULT_INJECT`` (see ``tianxia/engine/faults.py``) and fire only
for prompts that carry their trigger, at the place where a real fault of that kind happens.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import pytest
from reliability_helpers import API_KEY, FAULTS, MODEL, assert_openai_error, auth_client

from tianxia.server.testing import ServerProcess, free_port, metric

PROMPT = "Write a sentence about the sea."
TOKENS = 24


def stream_events(http: httpx.Client, body: dict) -> list[str]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]


def full_completion(http: httpx.Client, i: int) -> int:
    events = stream_events(http, {"model": MODEL, "prompt": f"{PROMPT} ({i})", "max_tokens": TOKENS,
                                  "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return chunks[-1]["usage"]["completion_tokens"]


def faulty_body(kind: str) -> dict:
    body = {"model": MODEL, "prompt": f"{PROMPT} {FAULTS[kind]}", "max_tokens": TOKENS}
    if kind == "grammar":
        body["guided_choice"] = ["calm", "rough"]
    return body


@pytest.mark.parametrize("kind", ["nan", "detokenize", "grammar"])
def test_request_fault_fails_that_request_only(guarded, kind):
    with auth_client(guarded.url) as http, concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(full_completion, http, i) for i in range(4)]
        time.sleep(0.5)  # the others are running when the faulty request joins their batch
        plain = pool.submit(http.post, "/v1/completions", json=faulty_body(kind))
        streamed = pool.submit(stream_events, http, faulty_body(kind))
        r = plain.result(timeout=300)
        assert r.status_code == 500, r.text
        err = assert_openai_error(r)
        assert err["code"] == "request_failed" and "failed" in err["message"], err
        if kind == "nan":
            assert "NaN" in err["message"]
        events = streamed.result(timeout=300)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_failed"
        assert [f.result(timeout=300) for f in others] == [TOKENS] * 4
        deadline = time.monotonic() + 30
        while True:
            text = http.get("/metrics").text
            if metric(text, "vllm:kv_cache_usage_perc", model_name=MODEL) == 0.0:
                break
            assert time.monotonic() < deadline, "KV blocks of the failed request were not freed"
            time.sleep(0.2)
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("core", ["process", "thread"])
def test_engine_loop_fault_exits_nonzero(tiny_llama, core):
    trigger = "@@engine-crash@@"
    srv = ServerProcess([str(tiny_llama), "--api-key", API_KEY, "--max-model-len", "64",
                         "--kv-cache-memory", "16MiB", "--engine-core", core],
                        env={"TIANXIA_FAULT_INJECT": f"engine_loop:{trigger}"})
    srv.start()
    try:
        with auth_client(srv.url, timeout=60) as http:
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}
                             ).status_code == 200
            r = http.post("/v1/completions", json={"prompt": f"hi {trigger}", "max_tokens": 2})
            assert r.status_code == 503, r.text
            err = assert_openai_error(r)
            assert err["code"] == "engine_dead" and "engine loop failed" in err["message"], err
            # never a hung server: /health says 503 until the process is gone
            while srv.proc.poll() is None:
                try:
                    assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        assert srv.wait(timeout=60) == 1
        assert "the engine loop died" in srv.log()
    finally:
        srv.stop()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_model_file_fails_at_startup(smollm2_path, tmp_path, damage):
    bad = tmp_path / f"{damage}.gguf"
    data = smollm2_path.read_bytes()
    bad.write_bytes(data[: len(data) // 5] if damage == "truncated" else bytes(range(256)) * 64)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tianxia.cli", "serve", str(bad), "--port",
                        str(free_port())], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(bad) in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 120
