"""tianxia on Ray Serve: a local Ray instance, 2 replicas of SmolLM2 (1 thread each) behind the
ingress, the official openai client, prefix-aware routing on the replicas' own token ids, their
metrics through Ray's metrics agent, a replica killed mid-load, and an autoscaling application
beside them (1 to 2 replicas)."""

from __future__ import annotations

import asyncio
import json
import re
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
def ray_cluster():
    """A local Ray instance whose metrics agent serves Prometheus text on ``metrics_port``."""
    metrics_port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 500})
    try:
        yield metrics_port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_app(ray_cluster, smollm2_path):
    from tianxia.ray import app

    port = free_port()
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
    yield f"http://127.0.0.1:{port}"


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
    # different prompts go wherever power of two choices sends them, a coin toss between two idle
    # replicas: up to 16 of them, so that both are seen (all on one: a chance of 2^-15)
    for i in range(16):
        r = httpx.post(ray_app + "/v1/completions", json={
            "model": model, "prompt": f"Story number {i}: once upon a time", "max_tokens": 2,
        }, timeout=120)
        replicas.add(r.headers["x-tianxia-replica"])
        if len(replicas) == 2:
            break
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


def test_router_keys_on_the_replicas_own_token_ids(ray_app, smollm2_path):
    """The ingress's routing tokens are what a replica's engine gets: its ``/tokenize`` (the
    server's own chat template rendering and tokenizer) is the reference."""
    import httpx

    from tianxia.ray.tokens import RoutingTokenizer

    tok = RoutingTokenizer(str(smollm2_path))
    model = httpx.get(ray_app + "/v1/models", timeout=30).json()["data"][0]["id"]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is a drill?"},
                {"role": "assistant", "content": "A tool that makes holes."},
                {"role": "user", "content": "And a saw?"}]
    for body, ask in (
        ({"model": model, "messages": messages}, {"messages": messages}),
        ({"model": model, "prompt": "The capital of France is"},
         {"prompt": "The capital of France is", "add_special_tokens": False}),
    ):
        ref = httpx.post(ray_app + "/tokenize", json={"model": model, **ask}, timeout=30)
        assert ref.status_code == 200, ref.text
        assert tok.prompt_tokens(json.dumps(body).encode()) == ref.json()["tokens"]
    assert tok.prompt_tokens(json.dumps({"prompt": [5, 6, 7]}).encode()) == [5, 6, 7]
    assert tok.prompt_tokens(b"not json") == []


def _ray_metrics(port: int) -> dict[tuple[str, str], float]:
    """Ray's Prometheus text -> {(metric name, replica tag): value} for tianxia's series."""
    import httpx

    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        m = re.match(r'^(ray_vllm_\w+)\{(.*)\}\s+(\S+)$', line)
        replica = m and re.search(r'(?:^|,)replica="([^"]+)"', m.group(2))
        if replica:
            out[(m.group(1), replica.group(1))] = float(m.group(3))
    return out


def _own_metric(text: str, name: str) -> float:
    pattern = rf"^{re.escape(name)}\{{[^}}]*\}}\s+(\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_replica_metrics_through_ray(client, ray_app, ray_cluster):
    """Each replica's engine counters reach Ray's metrics agent tagged with the replica, and
    agree with that replica's own ``/metrics``."""
    import httpx

    model = _model(client)
    prompt = "Reference text about tools. " * 20
    for _ in range(2):  # the second one reads the first one's prefix from its replica's cache
        client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    own: dict[str, str] = {}  # replica tag -> its /metrics text, idle by now
    deadline = time.monotonic() + 60
    while len(own) < 2 and time.monotonic() < deadline:
        r = httpx.get(ray_app + "/metrics", timeout=30)
        own[r.headers["x-tianxia-replica"].rsplit("#", 1)[-1]] = r.text
    assert len(own) == 2
    names = ("ray_vllm_prefix_cache_hits_total", "ray_vllm_prompt_tokens_total",
             "ray_vllm_generation_tokens_total")
    want = {(n, tag): _own_metric(text, n.removeprefix("ray_").replace("vllm_", "vllm:", 1))
            for tag, text in own.items() for n in names}
    deadline = time.monotonic() + 30
    while True:
        got = _ray_metrics(ray_cluster)
        if all(got.get(k, 0.0) == v for k, v in want.items()):  # a count never raised: absent
            break
        if time.monotonic() > deadline:
            pytest.fail(f"Ray's metrics {got} never matched the replicas' own {want}")
        time.sleep(0.5)
    assert sum(v for (n, _), v in want.items() if n == names[0]) > 0  # cached prompt tokens
    for tag in own:
        assert got[("ray_vllm_num_requests_running", tag)] == 0
        assert 0 <= got[("ray_vllm_kv_cache_usage_perc", tag)] <= 1


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


# Ray 2.60 still reads how often replicas report their load from metrics_interval_s, which it
# already calls deprecated
@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
def test_autoscaling_adds_a_replica_under_load_and_removes_it_when_idle(ray_app, smollm2_path):
    """Ray's ``autoscaling_config`` through ``app``: 1 replica, up to 2 at one ongoing request
    each; a burst of requests makes Ray start a second replica, idleness takes it away."""
    from tianxia.ray import app

    serve.run(app({
        "model": str(smollm2_path), "threads": 1, "min_replicas": 1, "max_replicas": 2,
        "target_ongoing_requests": 1,
        "autoscaling_config": {"metrics_interval_s": 0.5, "look_back_period_s": 1,
                               "upscale_delay_s": 0.5, "downscale_delay_s": 2},
        "serve_args": "--kv-cache-memory 64MiB --max-model-len 512",
    }), name="auto", route_prefix="/auto")
    client = openai.AsyncOpenAI(base_url=ray_app + "/auto/v1", api_key="none", max_retries=0,
                                timeout=120)

    def running() -> int:
        status = serve.status().applications["auto"].deployments["TianxiaReplica"]
        return status.replica_states.get("RUNNING", 0)

    async def load_until_scaled() -> tuple[float, list]:
        model = (await client.models.list()).data[0].id
        done = asyncio.Event()

        async def one_after_another(i: int) -> list:
            replies = []
            while not done.is_set():
                # ignore_eos: a sampled reply may end early; every reply must run its 16 tokens
                r = await client.completions.create(
                    model=model, prompt=f"Load {i}: tell a long story.", max_tokens=16,
                    extra_body={"ignore_eos": True})
                replies.append(r.usage.completion_tokens)
            return replies

        workers = [asyncio.create_task(one_after_another(i)) for i in range(4)]
        started = time.monotonic()
        while running() < 2 and time.monotonic() - started < 90:
            await asyncio.sleep(0.25)
        scaled = time.monotonic() - started
        done.set()
        return scaled, await asyncio.gather(*workers)

    try:
        assert running() == 1
        scaled, replies = asyncio.run(load_until_scaled())
        print(f"second replica running {scaled:.1f}s into the load")
        assert running() == 2
        assert all(n == 16 for worker in replies for n in worker)  # none lost while scaling
        deadline = time.monotonic() + 60
        while running() > 1:
            assert time.monotonic() < deadline, "the idle replica was not removed"
            time.sleep(0.5)
    finally:
        serve.delete("auto")


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
    with pytest.raises(ValueError, match="autoscaling_config is not JSON"):
        app({"model": "smollm2-135m", "autoscaling_config": "{max_replicas: 2"})
