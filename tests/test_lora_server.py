"""LoRA adapters through ``tianxia serve`` on 127.0.0.1 and the official ``openai`` client: a
request's ``model`` picks the adapter, tokens and logprobs equal ``transformers`` + ``peft``
(float32) with the base and three adapters mixed in concurrent requests, runtime load and
unload, ``/v1/models`` and ``/metrics``, and the bad-input cases (404 for an unknown adapter, 400
for a bad one, a start-up error naming the file), the server serving on after each; two API
processes (``--api-server-count 2``) that each list and route the start-up adapters."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys

import httpx
import openai
import pytest
import torch
from helpers import make_adapter, reference
from transformers import AutoModelForCausalLM

from tianxia.server.testing import ServerProcess, metric

from test_api_servers import api_pids

NEW_TOKENS = 6
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "The capital of France is"]
BASE_NAME = "tiny"


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32).eval()
    adapters = {
        "qv": make_adapter(base, root / "qv", 0, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "all": make_adapter(base, root / "all", 1, r=8, lora_alpha=8, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        "mlp": make_adapter(base, root / "mlp", 2, r=4, lora_alpha=8, use_rslora=True,
                            target_modules=["gate_proj", "up_proj", "down_proj"]),
        "r32": make_adapter(base, root / "r32", 3, r=32, lora_alpha=32, target_modules=["q_proj"]),
    }
    return tiny_models["llama"], base, adapters


def server_args(model_dir, adapters) -> list[str]:
    return [
        str(model_dir), "--served-model-name", BASE_NAME, "--kv-cache-memory", "64MiB", "--max-model-len", "256",
        "--cpu-activations", "float32", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
        "--lora-modules", f"qv={adapters['qv']}", json.dumps({"name": "all", "path": str(adapters["all"]),
                                                             "base_model_name": BASE_NAME}),
    ]


@pytest.fixture(scope="module")
def server(setup):
    model_dir, _, adapters = setup
    srv = ServerProcess([*server_args(model_dir, adapters), "--allow-runtime-lora-updating"])
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def complete(client: openai.OpenAI, model: str, ids: list[int]) -> tuple[str, list[float]]:
    out = client.completions.create(model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text, out.choices[0].logprobs.token_logprobs


def greedy(base, adapter, ids: list[int]):
    """The reference's own greedy tokens and logprobs (the output at position k depends on the
    tokens before it only, so each call's last placeholder token changes nothing)."""
    tokens: list[int] = []
    for _ in range(NEW_TOKENS):
        next_tokens, lps = reference(base, adapter, ids, tokens + [0])
        tokens.append(next_tokens[-1])
    return tokens, lps


def test_models_list_adapters_with_their_parent(client, setup):
    cards = {m.id: m for m in client.models.list().data}
    assert cards[BASE_NAME].parent is None
    for name in ("qv", "all"):
        assert cards[name].parent == BASE_NAME and cards[name].root == str(setup[2][name])
    assert client.models.retrieve("qv").parent == BASE_NAME


def test_runtime_load_and_a_mixed_batch_of_16_match_peft(client, server, setup):
    model_dir, base, adapters = setup
    http = httpx.Client(base_url=server.url, timeout=300)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
    assert r.status_code == 200, r.text
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    jobs = [(name, tokenizer.encode(p)) for name in (BASE_NAME, "qv", "all", "mlp") for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: complete(client, *job), jobs))
    for (name, ids), (text, logprobs) in zip(jobs, results):
        # the offline tests allow a divergence at a near-tie; these prompts have none
        ref_tokens, ref_lps = greedy(base, adapters.get(name), ids)
        assert text == tokenizer.decode(ref_tokens, skip_special_tokens=True), name
        for i, (t, lp) in enumerate(zip(ref_tokens, logprobs)):
            assert abs(lp - ref_lps[i][t].item()) < 1e-4, (name, i)
    text = http.get("/metrics").text
    for name in ("qv", "all", "mlp"):
        assert metric(text, "tianxia:lora_requests_total", lora_name=name) == len(PROMPTS)
    assert metric(text, "vllm:lora_requests_info", max_lora="3") is not None
    # unloaded, the adapter is an unknown model; the others serve on
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as err:
        complete(client, "mlp", jobs[0][1])
    assert err.value.body["code"] == "model_not_found"
    assert "mlp" not in {m.id for m in client.models.list().data}
    assert complete(client, "qv", jobs[0][1])[0] == results[len(PROMPTS)][0]


def test_bad_runtime_loads_are_4xx_and_the_server_keeps_serving(client, server, setup, tmp_path):
    _, _, adapters = setup
    http = httpx.Client(base_url=server.url, timeout=300)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((adapters["qv"] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    for body, status, words in (
        ({"lora_name": "big", "lora_path": str(adapters["r32"])}, 400, "above --max-lora-rank 8"),
        ({"lora_name": "broken", "lora_path": str(corrupt)}, 400, "unreadable safetensors"),
        ({"lora_name": "nowhere", "lora_path": str(tmp_path / "none")}, 400, "not a PEFT adapter"),
        ({"lora_name": "qv", "lora_path": str(adapters["qv"])}, 400, "already been loaded"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ):
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=1)
    assert complete(client, "all", [1, 2, 3])[0]


def test_runtime_updates_need_the_flag_and_bad_start_up_adapters_name_the_file(setup, tmp_path):
    model_dir, _, adapters = setup
    with ServerProcess([str(model_dir), "--kv-cache-memory", "32MiB", "--max-model-len", "128",
                        "--enable-lora", "--lora-modules", f"qv={adapters['qv']}"]) as srv:
        r = httpx.post(srv.url + "/v1/load_lora_adapter",
                       json={"lora_name": "all", "lora_path": str(adapters["all"])}, timeout=60)
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.text
    proc = subprocess.run(
        [sys.executable, "-m", "tianxia.cli", "serve", str(model_dir), "--kv-cache-memory", "32MiB",
         "--enable-lora", "--lora-modules", f"big={adapters['r32']}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert str(adapters["r32"]) in proc.stderr and "--max-lora-rank" in proc.stderr, proc.stderr[-2000:]


def test_runtime_load_reaches_every_data_parallel_core_and_matches_peft(setup):
    model_dir, base, adapters = setup
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with ServerProcess([str(model_dir), "--served-model-name", BASE_NAME, "--kv-cache-memory", "32MiB",
                        "--max-model-len", "128", "--cpu-activations", "float32", "--enable-lora",
                        "--max-lora-rank", "8", "--allow-runtime-lora-updating",
                        "--data-parallel-size", "2", "--threads", "1"]) as srv:
        http = httpx.Client(base_url=srv.url, timeout=300)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        # a core's refusal is the client's 400, and the server serves on
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapters["r32"])})
        assert r.status_code == 400 and "above --max-lora-rank 8" in r.json()["error"]["message"], r.text
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(adapters["all"])})
        assert r.status_code == 200, r.text
        assert {m.id: m.parent for m in client.models.list().data}["all"] == BASE_NAME
        jobs = [tokenizer.encode(p) for p in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda ids: complete(client, "all", ids), jobs))
        scrape = http.get("/metrics").text
        for core in ("0", "1"):  # both cores served the adapter
            assert (metric(scrape, "tianxia:engine_generation_tokens_total", engine=core) or 0) > 0, scrape
        assert metric(scrape, "tianxia:lora_requests_total", lora_name="all") == len(PROMPTS)
        for ids, (text, logprobs) in zip(jobs, results):
            ref_tokens, ref_lps = greedy(base, adapters["all"], ids)
            assert text == tokenizer.decode(ref_tokens, skip_special_tokens=True)
            for i, (t, lp) in enumerate(zip(ref_tokens, logprobs)):
                assert abs(lp - ref_lps[i][t].item()) < 1e-4, i
        # every core forgot it: the name loads again, from another file
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete(client, "all", jobs[0])
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(adapters["qv"])})
        assert r.status_code == 200, r.text
        assert complete(client, "all", jobs[0])[0] == tokenizer.decode(greedy(base, adapters["qv"], jobs[0])[0])


def test_two_api_processes_list_and_route_the_start_up_adapters(setup, client):
    """Each API process reads the adapters from the cores' start-up facts, lists them and routes
    by ``model``; the greedy text equals the one-process server's (itself checked against peft
    above)."""
    model_dir, _, adapters = setup
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    jobs = [(name, tokenizer.encode(p)) for name in (BASE_NAME, "qv", "all") for p in PROMPTS]
    expected = {(name, tuple(ids)): complete(client, name, ids)[0] for name, ids in jobs}

    def via_fresh_connection(name: str, ids: list[int]) -> tuple[int, str]:
        """Which API process answered (a new connection each time, so either may) and its text."""
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                           timeout=300) as c:
            raw = c.completions.with_raw_response.create(
                model=name, prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"ignore_eos": True})
        return int(raw.headers["x-tianxia-api-server-pid"]), raw.parse().choices[0].text

    with ServerProcess([*server_args(model_dir, adapters), "--api-server-count", "2",
                        "--data-parallel-size", "2", "--threads", "1"]) as srv:
        apis = set(api_pids(srv))
        assert len(apis) == 2
        listed: dict[int, dict[str, str | None]] = {}
        for _ in range(40):
            r = httpx.get(srv.url + "/v1/models", timeout=60)
            cards = {m["id"]: m["parent"] for m in r.json()["data"]}
            listed[int(r.headers["x-tianxia-api-server-pid"])] = cards
            if len(listed) == 2:
                break
        assert set(listed) == apis
        want = {BASE_NAME: None, "qv": BASE_NAME, "all": BASE_NAME}
        assert all(cards == want for cards in listed.values()), listed

        # a mixed batch, concurrent, over both processes and both cores
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda job: via_fresh_connection(*job), jobs))
        for (name, ids), (_, text) in zip(jobs, results):
            assert text == expected[(name, tuple(ids))], name
        # and each process routes each adapter
        ids = jobs[0][1]
        for name in ("qv", "all"):
            answered: set[int] = set()
            for _ in range(40):
                pid, text = via_fresh_connection(name, ids)
                assert text == expected[(name, tuple(ids))], (name, pid)
                answered.add(pid)
                if answered == apis:
                    break
            assert answered == apis, name
        with pytest.raises(openai.NotFoundError):
            via_fresh_connection("no-such-adapter", ids)
