"""Tool calling on ``/v1/chat/completions`` of a real ``tianxia serve`` (Qwen2.5-Coder-0.5B, whose
chat template renders tools in the Hermes format), through the official ``openai`` client.

Constrained calls (``required``, a named function) are checked against the tools' schemas with
``jsonschema``; ``auto`` calls against a reference parse (``json``) of the raw completion of the
same prompt; streams against the full response of the same greedy request. One server for the
module; outputs are short.
"""

from __future__ import annotations

import json
import random
import re

import httpx
import jsonschema
import openai
import pytest

from tianxia.server.testing import ServerProcess
from tianxia.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedDelta,
    RequiredToolParser,
    merge_tool_calls,
)

MODEL = "qwen"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris, in celsius?"}]
# a finished round of tool use (arguments as JSON text, as clients send them back), then a new ask
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 degrees celsius in Paris."},
    {"role": "user", "content": "Now call get_weather for Berlin, in fahrenheit."},
]


@pytest.fixture(scope="module")
def server(qwen_path):
    srv = ServerProcess(
        [
            str(qwen_path),
            "--served-model-name",
            MODEL,
            "--kv-cache-memory",
            "64MiB",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "4",
            "--seed",
            "0",
        ]
    )
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _chat(client, messages, stream=False, max_tokens=48, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        temperature=0,
        max_tokens=max_tokens,
        stream=stream,
        **kw,
    )


def _streamed(chunks) -> tuple[str, list[dict], str | None]:
    """Content, calls and finish reason of a stream, checking OpenAI's delta shape on the way."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # the first delta of a call names it
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and not d.function.name
            calls[d.index]["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


def _calls(message) -> list[dict]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]


def _check_valid(calls: list[dict]) -> None:
    assert calls
    for c in calls:
        assert c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def _same_calls(a: list[dict], b: list[dict]) -> bool:
    key = lambda cs: [(c["name"], json.loads(c["arguments"])) for c in cs]
    return key(a) == key(b)


def test_required_calls_follow_the_schema(client):
    full = _chat(client, ASK, tool_choice="required", parallel_tool_calls=False)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = _calls(choice.message)
    assert len(calls) == 1 and all(tc.type == "function" for tc in choice.message.tool_calls)
    _check_valid(calls)
    content, streamed, finish = _streamed(
        _chat(client, ASK, stream=True, tool_choice="required", parallel_tool_calls=False)
    )
    assert finish == "tool_calls" and not content
    _check_valid(streamed)
    assert _same_calls(streamed, calls)


def test_named_function_is_called(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    full = _chat(client, ASK, tool_choice=named)
    calls = _calls(full.choices[0].message)
    assert [c["name"] for c in calls] == ["get_time"]
    assert full.choices[0].finish_reason == "tool_calls"
    _check_valid(calls)
    _, streamed, finish = _streamed(_chat(client, ASK, stream=True, tool_choice=named))
    assert finish == "tool_calls" and _same_calls(streamed, calls)


def _reference_calls(text: str) -> list[dict]:
    """Calls in the raw output, by the format the template asks for: ``<tool_call>`` tags, or a
    message that is one call object (bare or in a ```json fence)."""
    bodies = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    if not bodies:
        m = re.fullmatch(r"\s*(?:```(?:json)?)?\s*(\{.*\})\s*(?:```)?\s*", text, re.DOTALL)
        bodies = [m.group(1)] if m else []
    calls = []
    for body in bodies:
        obj = json.loads(body)
        if isinstance(obj, dict) and "name" in obj:
            calls.append({"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))})
    return calls


def test_auto_with_a_tool_result_in_the_conversation(client, server, qwen_path):
    # the conversation (assistant tool_calls with JSON-text arguments, a role "tool" result) is
    # rendered exactly as the template renders it with arguments as an object
    from tianxia.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(qwen_path, is_gguf=True)
    reference_history = json.loads(json.dumps(HISTORY))
    call = reference_history[1]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    reference_history[1]["content"] = ""
    expected = tok.apply_chat_template(
        reference_history, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    ids = httpx.post(
        server.url + "/tokenize", json={"model": MODEL, "messages": HISTORY, "tools": TOOLS}
    ).json()["tokens"]
    assert tok.decode(ids) == expected
    assert "<tool_response>" in expected and '"arguments": {"city": "Paris"' in expected

    raw = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=48)
    reference = _reference_calls(raw.choices[0].text)
    assert reference, raw.choices[0].text  # the model does call the tool here
    full = _chat(client, HISTORY, tool_choice="auto")
    calls = _calls(full.choices[0].message)
    assert full.choices[0].finish_reason == "tool_calls"
    assert _same_calls(calls, reference)
    _check_valid(calls)
    _, streamed, finish = _streamed(_chat(client, HISTORY, stream=True, tool_choice="auto"))
    assert finish == "tool_calls" and _same_calls(streamed, calls)

    # the answer to a tool result is plain content
    answer = _chat(client, HISTORY[:3], tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "no-such"}},
                    }
                ]
            },
            "not a valid JSON schema",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        ({"tool_choice": "required"}, "only allowed when tools are given"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{oops"},
                            }
                        ],
                    },
                ]
            },
            "not valid JSON",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
                    },
                }
            },
            "invalid json",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "invalid regex"),
        ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "invalid grammar"),
    ],
)
def test_invalid_tools_and_constraints_are_400(client, kwargs, message):
    kwargs = {"messages": ASK, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=4, **kwargs)
    assert e.value.status_code == 400
    assert message in e.value.body["message"], e.value.body


# --- the parsers alone, on generated calls, against json as the reference ---------------------


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice('ab }{][",:\\é\n') for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "float":
        return rng.uniform(-10, 10)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _feed(parser, text: str, rng: random.Random) -> tuple[str, list[dict]]:
    out = ParsedDelta()
    i = 0
    while i < len(text):
        n = rng.randint(1, 8)
        out.extend(parser.feed(text[i : i + n]))
        i += n
    out.extend(parser.finish())
    return out.content, merge_tool_calls(out.tool_calls)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "required"])
def test_parsers_stream_exactly_the_arguments(fmt):
    rng = random.Random(fmt)
    for _ in range(200):
        calls = [
            (
                f"fn_{rng.randint(0, 9)}",
                {f"p{j}": _random_value(rng) for j in range(rng.randint(0, 3))},
            )
            for _ in range(rng.randint(1, 3))
        ]
        indent = rng.choice([None, 2])
        if fmt == "hermes":
            prose = rng.choice(["", "Let me check.\n"])
            text = prose + "\n".join(
                "<tool_call>\n"
                + json.dumps({"name": n, "arguments": a}, indent=indent)
                + "\n</tool_call>"
                for n, a in calls
            )
            parser = HermesToolParser()
        elif fmt == "llama3_json":
            prose = ""
            text = "; ".join(
                json.dumps({"name": n, "parameters": a}, indent=indent) for n, a in calls
            )
            parser = Llama3JsonToolParser()
        else:
            prose = ""
            text = json.dumps([{"name": n, "parameters": a} for n, a in calls], indent=indent)
            parser = RequiredToolParser()
        content, parsed = _feed(parser, text, rng)
        assert content == prose.strip()
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed
        ] == calls
        assert len({c["id"] for c in parsed}) == len(parsed)


@pytest.mark.parametrize("parser", [HermesToolParser, Llama3JsonToolParser])
def test_parsers_leave_plain_text_alone(parser):
    rng = random.Random(0)
    for text in [
        "The answer is 42.",
        '{"answer": 42}',
        "```python\nprint(1)\n```",
        "a < b <tool",
        "",
    ]:
        assert _feed(parser(), text, rng) == (text, [])


@pytest.mark.parametrize("mode", ["TOOLS", "JSON", "JSON_SCHEMA"])
def test_instructor_modes(client, mode):
    """instructor's modes: a forced tool call, json_object with the schema in the system prompt
    (the model must follow it), and response_format json_schema."""
    import instructor
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(
        model=MODEL, response_model=City, max_retries=0, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Name a city in Italy."}])
    assert isinstance(city, City) and city.name and city.country
