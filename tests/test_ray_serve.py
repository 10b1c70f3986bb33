"""tianxia on Ray Serve: a local Ray instance, 2 replicas of SmolLM2 (1 thread each) behind the
ingress, the official openai client, prefix-aware routing, and a replica killed mid-load."""

from __future__ import annotations

import asyncio
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from tianxia.server.testing import free_port  # noqa: E402

MODEL = "smollm2-135m"
SYSTEM = (
    "You are a careful assistant for a hardware shop. Answer in one short sentence. "
    "The shop sells hammers, screwdrivers, drills, saws, nails, screws and paint. "
) * 4


@pytest.fixture(scope="module")
def ray_app(smollm2_path):
    from tianxia.ray import app

    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    started = time.monotonic()
    serve.run(
        app({
            "model": str(smollm2_path), "num_replicas": 2, "threads": 1,
            "serve_args": "--kv-cache-memory 128MiB --max-model-len 1024",
        }),
        name="tianxia",
        route_prefix="/",
    )
    print(f"2 replicas up in {time.monotonic() - started:.1f}s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def client(ray_app):
    return openai.OpenAI(base_url=ray_app + "/v1", api_key="none", max_retries=0, timeout=120)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_openai_routes_through_ingress(client):
    model = _model(client)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
        temperature=0,
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    comp = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=5, temperature=0)
    assert comp.choices[0].text and comp.usage.prompt_tokens > 0
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count to three."}],
            max_tokens=8, temperature=0, stream=True,
        )
        if c.choices
    ]
    assert len(pieces) > 1 and "".join(pieces)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_prefix_routing_keeps_a_conversation_on_one_replica(client, ray_app):
    import httpx

    model = _model(client)
    replicas, cached = set(), []
    for i in range(3):  # different prompts go wherever power-of-two sends them
        r = httpx.post(ray_app + "/v1/completions", json={
            "model": model, "prompt": f"Story number {i}: once upon a time", "max_tokens": 2,
        }, timeout=120)
        replicas.add(r.headers["x-tianxia-replica"])
    for conv in range(2):
        system = f"Conversation {conv}. " + SYSTEM
        messages = [{"role": "system", "content": system}]
        seen = set()
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn}: what is a drill?"})
            r = httpx.post(ray_app + "/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": 4, "temperature": 0,
            }, timeout=120)
            assert r.status_code == 200, r.text
            body = r.json()
            seen.add(r.headers["x-tianxia-replica"])
            if turn:
                cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        assert len(seen) == 1, seen  # every turn on the replica holding the conversation
        replicas |= seen
    assert len(replicas) == 2  # both replicas used
    # later turns hit the prefix cache: at least the long system prompt is reused
    assert all(c >= 64 for c in cached), cached


def test_killed_replica_fails_cleanly_and_comes_back(client, ray_app):
    model = _model(client)
    aclient = openai.AsyncOpenAI(base_url=ray_app + "/v1", api_key="none", max_retries=0,
                                 timeout=120)
    victim = client.with_raw_response.completions.create(
        model=model, prompt="warm up", max_tokens=1
    ).headers["x-tianxia-replica"]

    async def one(i: int):
        try:
            r = await aclient.completions.create(
                model=model, prompt=f"Request {i}: write a long story about a cat.",
                max_tokens=48, temperature=0,
            )
            return r.choices[0].text is not None and r.usage.completion_tokens > 0
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.body["type"] == "server_error"
            return exc

    async def load():
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        await asyncio.sleep(3)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)

    results = asyncio.run(load())
    # every request got an answer or a clean 503, none hung or came back empty
    assert all(r is True or isinstance(r, openai.APIStatusError) for r in results), results
    assert any(r is True for r in results)
    # Ray replaces the replica: two healthy replicas again, and the ingress keeps serving
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = serve.status().applications["tianxia"].deployments["TianxiaReplica"]
        if status.status == "HEALTHY" and status.replica_states.get("RUNNING") == 2:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the replica was not replaced: {status}")
    assert client.completions.create(model=model, prompt="Hello", max_tokens=2).choices[0].text


def test_ray_replicas_flags_go_to_the_replicas():
    from tianxia.ray.local import replica_flags

    argv = ["serve", "smollm2-135m", "--ray-replicas", "2", "--port", "9000", "--threads", "1",
            "--host=0.0.0.0", "--kv-cache-memory", "128MiB"]
    assert replica_flags(argv, "smollm2-135m") == ["--threads", "1", "--kv-cache-memory", "128MiB"]


def test_app_arguments_are_checked():
    from tianxia.ray import app

    with pytest.raises(ValueError, match="needs model"):
        app({})
    with pytest.raises(ValueError, match="unknown argument"):
        app({"model": "smollm2-135m", "replicas": 2})
    with pytest.raises(ValueError, match="router must be"):
        app({"model": "smollm2-135m", "router": "random"})
