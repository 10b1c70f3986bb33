"""The documented request limits, each refused with an OpenAI-shaped 4xx that names the field:
body size (413), prompt length (the context), n, stop strings (count and length), max_tokens,
logprobs. Just under each limit is served."""

from __future__ import annotations

import httpx
import pytest
from reliability_helpers import API_KEY, assert_openai_error

from tianxia.sampling_params import MAX_LOGPROBS, MAX_STOP, MAX_STOP_LEN
from tianxia.server.api import DEFAULT_MAX_REQUEST_BYTES
from tianxia.server.serving_base import MAX_N

MAX_MODEL_LEN = 64  # the tiny server's --max-model-len


@pytest.fixture(scope="module")
def http(tiny):
    with httpx.Client(base_url=tiny.url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def refused(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text[:300]
    err = assert_openai_error(r)
    if param is not None:
        assert err["param"] == param, err
    return err


def test_body_size_413(http):
    big = {"prompt": "a" * (DEFAULT_MAX_REQUEST_BYTES + 10), "max_tokens": 1}
    err = refused(http.post("/v1/completions", json=big), 413, None)
    assert err["code"] == "request_too_large" and str(DEFAULT_MAX_REQUEST_BYTES) in err["message"]

    # a chunked body (no Content-Length) is counted as it arrives
    def chunks():
        yield b'{"prompt": "'
        for _ in range(DEFAULT_MAX_REQUEST_BYTES // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    refused(r, 413, None)


def test_prompt_length(http):
    r = http.post("/v1/completions", json={"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1})
    assert refused(r, 400, "prompt")["code"] == "context_length_exceeded"
    ok = http.post("/v1/completions", json={"prompt": [5] * (MAX_MODEL_LEN - 1), "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_max_tokens(http):
    for bad in (0, -1, MAX_MODEL_LEN):
        refused(http.post("/v1/completions", json={"prompt": [5], "max_tokens": bad}), 400,
                "max_tokens")
    ok = http.post("/v1/completions", json={"prompt": [5], "max_tokens": MAX_MODEL_LEN - 1,
                                            "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 1


def test_n(http):
    for bad in (0, -5, MAX_N + 1, 10**30):
        refused(http.post("/v1/completions", json={"prompt": "hi", "n": bad, "max_tokens": 1}),
                400, "n")
    ok = http.post("/v1/completions", json={"prompt": "hi", "n": MAX_N, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == MAX_N


def test_stop_strings(http):
    body = {"prompt": "hi", "max_tokens": 2}
    refused(http.post("/v1/completions", json={**body, "stop": ["x"] * (MAX_STOP + 1)}), 400,
            "stop")
    refused(http.post("/v1/completions", json={**body, "stop": ["x" * (MAX_STOP_LEN + 1)]}), 400,
            "stop")
    err = refused(http.post("/v1/completions", json={**body, "stop": ["y" * 100_000]}), 400, "stop")
    assert len(err["message"]) < 1000  # the refused value is not echoed back in full
    ok = http.post("/v1/completions",
                   json={**body, "stop": [f"{i:02d}" * (MAX_STOP_LEN // 2) for i in range(MAX_STOP)]})
    assert ok.status_code == 200, ok.text


def test_logprobs(http):
    refused(http.post("/v1/completions", json={"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}),
            400, "logprobs")
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
        "top_logprobs": MAX_LOGPROBS + 1})
    refused(r, 400, "top_logprobs")
