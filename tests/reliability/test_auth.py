"""API keys: with ``--api-key`` (or ``TIANXIA_API_KEY``) every /v1 and admin route needs
``Authorization: Bearer KEY``; /health and /version stay open; /metrics is open unless
``--metrics-require-auth``. The key never appears in the server's log output."""

from __future__ import annotations

import httpx
import pytest
from reliability_helpers import API_KEY, MODEL, assert_openai_error

from tianxia.server.testing import ServerProcess

PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("GET", "/v1/no-such-route", None),
]


def call(url: str, method: str, path: str, body, headers: dict) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("method, path, body", PROTECTED)
def test_protected_routes_need_the_key(guarded, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": f"Bearer {API_KEY}x"}):
        r = call(guarded.url, method, path, body, headers)
        assert r.status_code == 401, (headers, r.text)
        assert assert_openai_error(r)["code"] == "invalid_api_key"
        assert r.headers["WWW-Authenticate"] == "Bearer"
    r = call(guarded.url, method, path, body, {"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == (404 if "no-such" in path else 200), r.text


def test_open_routes_and_no_key_in_logs(guarded):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(guarded.url + path, timeout=30).status_code == 200
    assert API_KEY not in guarded.log()


def test_env_key_and_metrics_auth(tiny_llama):
    key = "env-key-only-in-env-7d2a"
    srv = ServerProcess([str(tiny_llama), "--max-model-len", "64", "--kv-cache-memory", "16MiB",
                         "--metrics-require-auth", "--log-level", "debug"],
                        env={"TIANXIA_API_KEY": key})
    with srv:
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.get(srv.url + "/metrics")
        assert r.status_code == 401 and assert_openai_error(r)
        assert httpx.get(srv.url + "/metrics", headers=auth).status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers=auth, timeout=60)
        assert r.status_code == 200
    log = srv.log()
    assert "API key required" in log  # the log says a key is set ...
    assert key not in log  # ... never which, even at debug level
