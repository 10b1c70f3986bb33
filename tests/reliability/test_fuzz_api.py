"""Property-based fuzzing of every endpoint from the server's own OpenAPI schema (schemathesis).

Both of schemathesis' modes run against a real server: *positive* cases fit the schema (they must
be served or refused with a 4xx), *negative* ones break it on purpose (wrong types, missing and
unknown fields, out-of-range values). Whatever comes in: never a 5xx, every rejection an
OpenAI-shaped error with a message, and no error event inside a 200 stream.
"""

from __future__ import annotations

import json

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from reliability_helpers import API_KEY, assert_openai_error
from schemathesis.core.transport import DEFAULT_MAX_STREAM_EVENTS

# generation endpoints get more examples than the read-only ones; the total stays near a minute
EXAMPLES = {"POST": 40, "GET": 8}


@pytest.fixture(scope="module")
def api_schema(tiny):
    raw = httpx.get(tiny.url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"})
    assert raw.status_code == 200
    return schemathesis.openapi.from_dict(raw.json())


def check_response(resp, where: str) -> None:
    assert resp.status_code < 500, f"{where}: {resp.status_code} {resp.text[:500]}"
    ctype = resp.headers.get("content-type", "")
    ctype = ctype[0] if isinstance(ctype, list) else ctype  # schemathesis keeps header lists
    if resp.status_code >= 400:
        assert_openai_error(httpx.Response(resp.status_code, content=resp.content))
    elif ctype.startswith("text/event-stream"):
        events = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
        assert events, f"{where}: {resp.text[-300:]}"
        if events[-1] == "[DONE]":
            events = events[:-1]
        else:
            # schemathesis stops reading a stream after this many events (a long generation)
            assert len(events) >= DEFAULT_MAX_STREAM_EVENTS, f"{where}: {resp.text[-300:]}"
        for e in events:
            assert "error" not in json.loads(e), f"{where}: {e}"


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE,
                                  schemathesis.GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_5xx_and_openai_errors_on_every_endpoint(api_schema, tiny, mode):
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {API_KEY}"
    operations = [r.ok() for r in api_schema.get_all_operations()]
    labels = {op.label for op in operations}
    for needed in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
                   "POST /detokenize", "GET /v1/models"):
        assert needed in labels, labels
    calls = 0
    for op in operations:
        @settings(max_examples=EXAMPLES.get(op.method.upper(), 8), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            nonlocal calls
            calls += 1
            resp = case.call(base_url=tiny.url, session=session, timeout=120)
            check_response(resp, f"{case.operation.label} {str(case.body)[:300]}")

        try:
            run()
        except Unsatisfiable:
            # an operation without parameters or body has no way to be called wrongly
            assert mode is schemathesis.GenerationMode.NEGATIVE, op.label
    print(f"schemathesis {mode.value}: {calls} requests over {len(operations)} operations")
    assert calls >= len(operations)
    assert httpx.get(tiny.url + "/health").status_code == 200
