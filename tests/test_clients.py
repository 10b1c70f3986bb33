"""Third-party clients against a real ``tianxia serve``, unchanged: the ``openai`` SDK's stream
accumulator, ``chat.completions.parse``, the Responses API and embeddings; LangChain's
``ChatOpenAI``; browsers' CORS preflight; ``/ping``; chat ``echo``. (``instructor``, whose JSON
mode needs a model that follows a schema in its prompt, runs with Qwen in ``test_tools.py``.)

One server for the module: SmolLM2 dequantized to float32 with float32 activations (so that its
hidden states can be compared with transformers' own model of the same GGUF file), mean pooling
for ``/v1/embeddings``. Outputs are a few tokens long.
"""

from __future__ import annotations

import base64
import json
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel

from tianxia.server.testing import ServerProcess

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = ServerProcess([
        MODEL, "--quantization", "none", "--cpu-activations", "float32",
        "--pooler-config", '{"pooling_type": "MEAN", "normalize": false}',
        "--kv-cache-memory", "96MiB", "--max-model-len", "1024", "--max-num-seqs", "8",
        "--seed", "0", "--allowed-origins", "http://app.example",
        "--threads", "1",  # the clients run in this process, on the same two cores
    ])
    srv.start()
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)


# --- streamed chunks, through the SDK's own accumulator ----------------------------------------


def accumulate(client, **kw):
    """The raw chunks of a stream and the completion the SDK's accumulator builds from them (its
    snapshot: ``get_final_completion`` refuses a choice that ran to the length limit)."""
    state = ChatCompletionStreamState(input_tools=kw.get("tools", openai.omit))
    chunks = []
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        chunks.append(chunk)
        state.handle_chunk(chunk)
    for chunk in chunks:
        for choice in chunk.choices:
            indices = [d.index for d in choice.delta.tool_calls or []]
            # OpenAI and vLLM: at most one delta per tool call in a chunk
            assert len(indices) == len(set(indices)), chunk
    return chunks, state.current_completion_snapshot


@pytest.mark.parametrize(
    "kw",
    [
        {"messages": ASK, "max_tokens": 8, "temperature": 0},
        {"messages": ASK, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2},
        {"messages": ASK, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 11},
        {"messages": WEATHER_ASK, "max_tokens": 24, "temperature": 0, "tools": [WEATHER],
         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"messages": WEATHER_ASK, "max_tokens": 40, "temperature": 0, "tools": [WEATHER],
         "tool_choice": "required"},
    ],
    ids=["content", "logprobs", "n2", "named-tool", "required-tool"],
)
def test_stream_accumulates_to_the_full_response(client, kw):
    full = client.chat.completions.create(model=MODEL, **kw)
    chunks, acc = accumulate(client, stream_options={"include_usage": True}, **kw)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len(acc.choices) == len(full.choices)
    for a, f in zip(sorted(acc.choices, key=lambda c: c.index),
                    sorted(full.choices, key=lambda c: c.index)):
        assert a.finish_reason == f.finish_reason
        assert (a.message.content or None) == (f.message.content or None)
        calls_a = [(t.function.name, t.function.arguments) for t in a.message.tool_calls or []]
        calls_f = [(t.function.name, t.function.arguments) for t in f.message.tool_calls or []]
        assert calls_a == calls_f
        for _, arguments in calls_a:
            assert isinstance(json.loads(arguments)["city"], str)
        if kw.get("logprobs"):
            assert [t.token for t in a.logprobs.content] == [t.token for t in f.logprobs.content]
    if "tools" in kw:
        assert acc.choices[0].message.tool_calls, acc


def test_stream_helper_parses_tool_arguments(client):
    with client.chat.completions.stream(
        model=MODEL, messages=WEATHER_ASK, max_tokens=24, temperature=0,
        tools=[openai.pydantic_function_tool(City, name="get_city")],
        tool_choice={"type": "function", "function": {"name": "get_city"}},
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert len(done) == 1 and isinstance(done[0].parsed_arguments, City)
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == done[0].parsed_arguments


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Name a city in Italy."}],
        response_format=City, max_tokens=40, temperature=0,
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


# --- Responses --------------------------------------------------------------------------------


def test_responses_text_instructions_and_stream(client):
    kw = dict(model=MODEL, input="What is the capital of France?", max_output_tokens=8,
              temperature=0, instructions="Answer in one word.")
    r = client.responses.create(**kw)
    assert r.object == "response" and r.output_text
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 8
    with client.responses.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == r.output_text
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Answer in one word."}, *ASK])
    assert r.output_text == chat.choices[0].message.content


def test_responses_previous_response_id_and_retrieve(client, http):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=4,
                                     temperature=0, previous_response_id=first.id)
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=4,
                                    temperature=0)
    # the second request's prompt holds the first exchange
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2**70})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_responses_function_call_and_its_output(client):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=24, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?",
                                 tools=[tool], max_output_tokens=24, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"}) as s:
        streamed = [o for o in s.get_final_response().output if o.type == "function_call"]
    assert [c.arguments for c in streamed] == [c.arguments for c in calls]
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, max_output_tokens=6, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temperature": 21}'}])
    assert follow.output_text


# --- embeddings -------------------------------------------------------------------------------


def cosine(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_embeddings_match_transformers_and_rank_paraphrases(client, http, smollm2_reference,
                                                            smollm2_tokenizer_dir):
    texts = ["The cat sat on the mat.", "A cat was sitting on the mat.",
             "Stock markets fell sharply on Monday."]
    r = client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64
    vecs = [d.embedding for d in r.data]
    assert r.usage.prompt_tokens > 0 and len(vecs[0]) == smollm2_reference.config.hidden_size
    assert cosine(vecs[0], vecs[1]) > cosine(vecs[0], vecs[2])
    assert cosine(vecs[0], vecs[1]) > cosine(vecs[1], vecs[2])
    raw = http.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "float"}).json()
    b64 = http.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.asarray(raw["data"][0]["embedding"], dtype=np.float32))
    ids = http.post("/tokenize", json={"prompt": texts[0]}).json()["tokens"]
    with torch.no_grad():
        out = smollm2_reference(torch.tensor([ids]), output_hidden_states=True)
    want = out.hidden_states[-1][0].mean(dim=0).numpy()
    assert np.abs(np.asarray(raw["data"][0]["embedding"]) - want).max() < 1e-4
    bad = http.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "int8"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "encoding_format"


# --- browsers, probes, echo, disconnects ------------------------------------------------------


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def test_cors_preflight_and_ping(http):
    pre = http.options("/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    other = http.options("/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    got = http.get("/v1/models", headers={"Origin": "http://app.example"})
    assert got.headers["access-control-allow-origin"] == "http://app.example"
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_chat_echo_continues_the_last_message(client):
    start = "The capital of France is"
    kw = dict(model=MODEL, max_tokens=4, temperature=0,
              messages=[*ASK, {"role": "assistant", "content": start}],
              extra_body={"echo": True, "add_generation_prompt": False,
                          "continue_final_message": True})
    r = client.chat.completions.create(**kw)
    plain = client.chat.completions.create(**{**kw, "extra_body": {
        "add_generation_prompt": False, "continue_final_message": True}})
    assert r.choices[0].message.content == start + plain.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kw) if c.choices)
    assert streamed == r.choices[0].message.content


def test_disconnect_leaves_no_traceback(server):
    with httpx.Client(base_url=server.url) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 300, "ignore_eos": True},
               timeout=1)
    time.sleep(2)
    log = server.log()
    assert "never retrieved" not in log and "Traceback" not in log, log[-3000:]


# --- LangChain --------------------------------------------------------------------


def test_langchain_chat_openai(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="EMPTY", temperature=0,
                     max_tokens=8, max_retries=0)
    said = llm.invoke("What is the capital of France?")
    assert said.content and said.usage_metadata["output_tokens"] <= 8
    assert "".join(c.content for c in llm.stream("What is the capital of France?")) == said.content
    roomy = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="EMPTY", temperature=0,
                       max_tokens=40, max_retries=0)
    call = roomy.bind_tools([WEATHER], tool_choice="get_weather").invoke(
        "What is the weather in Paris?").tool_calls
    assert call and call[0]["name"] == "get_weather" and isinstance(call[0]["args"]["city"], str)
    for method in ("json_schema", "function_calling"):
        structured = roomy.with_structured_output(City, method=method)
        city = structured.invoke("Name a city in Italy.")
        assert isinstance(city, City) and city.name, method

