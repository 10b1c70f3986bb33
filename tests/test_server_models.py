"""Several models in one ``tianxia serve``: real SmolLM2 and Qwen2.5-Coder behind one server on
127.0.0.1, driven by the official ``openai`` client; loads on demand, LRU unloading at
``--models-max 1``, a corrupt model file marked ``failed`` while the others serve, the memory plan,
``--models-dir`` and ``--no-models-autoload``, and llama.cpp's ``/models/load`` and ``/unload``.

The servers load nothing at start, so each starts in seconds; outputs are kept short.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from tianxia.server.testing import ServerProcess, metric

CRASH = "@@crash-the-engine@@"
SMALL = ["--kv-cache-memory", "32MiB", "--max-model-len", "256", "--max-num-seqs", "8"]


def statuses(http: httpx.Client) -> dict[str, dict]:
    r = http.get("/v1/models")
    assert r.status_code == 200, r.text
    return {m["id"]: m["status"] for m in r.json()["data"]}


def error_of(resp: httpx.Response, status: int, code: str) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code, err
    return err["message"]


def ask(client: openai.OpenAI, model: str, content: str = "Say hello.") -> str:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        temperature=0,
    )
    assert out.model == model
    assert out.choices[0].message.content
    assert out.usage.completion_tokens > 0
    return out.choices[0].message.content


@pytest.fixture(scope="module")
def broken_gguf(tmp_path_factory, smollm2_path):
    """A real model file cut short, as a download that stopped would leave it."""
    path = tmp_path_factory.mktemp("broken") / "broken.gguf"
    path.write_bytes(smollm2_path.read_bytes()[:200_000])
    return path


@pytest.fixture(scope="module")
def server(smollm2_path, qwen_path, broken_gguf):
    srv = ServerProcess(
        [
            "--model", f"smol={smollm2_path}",
            "--model", f"coder={qwen_path}",
            "--model", str(broken_gguf),
            "--models-max", "2",
            *SMALL,
        ],
        env={"TIANXIA_FAULT_INJECT": f"engine_loop:{CRASH}"},
    )
    srv.start()
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def test_models_listed_unloaded_at_start(client, http):
    assert [m.id for m in client.models.list().data] == ["smol", "coder", "broken"]
    assert statuses(http) == {n: {"value": "unloaded"} for n in ("smol", "coder", "broken")}
    assert http.get("/models").json() == http.get("/v1/models").json()  # llama.cpp's path
    assert http.get("/health").status_code == 200  # up with nothing loaded


def test_two_models_concurrently_load_on_demand(client, http):
    # both requests arrive while neither model is loaded: each waits for its own load
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        smol = pool.submit(ask, client, "smol", "What is the capital of France?")
        coder = pool.submit(ask, client, "coder", "Write a Python function that adds two numbers.")
        assert smol.result() and coder.result()
    assert statuses(http) == {
        "smol": {"value": "loaded"}, "coder": {"value": "loaded"}, "broken": {"value": "unloaded"}
    }
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards["coder"]["max_model_len"] == 256
    assert cards["smol"]["memory_bytes"]["kv_cache"] == 32 << 20
    # Qwen2.5-Coder-0.5B's packed weights are about five times SmolLM2-135M's
    assert cards["coder"]["memory_bytes"]["weights"] > 3 * cards["smol"]["memory_bytes"]["weights"]
    # each model's engine reports under its own name
    text = http.get("/metrics").text
    for name in ("smol", "coder"):
        assert metric(text, "vllm:request_success_total", model_name=name) >= 1
        assert metric(text, "vllm:num_requests_running", model_name=name) == 0


def test_corrupt_model_is_failed_and_the_others_serve(client, http):
    with pytest.raises(openai.APIStatusError) as e:
        ask(client, "broken")
    assert e.value.status_code == 503
    assert e.value.body["code"] == "model_load_failed"
    assert "broken" in e.value.message and "GGUF" in e.value.message
    status = statuses(http)["broken"]
    assert status["value"] == "failed" and status["failed"] is True
    assert "not a valid GGUF file" in status["reason"]
    # found out before any loaded model was unloaded to make room for it (--models-max 2)
    assert statuses(http)["smol"] == statuses(http)["coder"] == {"value": "loaded"}
    # a failed model stays failed (no reload on every request) until asked to load again
    again = http.post("/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 1})
    assert "not a valid GGUF file" in error_of(again, 503, "model_load_failed")
    retry = http.post("/models/load", json={"model": "broken"})
    assert "not a valid GGUF file" in error_of(retry, 503, "model_load_failed")
    assert ask(client, "smol") and ask(client, "coder")
    assert http.get("/health").status_code == 200


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError) as e:
        ask(client, "no-such-model")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert client.models.retrieve("smol").id == "smol"
    error_of(http.post("/models/load", json={"model": "no-such-model"}), 404, "model_not_found")
    error_of(http.post("/models/unload", json={"model": "no-such-model"}), 404, "model_not_found")
    r = http.post("/models/load", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    # with several models a request must name one
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert "smol, coder, broken" in error_of(r, 400, "model_required")


def test_unload_and_load_routes(client, http):
    assert statuses(http)["smol"] == {"value": "loaded"}
    assert http.post("/models/unload", json={"model": "smol"}).json() == {"success": True}
    assert statuses(http)["smol"] == {"value": "unloaded"}
    error_of(http.post("/models/unload", json={"model": "smol"}), 400, "model_not_loaded")
    text = http.get("/metrics").text
    assert metric(text, "vllm:num_requests_running", model_name="smol") is None  # gauges go
    assert http.post("/models/load", json={"model": "smol"}).json() == {"success": True}
    assert statuses(http)["smol"] == {"value": "loaded"}
    error_of(http.post("/models/load", json={"model": "smol"}), 400, "model_already_loaded")
    assert ask(client, "smol")


def test_a_model_is_not_unloaded_while_it_serves(client, http):
    """An unload of a model that is running a request is refused, naming it; the request ends
    normally."""

    def in_flight() -> float:
        text = http.get("/metrics").text
        return sum(metric(text, f"vllm:num_requests_{k}", model_name="coder") or 0
                   for k in ("running", "waiting"))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(
            client.completions.create, model="coder", prompt="def quicksort(xs):",
            max_tokens=100, temperature=0, extra_body={"ignore_eos": True},
        )
        deadline = time.monotonic() + 120
        while not in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        r = http.post("/models/unload", json={"model": "coder"})
        assert "serving 1 request" in error_of(r, 409, "model_busy")
        assert long.result().usage.completion_tokens == 100
    assert statuses(http)["coder"] == {"value": "loaded"}


def test_a_dead_engine_fails_its_model_alone(client, http):
    """An engine loop that dies marks its model failed (a single-model server would exit); the
    other model keeps serving, and the failed one loads again when asked."""
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="smol", prompt=f"Hello {CRASH}", max_tokens=4)
    assert e.value.status_code >= 500
    status = statuses(http)["smol"]
    assert status["value"] == "failed" and "InjectedFault" in status["reason"], status
    assert "its engine stopped" in error_of(
        http.post("/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 2}),
        503, "model_load_failed",
    )
    assert ask(client, "coder") and http.get("/health").status_code == 200
    assert http.post("/models/load", json={"model": "smol"}).json() == {"success": True}
    assert ask(client, "smol")


@pytest.fixture(scope="module")
def lru_server(smollm2_path, qwen_path):
    srv = ServerProcess(
        ["--model", f"smol={smollm2_path}", "--model", f"coder={qwen_path}",
         "--models-max", "1", *SMALL]
    )
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_models_max_1_unloads_the_least_recently_used(lru_server):
    client = openai.OpenAI(base_url=lru_server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    with httpx.Client(base_url=lru_server.url, timeout=60) as http:
        ask(client, "smol")
        assert statuses(http) == {"smol": {"value": "loaded"}, "coder": {"value": "unloaded"}}
        ask(client, "coder")
        assert statuses(http) == {"smol": {"value": "unloaded"}, "coder": {"value": "loaded"}}
        ask(client, "smol")
        assert statuses(http) == {"smol": {"value": "loaded"}, "coder": {"value": "unloaded"}}
    log = lru_server.log()
    assert "unloaded model smol (least recently used, to make room (--models-max) for coder)" in log
    assert "unloaded model coder (least recently used" in log


def test_models_dir_without_autoload_and_a_memory_plan(tmp_path, smollm2_path, qwen_path):
    """``--models-dir``: every .gguf file and model directory, named after it; with
    ``--no-models-autoload`` a request to an unloaded model is refused until it is loaded; a
    model that cannot fit the memory plan is refused with the numbers and stays unloaded; a
    model of an architecture tianxia does not know is failed with the reason."""
    import gguf
    import numpy as np

    models = tmp_path / "models"
    (models / "coder").mkdir(parents=True)
    (models / "coder" / qwen_path.name).symlink_to(qwen_path)
    (models / "SmolLM2.gguf").symlink_to(smollm2_path)
    (models / "notes.txt").write_text("not a model")
    alien = gguf.GGUFWriter(str(models / "alien.gguf"), "alien")  # a well-formed file
    alien.add_block_count(1)
    alien.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    alien.write_header_to_file()
    alien.write_kv_data_to_file()
    alien.write_tensors_to_file()
    alien.close()
    # room for SmolLM2 (93 MiB of weights + 32 MiB of KV cache + 128 MiB) but not Qwen (468 MiB)
    args = ["--models-dir", str(models), "--no-models-autoload", "--models-memory", "400MiB"]
    with ServerProcess(args + SMALL) as srv, httpx.Client(base_url=srv.url, timeout=600) as http:
        assert statuses(http) == {
            n: {"value": "unloaded"} for n in ("SmolLM2", "alien", "coder")
        }
        msg = error_of(http.post("/models/load", json={"model": "alien"}), 503, "model_load_failed")
        assert "architecture 'alien' is not supported" in msg
        assert statuses(http)["alien"]["value"] == "failed"
        r = http.post("/v1/completions", json={"model": "SmolLM2", "prompt": "Hi", "max_tokens": 2})
        assert "/models/load" in error_of(r, 503, "model_not_loaded")
        msg = error_of(http.post("/models/load", json={"model": "coder"}), 503,
                       "model_does_not_fit")
        assert "400 MiB" in msg and "KV cache 32 MiB" in msg and "--models-memory" in msg
        assert statuses(http)["coder"] == {"value": "unloaded"}  # not failed: it may fit later
        assert http.post("/models/load", json={"model": "SmolLM2"}).json() == {"success": True}
        r = http.post("/v1/completions", json={"model": "SmolLM2", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "SmolLM2"
