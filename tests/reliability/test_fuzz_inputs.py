"""Hypothesis fuzzing of what clients send: ``SamplingParams`` (in-process), chat messages, and raw
request bodies (invalid UTF-8, deep nesting, huge numbers, enormous strings) against a real server.

``SamplingParams`` either builds or raises ``ValueError`` naming the field; the server answers
every body with a success or an OpenAI-shaped 4xx, and stays healthy.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_helpers import API_KEY, assert_openai_error

from tianxia.sampling_params import SamplingParams
from tianxia.server import protocol

ANY_SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
)
ANY_JSON = st.recursive(
    ANY_SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                              inner, max_size=4),
    max_leaves=12,
)
FIELDS = [f for f in SamplingParams.__dataclass_fields__ if not f.startswith("_")]


@settings(max_examples=400, deadline=None, database=None)
@given(st.dictionaries(st.sampled_from(FIELDS), ANY_JSON, max_size=6))
def test_sampling_params_build_or_raise_value_error(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert str(e), kwargs
        assert len(str(e)) < 2000  # the message goes to the client: no echo of huge values
        return
    # what was accepted is usable: integers where the engine indexes, finite where it computes
    assert isinstance(params.n, int) and 1 <= params.n
    assert math.isfinite(params.temperature) and math.isfinite(params.top_p)
    assert params.max_tokens is None or params.max_tokens >= 1


@pytest.fixture(scope="module")
def http(tiny):
    with httpx.Client(base_url=tiny.url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, resp.text[:500]
    if resp.status_code >= 400:
        assert_openai_error(resp)


MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "", "x" * 50])},
    optional={
        "content": st.one_of(
            st.none(), st.text(max_size=200), ANY_JSON,
            st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                                            "text": st.text(max_size=40)}), max_size=3),
        ),
        "name": ANY_SCALAR,
        "tool_calls": ANY_JSON,
        "unknown_field": ANY_JSON,
    },
)


@settings(max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(MESSAGE, max_size=5), extra=st.dictionaries(
    st.sampled_from(["n", "max_tokens", "logprobs", "top_logprobs", "stop", "seed", "temperature",
                     "response_format", "stream", "tools", "max_completion_tokens"]),
    ANY_JSON, max_size=3))
def test_chat_messages_fuzz(http, messages, extra):
    body = json.dumps({"messages": messages, **extra}, allow_nan=True)  # NaN and Infinity too
    check(http.post("/v1/chat/completions", content=body,
                    headers={"Content-Type": "application/json"}))


def deep(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


RAW_BODIES = [
    b"", b"null", b"[]", b"\xff\xfe\xfd", b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800"}',
    deep(10_000), deep(100), b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"prompt": "hi", "max_tokens": 1e999}', b'{"prompt": "hi", "max_tokens": -1e308}',
    b'{"prompt": "hi", "n": 100000000000000000000000000000}',
    b'{"prompt": "hi", "logprobs": 1000000}', b'{"prompt": "hi", "seed": -99999999999999999999999}',
    b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "temperature": Infinity}',
    b'{"prompt": "hi", "stop": ["' + b"s" * 100_000 + b'"]}',
    b'{"prompt": "hi", "stop": [' + b",".join([b'"x"'] * 1000) + b"]}",
    b'{"prompt": "' + b"a " * 300_000 + b'"}',
    b'{"prompt": [' + b",".join([b"5"] * 100_000) + b"]}",
    b'{"prompt": "hi", "max_tokens": 2, "stream": true, "n": 3, "logprobs": 2, "echo": true}',
    b'{"prompt": "hi", "bad_words": [' + b",".join([b'"w"'] * 1000) + b"]}",
    b'{"prompt": "hi", "logit_bias": {"-1": 5, "1e9": 1}}',
    b'{"prompt": "hi", "guided_regex": "(((((((((("}',
    b'{"prompt": "hi", "guided_json": {"type": "nonsense"}}',
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_hostile_raw_bodies(http, path):
    for body in RAW_BODIES:
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        check(r)
    assert http.get("/health").status_code == 200


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=300),
                      ANY_JSON.map(lambda v: json.dumps(v, allow_nan=True).encode())),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize",
                             "/detokenize"]))
def test_random_bodies(http, body, path):
    check(http.post(path, content=body, headers={"Content-Type": "application/json"}))


# --- every numeric field, at and past the bounds of the integers and floats a client can send ---

EXTREMES = [2**63, -(2**63) - 1, 2**64, 10**30, 2**63 - 1, -(2**63), 2**31, -1, 0, 1.5, 1e308,
            -1e308, 5e-324]
SWEPT = {
    "/v1/completions": (protocol.CompletionRequest, {"prompt": "hi", "max_tokens": 1}),
    "/v1/chat/completions": (protocol.ChatCompletionRequest,
                             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    # no number belongs in /tokenize's fields: numbers where the text and flags go
    "/tokenize": (protocol.TokenizeCompletionRequest, {"prompt": "hi"}),
    "/detokenize": (protocol.DetokenizeRequest, {"tokens": [1]}),
}


def numeric_fields(model) -> dict[str, str]:
    """The numeric fields of a request model, from its JSON schema: each name with how a number
    goes in it (``value``, ``item`` of an array, ``entry`` of an object)."""

    def kinds(node: dict | bool) -> set[str]:
        if not isinstance(node, dict) or "$ref" in node:
            return set()  # nested models carry no numbers a client sends
        out: set[str] = set()
        for alt in node.get("anyOf", [node]):
            if alt.get("type") in ("integer", "number"):
                out.add("value")
            elif alt.get("type") == "array" and kinds(alt.get("items", {})) & {"value", "item"}:
                out.add("item")
            elif alt.get("type") == "object" and "value" in kinds(alt.get("additionalProperties")
                                                                  or {}):
                out.add("entry")
        return out

    found = {}
    for field, node in model.model_json_schema()["properties"].items():
        k = kinds(node)
        if k:
            found[field] = sorted(k)[-1]  # value before item before entry: the simplest to send
    return found


@pytest.mark.parametrize("path", sorted(SWEPT))
def test_numeric_fields_out_of_range_are_4xx_naming_the_field(http, path):
    model, base = SWEPT[path]
    fields = numeric_fields(model) or {f: "value" for f in ("prompt", "add_special_tokens")}
    # the sweep must reach the fields the issue names; a schema change that hid them fails here
    assert path.endswith("tokenize") or {"top_k", "seed", "n", "max_tokens",
                                                     "temperature"} <= set(fields)
    statuses: dict[int, int] = {}
    for field, how in fields.items():
        for value in EXTREMES:
            sent = {"value": value, "item": [value], "entry": {"5": value}}[how]
            body = {**base, field: sent}
            r = http.post(path, json=body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            where = f"{path} {field}={str(sent)[:40]}"
            assert r.status_code < 500, f"{where}: {r.status_code} {r.text[:300]}"
            if r.status_code >= 400:
                err = assert_openai_error(r)
                assert (err["param"] or "").startswith(field), f"{where}: {err}"
    print(f"{path}: {len(fields)} numeric fields, statuses {statuses}")
    assert http.get("/health").status_code == 200
